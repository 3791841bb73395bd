"""The model dtype a CPU host serves fastest (`serve.dtype: auto` on a host without a GPU).

bfloat16 halves the bytes a matmul reads but is only fast where the CPU has bf16 arithmetic: the same torch build ran
a 512x576 @ 576x1536 matmul (the default model's MLP shape) at 350 GFLOP/s in bf16 against 135 in float32 on a
2-core AMD EPYC with avx512_bf16, slower in bf16 on an Intel Xeon without AMX, and at 1-10 GFLOP/s in bf16 against
72-80 in float32 on a 2-core AMD EPYC exposing only AVX2. CPU flags alone do not say which (a VM may hide them, and
oneDNN's paths change with the torch build), so the host is measured once: the model's matmul shape in both dtypes,
bfloat16 chosen only when it is at least BF16_MARGIN times faster (it rounds more). The choice is kept per host
(CPU model, flags, torch version, threads) in `home()/host-dtype.json`, so every server and both sides of an A/B on
that host run the same dtype, whatever the noise of a later measurement.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

from .config import home

log = logging.getLogger(__name__)

BF16_MARGIN = 1.25  # bfloat16 must beat float32 by this factor to be chosen: float32 rounds less
SHAPE = (512, 576, 1536)  # (tokens, hidden, intermediate) of a prefill chunk through the default model's MLP
CANDIDATES = ("bfloat16", "float32")


@dataclass(frozen=True)
class Choice:
    dtype: str  # "bfloat16" or "float32"
    gflops: dict[str, float]  # measured matmul throughput per candidate
    host: str  # the host signature the choice is kept under

    def reason(self) -> str:
        rates = ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in self.gflops.items())
        return f"{self.dtype} ({rates}; bfloat16 needs {BF16_MARGIN}x float32's)"


def host_signature() -> str:
    """CPU model, its flags, torch's version and thread count: what decides which dtype is fastest."""
    import torch

    flags = model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:  # not Linux: the platform's processor string stands in
        model = platform.processor()
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{model or platform.machine()}|flags:{digest}|torch {torch.__version__}|threads {torch.get_num_threads()}"


def measure(seconds: float = 0.3) -> dict[str, float]:
    """GFLOP/s of SHAPE's matmul per candidate dtype, the best of repeated runs within about `seconds` each."""
    import torch

    m, k, n = SHAPE
    rates = {}
    for name in CANDIDATES:
        dtype = getattr(torch, name)
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        a @ b  # first call: oneDNN's primitive creation
        best, spent = float("inf"), 0.0
        while spent < seconds:
            t = time.perf_counter()
            a @ b
            dt = time.perf_counter() - t
            best, spent = min(best, dt), spent + dt
        rates[name] = 2 * m * k * n / best / 1e9
    return rates


def decide(gflops: dict[str, float]) -> str:
    return "bfloat16" if gflops["bfloat16"] >= BF16_MARGIN * gflops["float32"] else "float32"


def fastest_cpu_dtype(cache: Path | None = None) -> Choice:
    """This host's choice: the kept one, or measured now and kept (a cache that cannot be written is only logged)."""
    host = host_signature()

    def choose() -> dict:
        gflops = measure()
        return {"dtype": decide(gflops), "gflops": gflops}

    entry = kept_per_host(cache or home() / "host-dtype.json", host, choose)
    choice = Choice(entry["dtype"], entry["gflops"], host)
    log.info("chunkcache: CPU dtype for this host: %s", choice.reason())
    return choice


def best_seconds(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed call (oneDNN builds its kernels on the first)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def kept_per_host(path: Path, host: str, choose) -> dict:
    """The JSON object kept for `host` in `path`, or `choose()`'s, kept there now: a measured choice is made once
    per host, so every process and both sides of an A/B on it run the same, whatever the noise of a later
    measurement (a file that cannot be written is only logged: the choice is then measured again next start)."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    if isinstance(kept.get(host), dict):
        return kept[host]
    kept[host] = entry = choose()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept, indent=1))
        tmp.replace(path)
    except OSError as exc:
        log.warning("chunkcache: could not keep a measured choice in %s (%s); it is measured again next start", path,
                    exc)
    return entry
