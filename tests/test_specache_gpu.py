"""chunkbench.kernels.specache_gpu runs on GPU machines that CI never sees, so its self-check runs here on the CPU at a
tiny shape, in float32: every step's attention output equals float32 attention over the same mixed cache (low-bit codes,
the prefetched pairs in full precision), and with top-k covering the context it equals full precision. A step that
reads full precision where SpeCache holds codes, or attends to other pairs than the ones it chose, must fail the
check, or the check proves nothing. The Triton kernel's indexing is checked in Triton's interpreter when Triton is
installed."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chunkbench.kernels import specache_gpu

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--shape", "tiny", "--contexts", "256,512", "--batches", "1,2", "--bits", "1,2", "--topk",
        "8", "--group", "16", "--residual", "16", "--repeats", "1", "--warmup", "1", "--budget-gib", "0.01",
        "--kernel", "torch"]


def test_self_check_on_cpu(tmp_path):
    out = tmp_path / "specache.json"
    assert specache_gpu.main(TINY + ["--json", str(out)]) == 0
    result = json.loads(out.read_text())
    shape = specache_gpu.SHAPES["tiny"]
    steps = result["steps"]
    assert {(r["L"], r["B"], r["bits"]) for r in steps} == {(n, b, bits) for n in (256, 512) for b in (1, 2)
                                                          for bits in (1, 2)}
    for r in steps:
        assert r["ok"] and r["mixed_err"] < 1e-4, r
        assert r["full_err"] > 1e-2, r  # the codes are read: full precision everywhere would match to 1e-6
        assert r["sdpa_ms"] > 0 and r["matmul_ms"] > 0 and r["spec_ms"] > 0 and r["nopf_ms"] > 0
        # every step moves k pairs (K and V, float32 here) of every layer, sequence and KV head
        assert r["h2d_bytes"] == shape["layers"] * r["B"] * shape["kv_heads"] * 8 * 2 * shape["head_dim"] * 4
        assert r["spec_batch"] > r["full_batch"]
    assert [r["bits"] for r in result["exact"]] == [1, 2]
    assert all(r["ok"] and r["full_err"] < 1e-4 for r in result["exact"]), result["exact"]


def test_full_precision_in_place_of_the_codes_fails(monkeypatch):
    def full_precision(self, layer):
        return self.K[:, :, : self.nq].float(), self.V[:, :, : self.nq].float()
    monkeypatch.setattr(specache_gpu.SpeCache, "dequantised", full_precision)
    assert specache_gpu.main(TINY) == 1


def test_prefetching_other_pairs_than_the_chosen_fails(monkeypatch):
    fetch = specache_gpu.Prefetcher._fetch

    def neighbours(self, layer):  # each chosen token's neighbour arrives instead
        self.idx[layer] ^= 1
        fetch(self, layer)
    monkeypatch.setattr(specache_gpu.Prefetcher, "_fetch", neighbours)
    assert specache_gpu.main(TINY) == 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_triton_kernel_in_the_interpreter(tmp_path):
    out = tmp_path / "specache.json"
    args = TINY[: TINY.index("--kernel")] + ["--contexts", "256", "--batches", "1", "--warmup", "0", "--kernel",
                                             "triton", "--json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "chunkbench.kernels.specache_gpu", *args], cwd=ROOT,
                          capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kernel"] == "triton" and len(result["steps"]) == 2
    assert all(r["mixed_err"] < 1e-4 for r in result["steps"] + result["exact"])
