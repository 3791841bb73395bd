"""Typed configuration, loaded from YAML (chunkcache/configs/*.yaml are packaged with the code: `default`, the one a
server without --chunkcache-config runs on, and named variants), then from one environment variable per knob,
CHUNKCACHE_<SECTION>__<KEY> (`env_name`). Every knob is a `knob(default, doc)`: its doc line is the field's metadata,
which the reference page reads (chunkcache/config_reference.py writes docs/configuration.md).

A value of the wrong type or out of range is refused when the config is loaded (ValueError naming the key, or the
variable, and the reason), so a server never starts on a config that would make it fall back on every request.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import Field, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Protocol

import yaml

log = logging.getLogger(__name__)
PACKAGED = Path(__file__).with_name("configs")  # package data: shipped in the wheel beside this module
ENV_PREFIX = "CHUNKCACHE_"  # of every knob's variable; one without "__" names no knob ($CHUNKCACHE_CONFIG, _HOME)
DOC = "doc"  # the field metadata key of a knob's doc line
REMOTE_SECRET_ENV = "CHUNKCACHE_STORE_SECRET"  # store.remote_secret_env's default: the shared tier's HMAC secret
REMOTE_SECRET_MIN_BYTES = 16  # shorter secrets are refused: a stored value's MAC lets anyone guess it offline
MASK = "<redacted>"  # a secret's place in `Config.effective` (SGLang's own mark in /server_info)

# a byte size: an int to everything that reads the config; a file or a variable may write it "2GiB" (parse_bytes)
Bytes = int
# the units parse_bytes reads, case-insensitively: SI's powers of 1000 and IEC's of 1024
BYTE_UNITS = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def home() -> Path:
    """Root of everything chunkcache writes (models, chunk store): $CHUNKCACHE_HOME or ~/.cache/chunkcache."""
    return Path(os.environ.get("CHUNKCACHE_HOME", Path.home() / ".cache" / "chunkcache")).expanduser()


def knob(default: Any, doc: str) -> Any:
    """A config field: its default (a list or dict is copied for each instance) and its doc line."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={DOC: doc})
    return field(default=default, metadata={DOC: doc})


@dataclass
class StoreConfig:
    """The chunk store: position-independent chunk KV by content hash, in a host-memory tier, an optional disk tier
    and an optional remote (Redis/Valkey) tier shared by servers (docs/shared-store.md)."""

    host_bytes: Bytes = knob(2 << 30, "byte budget of the host-memory tier (LRU); 0 disables the tier")
    pin_memory: bool | None = knob(
        None, "host-tier KV in page-locked memory: the copy into a GPU's pool runs without blocking and 4x faster "
        "(H200: docs/bench/gpu.md); null: when torch sees a CUDA device. It takes host_bytes of RAM the OS cannot "
        "page out")
    disk_dir: str | None = knob(None, "directory of the disk tier; null disables it")
    disk_bytes: Bytes = knob(20 << 30, "byte budget of the disk tier (oldest entries removed first)")
    namespace: str = knob("default", "tenant namespace mixed into every chunk key unless a request names its own")
    clear_on_flush: bool = knob(
        False, "SGLang's /flush_cache also empties this server's memory and disk tiers and what it learned (queued "
        "encodes and deviations, detection's sightings), never the shared tier. Off: /flush_cache drops SGLang's "
        "radix tree and KV pool alone, the one way SGLang offers to, which `chunkcache bench` and the tests use to "
        "make requests read their chunks from the store (docs/security.md \"Who may call what\")")
    remote_url: str | None = knob(
        None, "Redis/Valkey tier shared by servers: redis://[:pw@]host:port/db, rediss://; a Valkey/Redis Cluster "
        "instead: redis+cluster://[:pw@]host:port[,host:port...] (seeds; rediss+cluster:// TLS), entries spread over "
        "its primaries, each with its own breaker (docs/shared-store.md \"A cluster\"); null: off")
    remote_timeout_s: float = knob(
        0.25, "connect and socket timeout per command, in (0, 60]: the most a down or stalled server costs")
    remote_retry_s: float = knob(
        5.0, "after a failure the remote tier is skipped (gets miss, puts dropped) this many seconds")
    remote_max_value_bytes: Bytes = knob(
        512 << 20, "larger entries stay local (lowered to the server's proto-max-bulk-len)")
    remote_write_queue: int = knob(64, "entries waiting for the background writer; a put beyond this is dropped")
    compress: str = knob(
        "int8", "K and V as the disk and remote tiers write them: none, int8 or int4 (chunkcache/store/codec.py; "
        "SmolLM2: 56 % / 31 % of the bytes), decoded on read, the host tier full width. int8 moved first-token KL "
        "by under 1 % on every family measured, int4 by +9 % (docs/bench/compression.md); a server older than "
        "compression drops int8 entries")
    remote_fetch: str = knob(
        "auto", "which remote entries a request fetches: auto, those predicted faster to fetch than to compute here "
        "(each server's measured latency and bandwidth against this server's measured compute per token; "
        "docs/shared-store.md \"Fetch or compute\"); always, every one the local tiers lack; never, none (the tier "
        "is written, not read)")
    remote_probe_s: float = knob(
        30.0, "a link judged slower than computing is fetched from again after this many seconds, to follow a link "
        "that got faster")
    remote_secret_env: str = knob(
        REMOTE_SECRET_ENV, "environment variable holding the remote tier's secret, the same on every server sharing "
        "the store (at least 16 bytes; e.g. `openssl rand -hex 32`): every value the tier writes carries an "
        "HMAC-SHA256 of its key name and bytes under it, and one that fails is a counted miss (`forged`), deleted. "
        "Required when remote_url is set; the secret itself is never in a config file (docs/shared-store.md "
        "\"Authentication\")")

    def check(self) -> None:
        _at_least(self, "host_bytes", 0)
        _one_of(self, "compress", ("none", "int8", "int4"))  # store.codec.NAMES
        _one_of(self, "remote_fetch", ("auto", "always", "never"))  # store.remote.FETCH
        _at_least(self, "remote_probe_s", 0)
        _at_least(self, "disk_bytes", 1)
        _non_empty(self, "disk_dir", "namespace")
        if self.remote_url is not None:
            _check_remote_url(self.remote_url)
        if not 0.0 < self.remote_timeout_s <= 60.0:  # 0 would make redis-py's sockets non-blocking
            raise ConfigError("remote_timeout_s", f"must be in (0, 60], got {self.remote_timeout_s}")
        _at_least(self, "remote_retry_s", 0)
        _at_least(self, "remote_max_value_bytes", 1)
        _at_least(self, "remote_write_queue", 1)
        _non_empty(self, "remote_secret_env")
        if self.remote_url is not None:
            self.remote_secret()

    def remote_secret(self) -> bytes:
        """The remote tier's HMAC secret, from the variable `remote_secret_env` names (surrounding whitespace, such
        as a file's trailing newline, stripped); ConfigError saying what to set when it is unset, empty or short."""
        value = os.environ.get(self.remote_secret_env, "").strip().encode()
        if len(value) < REMOTE_SECRET_MIN_BYTES:
            found = f"is {len(value)} bytes long" if value else "is unset or empty"
            raise ConfigError("remote_secret_env", (
                f"store.remote_url is set, but ${self.remote_secret_env} {found}: set it on every server sharing the "
                f"store to one secret of at least {REMOTE_SECRET_MIN_BYTES} bytes (e.g. `export "
                f"{self.remote_secret_env}=$(openssl rand -hex 32)`); the remote tier authenticates every value with "
                f"it (docs/shared-store.md \"Authentication\")"))
        return value


