"""SGLang settings for a chunkcache server, shared by the CLI (`chunkcache serve`), tests and benchmarks."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from chunkcache.config import Config, LimitsConfig, config_file
from chunkcache.cpu_dtype import fastest_cpu_dtype
from chunkcache.models import hub_id_problem

log = logging.getLogger(__name__)
BACKEND_NAME = "chunkcache"  # --radix-cache-backend name registered by the plugin
CONFIG_ENV = "CHUNKCACHE_CONFIG"  # how the scheduler process finds the --config file
# store.remote_url from `chunkcache serve --remote-url` or the environment (keeps a password out of the YAML file);
# it overrides the config file's
REMOTE_URL_ENV = "CHUNKCACHE_REMOTE_URL"
AUTO_CHUNKS_ENV = "CHUNKCACHE_AUTO_CHUNKS"  # "1": automatic chunk detection on, whatever the config says
# serve.cpu_linear of a server chunkcache set up on a host without a GPU (both sides of an A/B); unset: SGLang's own
CPU_LINEAR_ENV = "CHUNKCACHE_CPU_LINEAR"


# the memory share a CPU server reserves unless its config sets one: SGLang's automatic one comes out negative on a
# CPU (and refuses to start); on a GPU SGLang's own fraction stands
CPU_MEM_FRACTION = 0.3


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def server_settings(model_path: str | Path, config: Config, *, chunk_reuse: bool = True) -> dict:
    """ServerArgs fields for this host. chunk_reuse=False gives stock SGLang (prefix caching) on the same settings,
    the B side of an A/B comparison."""
    s = config.serve
    settings: dict = {"model_path": str(model_path), "host": s.host, "port": s.port, "dtype": s.dtype,
                      "sleep_on_idle": s.sleep_on_idle}
    if s.mem_fraction_static is not None:
        settings["mem_fraction_static"] = s.mem_fraction_static
    if s.max_total_tokens:
        settings["max_total_tokens"] = s.max_total_tokens
    if chunk_reuse:
        settings["radix_cache_backend"] = BACKEND_NAME
    if config.decode.specache.enabled:
        # a K group of SpeCache's low-bit copy is one page, so the radix tree shares whole groups
        settings["page_size"] = config.decode.specache.group
    if not has_gpu():
        # SGLang's CPU engine without AMX or a CPU sgl_kernel build: torch-native attention, no CUDA graphs, and an
        # explicit memory fraction (the automatic one comes out negative on CPU and SGLang refuses to start).
        settings.update(device="cpu", attention_backend=s.cpu_attention, disable_cuda_graph=True,
                        disable_overlap_schedule=True)
        settings.setdefault("mem_fraction_static", CPU_MEM_FRACTION)
        if s.dtype == "auto":
            # SGLang's "auto" is the checkpoint's dtype, float16 for a float32 one (2 GFLOP/s on a CPU): the host's
            # fastest of bfloat16 and float32 instead, measured once per host (chunkcache.cpu_dtype)
            settings["dtype"] = fastest_cpu_dtype().dtype
    return settings


def cpu_engine_for_stock_command(server_args, *args, **kwargs) -> None:
    """Before SGLang resolves a chunkcache server's arguments on a host without a GPU (plugin.hooks()): what
    `chunkcache serve` sets for this host, for a server started by SGLang's own command (`python -m
    sglang.launch_server --radix-cache-backend chunkcache`). Each field of `server_settings` the command left at
    SGLang's default takes the setting's value; the ones it gave win. SGLANG_USE_CPU_ENGINE is set here, in the main
    process before the scheduler is spawned: the scheduler's platform (CPU kernels, rotary embedding) is chosen from
    it when its modules are imported."""
    if server_args.radix_cache_backend != BACKEND_NAME or has_gpu():
        return
    import msgspec

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    config = load_server_config()
    os.environ[CPU_LINEAR_ENV] = config.serve.cpu_linear
    ranks = server_args.tp_size * server_args.pp_size * server_args.dp_size
    if ranks > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ and len(_numa_nodes()) < ranks:
        # SGLang binds one NUMA node per rank unless told otherwise, and stops when there are fewer nodes than ranks
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cores_per_rank(sorted(os.sched_getaffinity(0)), ranks)
        log.info("chunkcache: %d ranks on %d NUMA node(s): SGLANG_CPU_OMP_THREADS_BIND=%s", ranks,
                 len(_numa_nodes()), os.environ["SGLANG_CPU_OMP_THREADS_BIND"])
    defaults = {f.name: f.default for f in msgspec.structs.fields(type(server_args))}
    applied = {}
    for key, value in server_settings(server_args.model_path, config).items():
        if key not in ("model_path", "host", "port") and getattr(server_args, key) == defaults[key] != value:
            setattr(server_args, key, value)
            applied[key] = value
    if applied:
        log.info("chunkcache: no GPU, SGLang's CPU engine with %s (what `chunkcache serve` passes)",
                 " ".join(to_argv(applied)))


def cores_per_rank(cores: list[int], ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` CPU ranks sharing `cores`: contiguous equal shares, "0-3|4-7"."""
    if len(cores) < ranks:
        raise ValueError(f"{ranks} CPU ranks (tp x pp x dp) need at least as many cores; this process may use "
                         f"{len(cores)}")
    share = len(cores) // ranks
    groups = [cores[r * share: (r + 1) * share] for r in range(ranks)]
    return "|".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" if g[-1] - g[0] == len(g) - 1
                    else ",".join(map(str, g)) for g in groups)


def _numa_nodes() -> list[str]:
    return sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))


def cpu_groups_without_nccl(original, *args, **kwargs):
    """AROUND SGLang's init_model_parallel_group on the CPU engine: its groups communicate over gloo (the CPU
    platform's backend), never through the NCCL communicator SGLang otherwise builds for every group of more than one
    rank, which stops a CPU engine's start with tensor parallelism ("Expected a cuda device, but got: cpu")."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and not has_gpu():
        kwargs["use_pynccl"] = False
    return original(*args, **kwargs)


