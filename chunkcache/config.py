"""Typed configuration, loaded from configs/*.yaml. Every knob has a default and a doc line (the field comment)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


def home() -> Path:
    """Root of everything chunkcache writes (models, chunk store): $CHUNKCACHE_HOME or ~/.cache/chunkcache."""
    return Path(os.environ.get("CHUNKCACHE_HOME", Path.home() / ".cache" / "chunkcache")).expanduser()


@dataclass
class StoreConfig:
    host_bytes: int = 2 << 30  # byte budget of the host-memory tier (LRU); 0 disables the tier
    disk_dir: str | None = None  # directory of the disk tier; None disables it
    disk_bytes: int = 20 << 30  # byte budget of the disk tier (oldest entries removed first)
    namespace: str = "default"  # tenant namespace mixed into every chunk key unless a request names its own
    remote_url: str | None = None  # shared Redis/Valkey tier: redis://[:password@]host:port/db, rediss:// for TLS; None: off
    remote_timeout_s: float = 0.25  # connect and socket timeout per command: the most a down or stalled server costs
    remote_retry_s: float = 5.0  # after a failure the remote tier is skipped (gets miss, puts dropped) this long
    remote_max_value_bytes: int = 512 << 20  # larger entries stay local (lowered to the server's proto-max-bulk-len)
    remote_write_queue: int = 64  # entries waiting for the background writer; a put beyond this is dropped


@dataclass
class DraftConfig:
    model: str = "self"  # draft/auxiliary model: "self" (target truncated to `layers`), a model name, or a path
    layers: int | None = None  # layers of the draft to run (None = all; for "self", default a third of the target)
    dtype: str = "float32"  # dtype the draft runs in


@dataclass
class SelectConfig:
    selector: str = "prophet"  # default selector: full, none, epic, cacheblend, prophet, spec or clip
    ratio: float = 0.15  # recompute budget rho over reused context tokens, in [0, 1]
    options: dict[str, Any] = field(default_factory=dict)  # per-selector keyword options, keyed by selector name


@dataclass
class ServeConfig:
    model: str = "smollm2-135m-instruct"  # model name (see `chunkcache model`) or a local HF directory
    host: str = "127.0.0.1"  # address the HTTP server binds
    port: int = 30000  # port the HTTP server binds
    mem_fraction_static: float = 0.3  # share of memory SGLang reserves for weights + KV pool (explicit: CPU needs it)
    max_total_tokens: int | None = None  # KV pool size in tokens (None: SGLang sizes it from memory)
    dtype: str = "auto"  # SGLang --dtype of weights, activations and KV; "auto": bfloat16 on CPU, SGLang's auto on GPU
    sleep_on_idle: bool = True  # idle scheduler blocks on its sockets instead of busy-polling a core
    sglang_args: list[str] = field(default_factory=list)  # extra arguments passed verbatim to SGLang


@dataclass
class Config:
    serve: ServeConfig = field(default_factory=ServeConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    store: StoreConfig = field(default_factory=StoreConfig)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "Config":
        if path is None:
            return cls()
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
        return _build(cls, raw, str(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(fields)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; expected some of {sorted(fields)}")
    kwargs = {}
    for name, value in raw.items():
        sub = fields[name].default_factory if fields[name].default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            if not isinstance(value, dict):
                raise ValueError(f"{where}: '{name}' must be a mapping")
            kwargs[name] = _build(sub, value, f"{where}:{name}")
        else:
            kwargs[name] = value
    return cls(**kwargs)
