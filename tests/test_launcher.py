"""The SGLang settings `chunkcache serve` starts both sides of the A/B comparison with."""

import argparse
import os

import pytest

from chunkcache.config import Config
from chunkcache.cpu_dtype import Choice
from sglang_patch.serve import launcher


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(launcher, "has_gpu", lambda: False)


@pytest.mark.parametrize("fastest", ["bfloat16", "float32"])
@pytest.mark.parametrize("chunk_reuse", [True, False])
def test_cpu_serves_the_hosts_fastest_dtype_and_sleeps_when_idle(cpu, monkeypatch, chunk_reuse, fastest):
    monkeypatch.setattr(launcher, "fastest_cpu_dtype", lambda: Choice(fastest, {}, "host"))
    settings = launcher.server_settings("/models/m", Config(), chunk_reuse=chunk_reuse)
    assert settings["dtype"] == fastest and settings["sleep_on_idle"] is True
    assert settings["device"] == "cpu" and settings["attention_backend"] == "chunkcache_torch"
    assert (settings.get("radix_cache_backend") == launcher.BACKEND_NAME) == chunk_reuse


def test_dtype_and_sleep_on_idle_come_from_the_config(cpu, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("serve:\n  dtype: float32\n  sleep_on_idle: false\n")
    argv = launcher.to_argv(launcher.server_settings("/models/m", Config.load(path)))
    assert argv[argv.index("--dtype") + 1] == "float32" and "--sleep-on-idle" not in argv


def test_gpu_leaves_the_dtype_to_sglang(monkeypatch):
    monkeypatch.setattr(launcher, "has_gpu", lambda: True)
    settings = launcher.server_settings("/models/m", Config())
    assert settings["dtype"] == "auto" and "device" not in settings


def test_packaged_default_is_the_built_in_default():
    assert Config.load().to_dict() == Config().to_dict()


def test_sglang_parses_every_setting_back(cpu):
    """The argv `chunkcache serve` hands to sglang.launch_server means what the settings say (flag names included)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # as sglang.launch_server does before parsing: the plugin registers its attention backend
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    settings = launcher.server_settings("/models/m", Config())
    args = vars(parser.parse_args(launcher.to_argv(settings)))
    assert {key: args[key] for key in settings} == settings


def test_cpu_attention_backend_comes_from_the_config(cpu, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("serve:\n  cpu_attention: torch_native\n")
    assert launcher.server_settings("/models/m", Config.load(path))["attention_backend"] == "torch_native"
    path.write_text("serve:\n  cpu_attention: flashinfer\n")
    with pytest.raises(ValueError, match="cpu_attention"):
        Config.load(path)


def stock_command_args(*argv: str):
    """ServerArgs as `python -m sglang.launch_server ARGV` has them when it resolves them (plugins loaded first)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    return prepare_server_args(["--model-path", "/models/m", *argv])


def test_stock_command_on_cpu_gets_the_cpu_engine_and_keeps_its_own_flags(cpu, monkeypatch):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    monkeypatch.delenv(launcher.CONFIG_ENV, raising=False)
    monkeypatch.setattr(launcher, "fastest_cpu_dtype", lambda: Choice("bfloat16", {}, "host"))
    args = stock_command_args("--radix-cache-backend", "chunkcache", "--dtype", "float32")
    launcher.cpu_engine_for_stock_command(args)
    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
    expected = launcher.server_settings("/models/m", Config.load())
    for key in ("device", "attention_backend", "disable_cuda_graph", "disable_overlap_schedule",
                "mem_fraction_static", "sleep_on_idle"):
        assert getattr(args, key) == expected[key], key
    assert args.dtype == "float32"  # given on the command line: not this host's CPU default (bfloat16 here)
    assert (args.host, args.port) == ("127.0.0.1", 30000)


@pytest.mark.parametrize("gpu, argv", [(True, ["--radix-cache-backend", "chunkcache"]), (False, [])])
def test_stock_command_is_left_alone_on_gpu_or_without_chunk_reuse(monkeypatch, gpu, argv):
    monkeypatch.setattr(launcher, "has_gpu", lambda: gpu)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    args = stock_command_args(*argv)
    before = repr(args)
    launcher.cpu_engine_for_stock_command(args)
    assert repr(args) == before and "SGLANG_USE_CPU_ENGINE" not in os.environ


# ---- parallel layouts: tensor parallelism served, the others refused with the reason ---------------------------------

def _args(**overrides):
    fields = dict(tp_size=1, pp_size=1, attn_dp_size=1, enable_dp_attention=False, attn_cp_size=1, dcp_size=1,
                  enable_attn_tp_input_scattered=False, enable_layernorm_sp=False, disaggregation_mode="null", nnodes=1,
                  enable_pdmux=False, enable_hierarchical_cache=False, enable_lmcache=False)
    return argparse.Namespace(**{**fields, **overrides})


HEADS = argparse.Namespace(num_attention_heads=8, num_key_value_heads=2)


@pytest.mark.parametrize("overrides, named", [
    (dict(pp_size=2), "pipeline parallelism"), (dict(enable_dp_attention=True, tp_size=2), "DP attention"),
    (dict(attn_dp_size=2), "DP attention"), (dict(attn_cp_size=2), "context parallelism"),
    (dict(dcp_size=2), "context parallelism"), (dict(enable_layernorm_sp=True), "--enable-layernorm-sp"),
    (dict(tp_size=4), "--tp-size 4 on a model of 8 query and 2 KV heads")])
def test_a_parallel_layout_the_blend_cannot_serve_is_named_with_its_reason(overrides, named):
    assert named in launcher.parallel_problems(_args(**overrides), HEADS)


def test_tensor_parallelism_over_evenly_split_heads_is_served():
    assert launcher.parallel_problems(_args(tp_size=2), HEADS) is None
    assert launcher.parallel_problems(_args(), argparse.Namespace(num_attention_heads=9, num_key_value_heads=3)) is None
    # SGLang pads a CPU model's heads in place: the original counts decide
    padded = argparse.Namespace(num_attention_heads=10, num_key_value_heads=4, original_num_attention_heads=9,
                                original_total_num_kv_heads=3)
    assert "9 query and 3 KV heads" in launcher.parallel_problems(_args(tp_size=2), padded)


# ---- speculative decoding: refused with the reason, whatever the algorithm ------------------------------------------

@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE", "EAGLE3", "NEXTN", "STANDALONE"])
def test_speculative_decoding_is_refused_naming_the_algorithm(algorithm):
    refused = launcher.speculative_problems(_args(speculative_algorithm=algorithm))
    assert refused.startswith(f"speculative decoding (--speculative-algorithm {algorithm}): ")
    assert "draft model" in refused and "never run with chunk reuse" in refused


def test_no_speculative_decoding_or_only_its_hidden_state_capture_is_served():
    assert launcher.speculative_problems(_args()) is None
    assert launcher.speculative_problems(_args(speculative_algorithm=None)) is None
    # SGLang: with --enable-return-aux-hidden-states the algorithm only names the capture convention, no draft runs
    assert launcher.speculative_problems(_args(speculative_algorithm="EAGLE3",
                                               enable_return_aux_hidden_states=True)) is None


# ---- deployments and the audit: refused with the reason, by `chunkcache serve` and at the scheduler's start ----------

AUDITED = "audit:\n  rate: 0.1\n"  # a chunkcache config that audits a tenth of the blends


@pytest.mark.parametrize("overrides, named", [
    ({"disaggregation_mode": "prefill"}, "prefill/decode disaggregation (--disaggregation-mode prefill): "),
    ({"disaggregation_mode": "decode"}, "prefill/decode disaggregation (--disaggregation-mode decode): "),
    ({"nnodes": 2}, "multi-node serving (--nnodes 2): "),
    ({"enable_pdmux": True}, "PD multiplexing (--enable-pdmux): "),
    ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache: it builds a tree cache of its own"),
    ({"enable_lmcache": True}, "--enable-lmcache: it builds a tree cache of its own")])
def test_a_deployment_chunk_reuse_has_not_run_in_is_named_with_its_reason(overrides, named):
    refused = launcher.serving_problems(_args(**overrides), HEADS, Config())
    assert refused.startswith(named) and len(refused) > len(named)


def test_the_audit_is_refused_under_tensor_parallelism_only(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(AUDITED)
    audited = Config.load(path)
    refused = launcher.serving_problems(_args(tp_size=2), HEADS, audited)
    assert refused.startswith("the online audit (audit.rate 0.1) under tensor parallelism (--tp-size 2): ")
    assert launcher.serving_problems(_args(), HEADS, audited) is None
    assert launcher.serving_problems(_args(tp_size=2), HEADS, Config()) is None


def test_sglangs_default_settings_are_served():
    """The checks read SGLang's own field names: a ServerArgs as SGLang builds it passes them all."""
    from sglang.srt.server_args import ServerArgs

    assert launcher.serving_problems(ServerArgs(model_path="/models/m"), HEADS, Config()) is None


@pytest.mark.parametrize("overrides, config_text, named", [
    ({"speculative_algorithm": "NGRAM"}, "", "speculative decoding (--speculative-algorithm NGRAM)"),
    ({"disaggregation_mode": "prefill"}, "", "prefill/decode disaggregation (--disaggregation-mode prefill)"),
    ({"nnodes": 2}, "", "multi-node serving (--nnodes 2)"),
    ({"enable_pdmux": True}, "", "PD multiplexing (--enable-pdmux)"),
    ({"tp_size": 2}, AUDITED, "the online audit (audit.rate 0.1) under tensor parallelism (--tp-size 2)")])
def test_a_scheduler_started_by_sglangs_own_command_refuses_with_the_same_reason(monkeypatch, tmp_path, overrides,
                                                                                config_text, named):
    """The radix-cache factory (what `python -m sglang.launch_server --radix-cache-backend chunkcache` reaches at the
    scheduler's start) stops it with the reason `chunkcache serve` gives, before it builds anything."""
    from sglang_patch.scheduler import cache

    path = tmp_path / "c.yaml"
    path.write_text(config_text)
    monkeypatch.setenv(launcher.CONFIG_ENV, str(path))  # the scheduler's config, as `chunkcache serve` passes it
    ctx = argparse.Namespace(server_args=_args(**overrides), model_config=argparse.Namespace(hf_config=HEADS))
    with pytest.raises(ValueError) as refused:
        cache.factory(ctx)
    assert str(refused.value).startswith(f"chunkcache: chunk reuse cannot be served with {named}: ")


@pytest.mark.parametrize("argv, config_text, named", [
    (["--pp-size", "2"], "", "pipeline parallelism (--pp-size)"),
    (["--speculative-algorithm", "NGRAM"], "", "speculative decoding (--speculative-algorithm NGRAM)"),
    (["--disaggregation-mode", "decode"], "", "prefill/decode disaggregation (--disaggregation-mode decode)"),
    (["--nnodes", "2"], "", "multi-node serving (--nnodes 2)"),
    (["--enable-pdmux"], "", "PD multiplexing (--enable-pdmux)"),
    (["--tp-size", "2"], AUDITED, "the online audit (audit.rate 0.1) under tensor parallelism (--tp-size 2)")])
def test_chunkcache_serve_refuses_before_starting_sglang(tmp_path, argv, config_text, named):
    import subprocess
    import sys

    from chunkcache.models import tiny_model

    path = tmp_path / "c.yaml"
    path.write_text(config_text)
    # the tiny model's 4 query and 2 KV heads split evenly over --tp-size 2: the audit is what refuses that one
    proc = subprocess.run([sys.executable, "-m", "sglang_patch.serve.cli", "serve", "--model", str(tiny_model()),
                           "--chunkcache-config", str(path), *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"chunk reuse cannot be served with {named}: " in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "sglang.launch_server" not in proc.stdout


def test_cores_are_shared_evenly_between_cpu_ranks():
    assert launcher.cores_per_rank([0, 1], 2) == "0|1"
    assert launcher.cores_per_rank(list(range(8)), 2) == "0-3|4-7"
    assert launcher.cores_per_rank([0, 2, 4, 6], 2) == "0,2|4,6"
    with pytest.raises(ValueError, match="need at least as many cores"):
        launcher.cores_per_rank([0], 2)


@pytest.mark.parametrize("gpu", [True, False])
def test_the_memory_share_is_the_cpus_setting_only_without_a_gpu(monkeypatch, gpu):
    """A GPU server keeps SGLang's own memory fraction (a CPU share would shrink its KV pool); a CPU server gets
    CPU_MEM_FRACTION, SGLang's automatic one being negative there; a configured share is kept on both."""
    monkeypatch.setattr(launcher, "has_gpu", lambda: gpu)
    monkeypatch.setattr(launcher, "fastest_cpu_dtype", lambda: Choice("bfloat16", {}, "host"))
    config = Config.load()
    settings = launcher.server_settings("/models/m", config)
    assert settings.get("mem_fraction_static") == (None if gpu else launcher.CPU_MEM_FRACTION)
    assert ("device" in settings) is not gpu
    config.serve.mem_fraction_static = 0.8
    assert launcher.server_settings("/models/m", config)["mem_fraction_static"] == 0.8
