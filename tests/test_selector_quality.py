"""The selector quality script end to end on the default model (one small case)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_selector_quality_script(tmp_path, default_model):
    out = tmp_path / "quality.json"
    run = subprocess.run(
        [sys.executable, "-m", "chunkbench.quality.selector_quality", "--n", "1", "--max-new-tokens", "3",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"full", "none", "epic", "cacheblend", "prophet", "spec", "clip"}
    assert "select/blend" in run.stdout and "spec" in run.stdout