def _check_remote_url(url: str) -> None:
    scheme, _, rest = url.partition("://")
    shown = rest.split("@")[-1]  # never a password
    if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        raise ConfigError("remote_url", f"must be a redis://, rediss://, redis+cluster:// or rediss+cluster:// URL, "
                                        f"got {scheme}://...{shown!r}")
    if not scheme.endswith("+cluster"):
        return
    hosts, _, path = shown.partition("/")
    if path.partition("?")[0] not in ("", "0"):
        raise ConfigError("remote_url", f"a cluster has database 0 only, got ...{shown!r}")
    for seed in hosts.partition("?")[0].split(","):
        host, colon, port = seed.rpartition(":")
        if not (host and colon and port.isdigit()):
            raise ConfigError("remote_url", f"cluster seeds are host:port[,host:port...], got ...{shown!r}")


@dataclass
class DraftConfig:
    """The draft (auxiliary) model of the selectors that score tokens with one (spec, clip), unless their options name
    their own."""

    model: str = knob("self", "draft model: \"self\" (the target truncated to `layers`), a model name, or a path")
    layers: int | None = knob(None, "layers of the draft to run; null: all (for \"self\", a third of the target's)")
    dtype: str = knob("float32", "dtype the draft runs in: float32, float16 or bfloat16")

    def check(self) -> None:
        _non_empty(self, "model")
        _at_least(self, "layers", 1)
        _one_of(self, "dtype", ("float32", "float16", "bfloat16"))


# the selectors' options the project ships beside their classes' own defaults (docs/request-contract.md "Selectors"):
# a config's options merge over them
SHIPPED_OPTIONS = {"mix": {"stored_deviation": True, "overlap": 0.15}}