def prepare_environment(config_path: str | Path | None) -> None:
    """Environment every SGLang process inherits (the scheduler is a spawned child)."""
    if not has_gpu():
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        os.environ[CPU_LINEAR_ENV] = Config.load(config_path).serve.cpu_linear
    if config_path is not None:
        os.environ[CONFIG_ENV] = str(config_file(config_path).resolve())


def load_config(path: str | Path | None) -> Config:
    """A server's config: the selector names and options checked too, so that a bad one stops the server at start
    instead of making every request that names it fall back."""
    from chunkcache.select import REGISTRY  # torch and transformers: not for the modules that only need constants

    return Config.load(path, selectors=REGISTRY)


def load_server_config() -> Config:
    """The config the server was started with, as seen from any SGLang process."""
    config = load_config(os.environ.get(CONFIG_ENV))
    if os.environ.get(REMOTE_URL_ENV):
        config.store.remote_url = os.environ[REMOTE_URL_ENV]
    if os.environ.get(AUTO_CHUNKS_ENV) == "1":
        config.auto.enabled = True
    return config


@functools.cache
def server_limits() -> LimitsConfig:
    """The server's request limits, read once per process (the HTTP routes check every request against them)."""
    return load_server_config().limits


def to_argv(settings: dict) -> list[str]:
    argv = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


def parallel_problems(server_args, hf_config) -> str | None:
    """Why the blend cannot serve this parallel layout correctly, or None. Tensor parallelism is served: every
    decision that fixes a forward's rows is agreed over the ranks (chunkcache.ranks), and the selection features are
    reduced over the ranks' heads, which must split evenly (a padded head would add its uniform attention to the
    query's, a replicated KV head would count twice in the deviation)."""
    if getattr(server_args, "enable_dp_attention", False) or getattr(server_args, "attn_dp_size", 1) > 1:
        return ("DP attention (--attn-dp-size, --enable-dp-attention): its DP ranks run their forwards in lockstep "
                "over all-gathered token counts, where a blend runs several forwards for its batch and the other DP "
                "ranks one")
    if getattr(server_args, "pp_size", 1) > 1:
        return ("pipeline parallelism (--pp-size): only the first stage would blend, sending the later stages its "
                "recomputed rows where they expect every extend token, and no stage sees the attention of all the "
                "layers its selection reads")
    for flag in ("attn_cp_size", "dcp_size"):
        if getattr(server_args, flag, 1) > 1:
            return (f"context parallelism (--{flag.replace('_', '-')}): it splits a prompt's tokens or KV over ranks, "
                    f"which the blend's passes address as one sequence")
    for flag in ("enable_attn_tp_input_scattered", "enable_layernorm_sp"):
        if getattr(server_args, flag, False):
            return (f"--{flag.replace('_', '-')}: it scatters a forward's rows over the ranks, which the blend's "
                    f"passes address as one sequence")
    tp = getattr(server_args, "tp_size", 1)
    c = getattr(hf_config, "text_config", hf_config)
    heads = getattr(c, "original_num_attention_heads", c.num_attention_heads)
    kv_heads = getattr(c, "original_total_num_kv_heads", getattr(c, "num_key_value_heads", None) or heads)
    if tp > 1 and (heads % tp or kv_heads % tp):
        return (f"--tp-size {tp} on a model of {heads} query and {kv_heads} KV heads: SGLang pads or replicates "
                f"heads that do not split evenly, and the blend's selection features, reduced over the ranks' heads, "
                f"would count them; a --tp-size that divides both is served")
    return None


