"""`chunkcache bench --smoke` end to end on the CPU servers: both servers started and stopped by the harness,
the JSONL, the summary table and the plots written, every number finite, chunks reused on the chunkcache side."""

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

NUMBERS = ("ttft_s", "latency_s", "finish_s", "f1", "em", "agreement", "prompt_tokens", "output_tokens")


def test_bench_smoke(tmp_path, default_model):
    out = tmp_path / "bench"
    run = subprocess.run([sys.executable, "-m", "sglang_patch.serve.cli", "bench", "--smoke", "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    sides = {r["side"] for r in records}
    phases = {r["phase"] for r in records}
    assert sides == {"stock", "chunkcache"} and phases == {"sequential", "poisson@0.5"}
    for r in records:
        for key in NUMBERS:
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r)
        assert r["ttft_s"] > 0 and r["latency_s"] >= r["ttft_s"] and r["output_tokens"] > 0 and r["answer"]
    chunkcache = [r for r in records if r["side"] == "chunkcache"]
    assert all(r["blended"] and r["chunk_hits"] > 0 and r["reused_tokens"] > 0 for r in chunkcache)
    assert all(r["chunk_hits"] == 0 and not r["blended"] for r in records if r["side"] == "stock")

    summary = (out / "summary.md").read_text()
    assert "| stock |" in summary and "| mix@0.15 |" in summary and "goodput" in summary  # the server's selector
    assert "nan" not in summary.lower()
    for name in ("ttft_cdf.png", "frontier.png", "goodput.png"):
        png = (out / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