@dataclass
class SelectConfig:
    """Which tokens of the reused chunks are recomputed, and how many; a request may name its own selector, ratio and
    quality floor (docs/request-contract.md "Selectors")."""

    selector: str = knob(
        "mix", "default selector: full (SGLang's own prefill, no reused KV: hints `exact`), none, epic, cacheblend, "
        "prophet, spec, clip, mix (or oracle). mix with the deviations its chunks remember runs at prophet's TTFT "
        "(3K / 7K tokens: 1.11 / 3.37 s against 1.16 / 3.47 s) with a lower first-token KL than prophet's (-13.9 % "
        "multikey, -8.6 % MuSiQue; docs/bench/eval_select.md, serving.md)")
    ratio: float = knob(0.15, "recompute budget rho over reused context tokens, in [0, 1]")
    options: dict[str, Any] = knob(
        {}, "per-selector keyword options, keyed by selector name: the fields of its class in chunkcache/select/ "
        "(each with its default and doc line), e.g. mix's adaptive budget {mass: 0.8, overlap: 0}; a config's "
        "options for a selector override the shipped ones (this default) key by key (`overlap: 0` turns mix's "
        "overlap off)")
    full_when_slower: bool = knob(
        True, "CPU: a request that teaches the store nothing (every chunk stored) is computed in full when blending "
        "it is predicted slower, from rates measured once on this host and a fixed time per forward and a scale per "
        "side learned from this server's own forwards (chunkcache/blend/cost.py); reported as the fallback "
        "`predicted_slower`")
    blend_margin: float = knob(
        0.1, "... and unless it is predicted at least this fraction faster, in [0, 1): where the two predictions are "
        "close, the blend saves little and the prediction's error (a long exact lead runs slower in the blend's "
        "passes than in a plain prefill) can make it the slower one, up to 1.6x stock's time measured under churn")
    max_kl: float | None = knob(
        None, "the quality floor of a request that sends none (hints `max_kl`): the smallest rho whose estimated "
        "KL against full recompute (over the answer tokens the estimator covers) (chunkcache/blend/fidelity.py) is at most this many nats; null: "
        "`ratio` as given")
    calibration: str | None = knob(
        None, "the file `chunkcache calibrate` writes a model's fidelity estimator to; the server estimates with the "
        "one fitted on the served weights (same fingerprint) before any shipped one; null: fidelity.json in "
        "chunkcache's home ($CHUNKCACHE_HOME, ~/.cache/chunkcache)")
    max_kl_cap: float = knob(
        0.8, "the largest rho a quality floor may choose, in (0, 1], of the estimator's grid (0.05 to 0.8); a request "
        "whose estimate misses its bound even there has every context token recomputed (reported as the fallback "
        "`quality_floor`)")

    def __post_init__(self):
        given = self.options
        self.options = {name: dict(opts) for name, opts in SHIPPED_OPTIONS.items()}
        for name, opts in given.items():
            self.options[name] = {**self.options.get(name, {}), **opts} if isinstance(opts, dict) else opts

    def check(self) -> None:
        """What needs no selector: the names and their options are the registry's to judge (Config.load's
        `selectors`)."""
        if not 0.0 <= self.ratio <= 1.0:
            raise ConfigError("ratio", f"must be in [0, 1], got {self.ratio}")
        if not 0.0 <= self.blend_margin < 1.0:
            raise ConfigError("blend_margin", f"must be in [0, 1), got {self.blend_margin}")
        if self.max_kl is not None and not self.max_kl > 0:
            raise ConfigError("max_kl", f"must be > 0 (nats) or null, got {self.max_kl}")
        if not 0.0 < self.max_kl_cap <= 1.0:
            raise ConfigError("max_kl_cap", f"must be in (0, 1], got {self.max_kl_cap}")
        for name, opts in self.options.items():
            if not isinstance(opts, dict):
                raise ConfigError(f"options:{name}", f"must be a mapping of keyword options, got {opts!r}")


class Selectors(Protocol):
    """The selector registry (chunkcache.select.REGISTRY) as Config.load sees it. Passed in, not imported: the
    selectors depend on modules that depend on this one (select -> draft -> models -> config)."""

    def check(self, select: SelectConfig) -> None:
        """ConfigError (key relative to the select section) for a selector name or options it refuses."""