def speculative_problems(server_args) -> str | None:
    """Why the blend cannot serve this server's speculative decoding, or None (none asked for). Refused whatever the
    algorithm: it has never run with chunk reuse, since SGLang's CPU engine does not start it without the CPU build
    of sgl_kernel (NGRAM stops at the KV pool's copy kernel, `copy_all_layer_kv_cache_cpu`), and what it would meet is
    known: its verify and draft-extend forwards take the extend path the blend replaces for a prompt's prefill, and a
    draft model (EAGLE, MTP, STANDALONE) extends over the target's hidden states of every prompt token, where a blend
    computes the recomputed tokens' only. `--enable-return-aux-hidden-states` makes `--speculative-algorithm` name a
    capture convention, with no speculative decoding (SGLang resets it to None)."""
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if not algorithm or getattr(server_args, "enable_return_aux_hidden_states", False):
        return None
    return (f"speculative decoding (--speculative-algorithm {algorithm}): its verify and draft-extend forwards take the "
            f"extend path the blend replaces for a prompt's prefill, a draft model (EAGLE, MTP, STANDALONE) extends over "
            f"the hidden states of every prompt token where a blend computes its recomputed tokens' only, and it has "
            f"never run with chunk reuse (SGLang's CPU engine does not start it without sgl_kernel's CPU build)")


def deployment_problems(server_args) -> str | None:
    """Why chunk reuse cannot be served in this deployment of SGLang's processes, or None (one server, one host, no
    PD multiplexing). The fields are read directly, not with a default: one SGLang renamed stops every server instead
    of letting the mode through unchecked."""
    if server_args.disaggregation_mode != "null":
        return (f"prefill/decode disaggregation (--disaggregation-mode {server_args.disaggregation_mode}): a prefill "
                f"server hands each prompt's KV to a decode server over a transfer backend, through event loops of "
                f"their own on each side, which chunk reuse has never run through (the blend's approximate KV, its "
                f"report and its fallbacks would cross servers)")
    if server_args.nnodes > 1:
        return (f"multi-node serving (--nnodes {server_args.nnodes}): the agreements between tensor-parallel ranks "
                f"(chunkcache.ranks) have only been tested over one host's gloo group")
    if server_args.enable_pdmux:
        return ("PD multiplexing (--enable-pdmux): it runs prefills layer by layer (ForwardMode.SPLIT_PREFILL), "
                "outside the forward the blend hooks")
    for flag, field in (("--enable-hierarchical-cache", "enable_hierarchical_cache"), ("--enable-lmcache",
                                                                                        "enable_lmcache")):
        if getattr(server_args, field):  # read directly, as above: a renamed field stops the server
            return (f"{flag}: it builds a tree cache of its own (host or storage tiers behind the radix tree) in place "
                    f"of the chunkcache backend's, which chunk reuse has never run with (a blended request's "
                    f"approximate KV would be offloaded and matched as an exact prefix); chunkcache keeps chunk KV in "
                    f"its own tiers (store.host_bytes, store.disk_dir, store.remote_url)")
    return None


def audit_problems(server_args, config: Config) -> str | None:
    """Why chunk reuse cannot be served with this config's online audit on these settings, or None."""
    if config.audit.rate > 0 and server_args.tp_size > 1:
        return (f"the online audit (audit.rate {config.audit.rate}) under tensor parallelism (--tp-size "
                f"{server_args.tp_size}): its full recompute would be a collective forward every rank must enter with "
                f"the same prompt, and nothing agrees the sample, the queue or the outcome over the ranks; set "
                f"audit.rate: 0 to serve with tensor parallelism")
    return None


def serving_problems(server_args, hf_config, config: Config) -> str | None:
    """Why chunk reuse cannot be served with these SGLang settings, this model and this chunkcache config, or None:
    the first problem found. The one check of both places that refuse a server: `chunkcache serve` before it
    launches SGLang, and the scheduler's radix-cache factory, which a server started by SGLang's own command reaches
    at start-up."""
    return (sglang_problems() or hub_id_problem(getattr(server_args, "model_path", ""))
            or parallel_problems(server_args, hf_config) or speculative_problems(server_args)
            or deployment_problems(server_args) or audit_problems(server_args, config))


def sglang_problems(installed: str | None = None) -> str | None:
    """Why the installed SGLang (`installed`: its version, read when None) is not the one chunkcache was tested with,
    or None. chunkcache's hooks and backends target that version's internals (sglang_patch.plugin), so another
    version is refused rather than served half-patched. The tested version is the package's own pin (pyproject.toml),
    read from its installed metadata; a source tree that was never installed has none and is not checked."""
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement

    try:
        pins = [Requirement(r) for r in requires("chunkcache") or ()]
    except PackageNotFoundError:
        return None
    tested = next((r.specifier for r in pins if r.name == "sglang" and r.marker is None), None)
    installed = installed or version("sglang")
    if tested is None or tested.contains(installed, prereleases=True):
        return None
    return (f"SGLang {installed} (chunkcache was tested with sglang{tested}, whose internals its hooks target); "
            f"install sglang{tested}")
