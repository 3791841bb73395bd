"""`chunkcache eval --smoke` on the reference path: the selector x rho table as JSON, with the SpecCache analyses."""

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_eval_smoke_json(tmp_path, default_model):
    run = subprocess.run([sys.executable, "-m", "sglang_patch.cli", "eval", "--smoke", "--selectors", "none,epic",
                          "--ratios", "0.1,0.2", "--analyses", "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    table = {(t["selector"], t["ratio"]): t for t in result["table"]}
    assert set(table) == {("full", None), ("none", None), ("epic", 0.1), ("epic", 0.2)}
    assert table["full", None]["agreement"] == 1.0  # full recompute is its own reference
    for t in table.values():
        assert t["n"] == 3 and all(0.0 <= t[k] <= 1.0 for k in ("f1", "em", "contains", "agreement", "same"))
    dev = result["analyses"]["kv_deviation"]
    assert len(dev["k"]) == len(dev["v"]) == 30
    assert dev["k"][0] == pytest.approx(0.0, abs=1e-4)  # layer 1 sees only the token itself: reuse is exact there
    assert all(math.isfinite(x) and x >= 0 for x in dev["k"] + dev["v"]) and max(dev["v"]) > 0
    overlaps = result["analyses"]["jaccard_top20"]
    assert "draft self (10 layers) vs target deep" in overlaps
    assert all(0.0 <= v <= 1.0 for v in overlaps.values())