@dataclass
class ServeConfig:
    """The SGLang server `chunkcache serve` starts (docs/what-runs.md); its flags --model, --host and --port override
    these."""

    model: str = knob("smollm2-135m-instruct", "model name (see `chunkcache model`) or a local HF directory")
    host: str = knob("127.0.0.1", "address the HTTP server binds")
    port: int = knob(30000, "port the HTTP server binds")
    mem_fraction_static: float | None = knob(
        None, "share of memory SGLang reserves for weights + KV pool, in (0, 1]; null: 0.3 on a host without a GPU "
        "(SGLang's automatic fraction comes out negative on a CPU), SGLang's own on a GPU")
    max_total_tokens: int | None = knob(None, "KV pool size in tokens; null: SGLang sizes it from memory")
    dtype: str = knob(
        "auto", "SGLang --dtype of weights, activations and KV; \"auto\": on CPU the host's faster of bfloat16 and "
        "float32, measured once per host (chunkcache.cpu_dtype), on GPU SGLang's auto")
    sleep_on_idle: bool = knob(True, "idle scheduler blocks on its sockets instead of busy-polling a core")
    cpu_attention: str = knob(
        "chunkcache_torch", "SGLang attention backend on CPU, both sides of an A/B: \"chunkcache_torch\" is "
        "torch_native with its decode step planned once per batch and attended in float32 "
        "(sglang_patch/decode/decode_attention.py); \"torch_native\" is SGLang's own")
    cpu_linear: str = knob(
        "packed", "SGLang's unquantized linear layers on a CPU without AMX, both sides of an A/B: \"packed\" reorders "
        "their bfloat16 weights for oneDNN once at load, the same bits as F.linear without its reorder per call, and "
        "refuses online weight updates (sglang_patch/forward/packed_linear.py); \"sglang\" is SGLang's own F.linear")
    sglang_args: list[str] = knob([], "extra arguments passed verbatim to SGLang")

    def check(self) -> None:
        _non_empty(self, "model", "host")
        if not 1 <= self.port <= 65535:
            raise ConfigError("port", f"must be in [1, 65535], got {self.port}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static <= 1.0:
            raise ConfigError("mem_fraction_static", f"must be in (0, 1], got {self.mem_fraction_static}")
        _at_least(self, "max_total_tokens", 1)
        _one_of(self, "dtype", ("auto", "bfloat16", "float16", "half", "float32", "float"))  # SGLang's --dtype
        _one_of(self, "cpu_attention", ("chunkcache_torch", "torch_native"))
        _one_of(self, "cpu_linear", ("packed", "sglang"))


@dataclass
class LimitsConfig:
    """Bounds on one request, so that one client cannot hold the scheduler (docs/rag-http.md)."""

    max_spans: int = knob(64, "chunks per request (hint spans, chat documents); more is an HTTP 400")
    ingest_in_flight: int = knob(
        4, "documents of one /chunkcache/ingest call in the scheduler at once; the rest queue")
    ingest_max_documents: int = knob(
        1024, "documents per /chunkcache/ingest call; more is an HTTP 400 (send batches)")

    def check(self) -> None:
        _at_least(self, "max_spans", 1)
        _at_least(self, "ingest_in_flight", 1)
        _at_least(self, "ingest_max_documents", 1)


HEADS = ("chat", "none")  # auto.head


@dataclass
class AutoConfig:
    """Automatic chunk detection (docs/auto-chunks.md): a request without a chunk hint is cut into content-defined
    segments (chunkcache/segment.py), and the ones the store holds become its chunks."""

    enabled: bool = knob(
        False, "automatic chunk detection (or `chunkcache serve --auto-chunks`); off by default because it makes "
        "unmarked requests approximate, which the server's operator must choose")
    min_reuse_tokens: int = knob(
        128, "a prompt with fewer stored segment tokens (past the exact prefix) is served as stock")
    segment_mean_tokens: int = knob(
        32, "mean distance between content-defined cuts inside a paragraph (a power of two)")
    segment_min_tokens: int = knob(
        16, "shortest segment cut inside a paragraph (at least 8, the cut's hash window); shorter pieces are never "
        "stored")
    segment_max_tokens: int = knob(256, "a paragraph this long without a content-defined cut is cut here")
    head: str = knob(
        "chat", "what every paragraph a prompt teaches is encoded after, alone (its entry's KV attended to this and "
        "its own paragraph, nothing its key does not name): `chat`, the tokens the model's chat template puts before "
        "a user message's text (its default system message included; the tokenizer's BOS without a template); "
        "`none`, nothing (each paragraph from position 0)")
    edge_tokens: int = knob(
        8, "a paragraph is also looked up as if its first 1..this many tokens were a wrapper the taught paragraph "
        "lacked, and its last segment without up to this many of its last tokens: a passage taught bare (ingest, the "
        "documents API, a request of its own) is found on a line that wraps it (`<document>...</document>`); 0: "
        "paragraphs as they are")
    learn: bool = knob(True, "learn the paragraphs of the prompts this server serves (requests may opt out with "
                       "`learn: false`; `exact: true` ones never teach)")
    encode_queue: int = knob(
        64, "paragraphs waiting to be encoded (one forward of the head and the paragraph each, when the server is "
        "idle, after the deferred deviations); past this many the oldest is dropped (taught again by its next "
        "sighting)")
    encode_starved_s: float = knob(
        5.0, "a server that is never idle still learns: when the oldest waiting paragraph has waited this long, one "
        "is encoded after a batch's outputs are sent (the next batch waits that one forward); 0: only when idle")
    require_tenant: bool = knob(
        False, "serve requests that name no tenant (no `namespace` in their chunkcache payload and no `cache_salt`) "
        "as stock: no detection, no learning, so a gateway that tags tenants is the only way into the store")
    admit_after: int = knob(
        2, "once the host tier is full, a segment is learned only when seen in this many prefills (1: always; 2: "
        "seen twice, which keeps one-off segments from evicting popular ones); while it has room every new segment "
        "is learned")
    seen_keys: int = knob(
        1 << 18, "segments whose sightings are counted for admit_after (least recent forgotten first)")

    def check(self) -> None:
        _at_least(self, "min_reuse_tokens", 1)
        if self.head not in HEADS:
            raise ConfigError("head", f"must be one of {', '.join(HEADS)}, got {self.head!r}")
        _at_least(self, "encode_queue", 1)
        _at_least(self, "edge_tokens", 0)
        _at_least(self, "encode_starved_s", 0)
        _at_least(self, "segment_min_tokens", 8)  # the content-defined cut's hash window is 8 tokens
        m = self.segment_mean_tokens
        if m < 1 or m & (m - 1):
            raise ConfigError("segment_mean_tokens", f"must be a power of two, got {m}")
        if self.segment_max_tokens < self.segment_min_tokens:
            raise ConfigError("segment_max_tokens", f"must be >= segment_min_tokens ({self.segment_min_tokens}), "
                              f"got {self.segment_max_tokens}")
        _at_least(self, "admit_after", 1)
        _at_least(self, "seen_keys", 1)


@dataclass
class SpeCacheConfig:
    """SpeCache decoding (sglang_patch/decode/specache.py, docs/specache.md): low-bit KV in the device pool, full KV
    as the host copy, top-k full-precision pairs prefetched by a speculative second token."""

    enabled: bool = knob(
        False, "SpeCache decoding on; the server refuses, at start-up, what it cannot run it on (model, device, page "
        "size, mixed chunks, ...)")
    bits: int = knob(1, "bits per quantised K/V element: 1 (SpeCache's midpoint levels), 2 or 4 (KIVI)")
    group: int = knob(
        32, "K: per channel over groups of this many tokens; V: per token over groups of this many channels")
    residual: int = knob(
        64, "the most recent tokens kept in full precision (at least this many, fewer than residual+group)")
    topk: int = knob(64, "full-precision KV pairs prefetched per layer per KV head, picked by the speculative token")

    def check(self) -> None:
        if self.bits not in (1, 2, 4):
            raise ConfigError("bits", f"must be 1, 2 or 4, got {self.bits}")
        _at_least(self, "group", 1)
        _at_least(self, "residual", 0)
        _at_least(self, "topk", 0)


@dataclass
class IdleConfig:
    """The server's idle work (chunkcache/blend/idle.py): deviations blends estimated, paragraphs prompts taught and
    audits, run one job at a time while no request waits."""

    after_s: float = knob(
        0.5, "seconds the scheduler must have been idle since its last forward before an idle job starts (a client "
        "that sends its requests back to back is not held up by one)")
    slice_tokens: int = knob(
        512, "tokens one forward of an idle job computes at most: a job over a longer prompt runs a slice per idle "
        "turn, each attending to the earlier slices' K/V, so a request that arrives waits for one slice at most")
    deviations: int = knob(
        32, "deferred deviation measurements kept at most (each holds its request's chunk entries until measured); "
        "past it the oldest is dropped (its chunks are estimated again, and queued again, next use)")

    def check(self) -> None:
        _at_least(self, "after_s", 0)
        _at_least(self, "slice_tokens", 1)
        _at_least(self, "deviations", 0)


@dataclass
class AuditConfig:
    """The online audit (docs/request-contract.md "Quality floor"): a sample of blended requests recomputed in full
    while the server is idle, each one's measured KL over its served answer (the estimator's `covers` tokens) judged
    against the bound it was served under; when
    more than `promise` of the last `window` exceeded theirs, every later fidelity estimate is widened by a margin."""

    rate: float = knob(
        0.0, "share of the blended requests with a fidelity estimate that are audited, in [0, 1]; 0: off. Refused "
        "under tensor parallelism (the full recompute would be a forward of every rank)")
    keep: int = knob(
        4, "sampled requests waiting for an idle turn at most, each holding its prompt and its served last-token "
        "logits (a float32 vocabulary); one sampled while this many wait is not audited")
    window: int = knob(20, "the last this many audited requests judge the promise")
    promise: float = knob(
        0.1, "the share of a window whose measured KL (over the served answer) may exceed its bound (the request's max_kl, else "
        "its own estimate), in (0, 1); a window past it widens the margin, logged at WARNING")
    margin: float = knob(
        1.0, "the safety factor the server starts with: every fidelity estimate is multiplied by it, before a "
        "quality floor compares it with max_kl and in the report; the audit widens it (at least doubling it, or as "
        "far as the breaking window needed), so a restarted server may start from the last chunkcache_audit_margin")
    max_margin: float = knob(64.0, "the widest margin the audit sets")
    cases: str | None = knob(
        None, "JSONL file every audited case is appended to (its rid, prompt tokens, selector, rho, bound, estimated "
        "and measured KL, greedy agreement, margin); null: none")
    keep_prompts: bool = knob(
        False, "with `cases`, each audited case's prompt token ids and chunk spans are written too, so `chunkcache "
        "calibrate --served FILE` can fit the estimator on this traffic (docs/calibration.md), each tagged with its "
        "tenant (`tenant`: `namespace`, the request's or else store.namespace, and `salted`, whether it carried a "
        "cache_salt; never the salt); off: prompts are the users' data")

    def check(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ConfigError("rate", f"must be in [0, 1], got {self.rate}")
        _at_least(self, "keep", 1)
        _at_least(self, "window", 1)
        if not 0.0 < self.promise < 1.0:
            raise ConfigError("promise", f"must be in (0, 1), got {self.promise}")
        if not self.margin > 0:
            raise ConfigError("margin", f"must be > 0, got {self.margin}")
        if not self.max_margin >= self.margin:
            raise ConfigError("max_margin", f"must be at least margin ({self.margin}), got {self.max_margin}")
        _non_empty(self, "cases")
        if self.keep_prompts and not self.cases:
            raise ConfigError("keep_prompts", "writes the prompts into the cases file: set audit.cases too")


REPORT_LEVELS = ("full", "private")  # report.to_clients


@dataclass
class ReportConfig:
    """What clients are told of chunk reuse (docs/report-schema.md "Private reports"); /metrics and the log always
    have everything."""

    to_clients: str = knob(
        "full", "the chunk report of responses (`meta_info`, `usage`, `metadata`) and /server_info's chunkcache "
        "state: \"full\", every key; \"private\", only what the request itself decided (`private: true`, an exact round's "
        "keys, an `input_logprobs`, `bad_hint` or `no_tenant` fallback), no report for a request automatic detection looked at, "
        "and /server_info's state without the store's, the pool's and the timing fits' counters, so that no client "
        "learns from them whether another sent a passage")

    def check(self) -> None:
        _one_of(self, "to_clients", REPORT_LEVELS)


UNKNOWN_KEYS = ("error", "warn")  # config.unknown_keys


@dataclass
class LoadConfig:
    """How the config itself is read: what a key of the file, or a CHUNKCACHE_<SECTION>__<KEY> variable, that names
    no knob of this version does (docs/deployment.md "Rollback")."""

    unknown_keys: str = knob(
        "error", "error: the server refuses to start, naming each (a misspelt knob must not leave it on the default "
        "unnoticed); warn: each is logged at WARNING and skipped, the known keys served, so that an older chunkcache "
        "serves a config written for a newer one (a rollback). A value this version refuses (a selector or option it "
        "lacks) still stops it")

    def check(self) -> None:
        _one_of(self, "unknown_keys", UNKNOWN_KEYS)


@dataclass
class DecodeConfig:
    """The server's decode step."""

    specache: SpeCacheConfig = field(default_factory=SpeCacheConfig)


@dataclass
class Config:
    """A server's whole configuration: one section per field."""

    serve: ServeConfig = field(default_factory=ServeConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    auto: AutoConfig = field(default_factory=AutoConfig)
    idle: IdleConfig = field(default_factory=IdleConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    config: LoadConfig = field(default_factory=LoadConfig)

    @classmethod
    def load(cls, path: str | Path | None = None, selectors: Selectors | None = None) -> "Config":
        """The config `path` names (see `config_file`; None is the packaged `default`), then this process's
        CHUNKCACHE_<SECTION>__<KEY> variables, each over its knob's value in the file: every process of a server
        (`chunkcache serve`, SGLang's scheduler, which inherits the variables) loads the same settings. `selectors`
        judges the select section's selector names and options; without it they are first tried when a selector is
        built (a server loads with chunkcache.select.REGISTRY, so that a bad name stops it before it serves). Keys and
        variables that name no knob are errors too, or, under `config.unknown_keys: warn`, one WARNING naming them."""
        path = config_file(path)
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
        errors: list[ConfigError] = []
        unknown: list[ConfigError] = []  # keys and variables naming no knob
        overrides = _environment(os.environ, errors, unknown)
        for knob_path, value in overrides.items():
            _overlay(raw, knob_path, value)
        where = _Where(str(path), (), set(overrides))
        config = _build(cls, raw, where, errors, unknown)
        if selectors is not None:
            try:
                selectors.check(config.select)
            except ConfigError as exc:
                errors.append(ConfigError(where.inside("select").key(exc.key), exc.reason))
        if unknown and config.config.unknown_keys == "warn":
            log.warning("chunkcache: config %s: skipped what names no knob of this version (config.unknown_keys: "
                        "warn): %s", path, "; ".join(map(str, unknown)))
        elif unknown:
            errors[:0] = unknown
        if errors:  # every bad value at once, not one per start-up attempt
            raise ValueError("; ".join(map(str, errors))) if len(errors) > 1 else errors[0]
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """A short digest of the settings, for comparing the tensor-parallel ranks' (chunkcache.ranks.Ranks.
        check_alike): every knob's value but store.disk_dir's, of which only whether it is set counts, since each rank
        writes its own directory (the scheduler appends `tpXofY` to it when it starts; on other nodes it may be
        another disk's path)."""
        settings = self.to_dict()
        settings["store"]["disk_dir"] = self.store.disk_dir is not None
        return digest(settings)

    def effective(self) -> dict[str, Any]:
        """Every knob's value as this process runs on it (/server_info shows it), with the secrets a knob may hold
        masked (`masked`). The shared tier's secret is no knob: only the variable holding it
        (store.remote_secret_env) is shown."""
        return masked(self.to_dict())


# A URL's password (scheme://[user]:PASSWORD@host..., or a `password=` query parameter), and SGLang flags whose value
# is a secret (--api-key, --admin-api-key, --ssl-keyfile-password, --watermark-key: by the ending of the name)
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/?#@\s:]*:)[^/?#\s]*(@)", re.IGNORECASE)  # to the last @
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&\s]*", re.IGNORECASE)
_SECRET_FLAG = re.compile(r"--[\w-]*(?:key|password|secret|token)")


def masked(value: Any) -> Any:
    """`value` (JSON-like) with every secret replaced by MASK: URL passwords in any string, and in a list (such as
    serve.sglang_args) the argument after a secret flag or a secret flag's `=value`."""
    if isinstance(value, dict):
        return {key: masked(item) for key, item in value.items()}
    if isinstance(value, list):
        shown = []
        for i, item in enumerate(value):
            flag = _SECRET_FLAG.match(item) if isinstance(item, str) else None
            if i and isinstance(value[i - 1], str) and _SECRET_FLAG.fullmatch(value[i - 1]):
                shown.append(MASK)
            elif flag and item[flag.end():].startswith("="):
                shown.append(f"{flag[0]}={MASK}")
            else:
                shown.append(masked(item))
        return shown
    if isinstance(value, str):
        return _QUERY_PASSWORD.sub(rf"\g<1>{MASK}", _URL_PASSWORD.sub(rf"\g<1>{MASK}\g<2>", value))
    return value


def digest(content: Any) -> str:
    """A short, stable digest of `content` (JSON-able, dataclasses as dicts; anything else by its str): the same on
    every process and host that holds the same content, whatever its dicts' order."""
    canonical = json.dumps(content, sort_keys=True, default=str)
    return hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()


def config_file(name: str | Path | None) -> Path:
    """The YAML file behind a --chunkcache-config (or a bench's --config) value: a bare name (no directory, no
    suffix) is a packaged config, chunkcache/configs/NAME.yaml; anything else is a path. None is `default`. A missing file is an error, never the
    built-in defaults: a server must not start on other settings than the ones it was given."""
    path = Path("default" if name is None else name)
    if path.parent == Path(".") and not path.suffix:
        path = PACKAGED / f"{path}.yaml"
    if not path.is_file():
        packaged = ", ".join(sorted(p.stem for p in PACKAGED.glob("*.yaml"))) or "none (an incomplete install)"
        raise FileNotFoundError(f"config {str(name or 'default')!r}: no file {path}; packaged configs: {packaged}")
    return path


def sections(cls: type = Config, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], type, list[Field]]]:
    """Every section under `cls` that holds knobs, with its key path, its dataclass and its knobs, in field order
    (depth first: ("decode", "specache") is a section, `decode` holds none)."""
    fields = dataclasses.fields(cls)
    knobs = [f for f in fields if _section(f) is None]
    if knobs:
        yield path, cls, knobs
    for f in fields:
        if (sub := _section(f)) is not None:
            yield from sections(sub, (*path, f.name))


def env_name(knob_path: tuple[str, ...]) -> str:
    """The variable that sets the knob at `knob_path`: ("select", "ratio") -> CHUNKCACHE_SELECT__RATIO."""
    return ENV_PREFIX + "__".join(knob_path).upper()


def parse_bytes(value: Any, key: str) -> int:
    """A byte size from an int or a string: "4096", "2GiB", "512 MiB", "1.5GB" (BYTE_UNITS, any case). A fraction
    of a unit is rounded down to whole bytes; a number without a unit must be whole."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value) if isinstance(value, str) else None
    units = {unit.lower(): size for unit, size in BYTE_UNITS.items()}
    if match is None or match[2].lower() not in {"", *units} or (match[2].lower() in ("", "b") and "." in match[1]):
        raise ConfigError(key, f"must be a byte size: an int, or a number and a unit of {', '.join(BYTE_UNITS)} "
                               f"(2GiB, 512 MiB, 1.5GB), got {value!r}")
    return int(Decimal(match[1]) * units.get(match[2].lower(), 1))


class ConfigError(ValueError):
    """A config value of the wrong type or out of range; the message names the key (`file:section:key`), or the
    variable that set it (`$CHUNKCACHE_SECTION__KEY (section:key)`)."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


@dataclass(frozen=True)
class _Where:
    """Where a section's values come from: the file, the section's key path, and the knobs variables set."""

    file: str
    section: tuple[str, ...]
    from_env: set[tuple[str, ...]]

    def key(self, key: str) -> str:
        """How an error names `key` (relative to the section, "options:mix" names a value inside a knob): the
        variable that set the knob, else the file's key."""
        knob_path = (*self.section, *key.split(":"))
        dotted = ":".join(knob_path)
        setter = next((knob_path[:n] for n in range(len(knob_path), 0, -1) if knob_path[:n] in self.from_env), None)
        return f"${env_name(setter)} ({dotted})" if setter else f"{self.file}:{dotted}"

    def inside(self, name: str) -> _Where:
        return _Where(self.file, (*self.section, name), self.from_env)


def _section(f: Field) -> type | None:
    """The dataclass of a field that is a section (its value holds knobs of its own), else None: a knob."""
    return f.default_factory if dataclasses.is_dataclass(f.default_factory) else None


def _environment(environ: Mapping[str, str], errors: list[ConfigError],
                 unknown: list[ConfigError]) -> dict[tuple[str, ...], Any]:
    """The knobs CHUNKCACHE_<SECTION>__<KEY> variables set, by key path, each value read as YAML ("0.2", "true",
    "null", "4GiB", "[a, b]"; an empty value is null); a value that is no YAML is appended to `errors`. A variable of
    that form naming no knob is appended to `unknown` (an error unless config.unknown_keys is warn): a misspelt one
    must not leave the server on the file's value unnoticed."""
    knobs = {env_name((*path, f.name)): (*path, f.name) for path, _, fields in sections() for f in fields}
    overrides = {}
    for var, text in environ.items():
        if not var.startswith(ENV_PREFIX) or "__" not in var:
            continue
        if var not in knobs:  # the nearest knob by the part after the prefix, which every variable shares
            close = difflib.get_close_matches(var.removeprefix(ENV_PREFIX),
                                              [known.removeprefix(ENV_PREFIX) for known in knobs], n=1)
            unknown.append(ConfigError(f"${var}", "names no config knob " + (
                f"(did you mean ${ENV_PREFIX}{close[0]}?)" if close else "(docs/configuration.md)")))
            continue
        try:
            overrides[knobs[var]] = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            reason = getattr(exc, "problem", None) or exc
            errors.append(ConfigError(f"${var}", f"not a YAML value ({reason}): {text!r}"))
    return overrides


def _overlay(raw: dict[str, Any], knob_path: tuple[str, ...], value: Any) -> None:
    """`value` as the file's value of the knob at `knob_path`; a section the file gives as no mapping is left for
    `_build` to refuse."""
    *path, name = knob_path
    for section in path:
        if raw.get(section) is None:
            raw[section] = {}
        raw = raw[section]
        if not isinstance(raw, dict):
            return
    raw[name] = value


def _build(cls: type, raw: dict[str, Any], where: _Where, errors: list[ConfigError],
           unknown: list[ConfigError]) -> Any:
    """`cls` from `raw`; a value of the wrong type is appended to `errors` (and its default kept, so that the rest
    is still checked), as is the first value `check()` refuses; keys naming no field are appended to `unknown` and
    left out."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    here = ":".join((where.file, *where.section))
    if strangers := sorted(set(raw) - set(fields)):
        unknown.append(ConfigError(here, f"unknown key(s) {strangers}; expected some of {sorted(fields)}"))
    kwargs = {}
    for name, value in raw.items():
        if name not in fields:
            continue
        if (sub := _section(fields[name])) is not None:
            if not isinstance(value, dict):
                raise ValueError(f"{here}: '{name}' must be a mapping")
            kwargs[name] = _build(sub, value, where.inside(name), errors, unknown)
            continue
        try:
            kwargs[name] = _typed(value, fields[name].type, where.key(name))
        except ConfigError as exc:
            errors.append(exc)
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        try:
            check()
        except ConfigError as exc:
            errors.append(ConfigError(where.key(exc.key), exc.reason))
    return obj


# field annotations (strings, with `from __future__ import annotations`) -> the Python types a YAML value may have;
# an annotation not listed here is not type-checked
_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
                                       "None": (type(None),), "Any": (object,)}


def _typed(value: Any, annotation: Any, key: str) -> Any:
    """`value` checked against a field annotation such as "int | None", "list[str]" or "dict[str, Any]"; an int
    given for a float field becomes a float, a byte size ("Bytes") an int."""
    if annotation == "Bytes":
        return parse_bytes(value, key)
    if not isinstance(annotation, str):
        return value
    allowed: list[type] = []
    for part in (p.strip() for p in annotation.split("|")):
        base = part.split("[", 1)[0]
        if base in ("list", "dict"):
            allowed.append(list if base == "list" else dict)
        elif base in _TYPES:
            allowed.extend(_TYPES[base])
        else:
            return value
    # YAML's true/false are bools, and bool is an int subclass: only a bool field takes them
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, tuple(allowed)):
        raise ConfigError(key, f"must be {annotation.replace(' | None', ' or null')}, got {value!r} "
                               f"({type(value).__name__})")
    if annotation.startswith("list[str]") and isinstance(value, list) and not all(isinstance(v, str) for v in value):
        raise ConfigError(key, f"must be a list of strings, got {value!r}")
    return float(value) if annotation == "float" else value


def _at_least(obj: Any, name: str, low: int) -> None:
    value = getattr(obj, name)
    if value is not None and value < low:
        raise ConfigError(name, f"must be at least {low}, got {value}")


def _non_empty(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value.strip():
            raise ConfigError(name, "must be a non-empty string")


def _one_of(obj: Any, name: str, allowed) -> None:
    if getattr(obj, name) not in allowed:
        raise ConfigError(name, f"{getattr(obj, name)!r} is not one of {', '.join(allowed)}")
