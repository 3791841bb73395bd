"""`serve.dtype: auto` on CPU: the host's faster dtype, measured once per host and kept."""

import json

from chunkcache import cpu_dtype


def test_bfloat16_only_when_clearly_faster():
    assert cpu_dtype.decide({"bfloat16": 350.0, "float32": 135.0}) == "bfloat16"  # AVX512-BF16 host
    assert cpu_dtype.decide({"bfloat16": 9.6, "float32": 80.4}) == "float32"  # AVX2-only host
    margin = cpu_dtype.BF16_MARGIN
    assert cpu_dtype.decide({"bfloat16": 100.0 * margin, "float32": 100.0}) == "bfloat16"
    assert cpu_dtype.decide({"bfloat16": 100.0 * margin - 1, "float32": 100.0}) == "float32"


def test_measured_once_per_host_then_kept(tmp_path, monkeypatch):
    runs = []
    monkeypatch.setattr(cpu_dtype, "measure", lambda: runs.append(1) or {"bfloat16": 300.0, "float32": 100.0})
    path = tmp_path / "host-dtype.json"
    first = cpu_dtype.fastest_cpu_dtype(path)
    assert first.dtype == "bfloat16" and first.host == cpu_dtype.host_signature()
    monkeypatch.setattr(cpu_dtype, "measure", lambda: runs.append(1) or {"bfloat16": 10.0, "float32": 100.0})
    assert cpu_dtype.fastest_cpu_dtype(path) == first and len(runs) == 1  # a noisy re-measure cannot flip it
    kept = json.loads(path.read_text())
    kept["other host"] = {"dtype": "float32", "gflops": {}}
    path.write_text(json.dumps(kept))
    assert cpu_dtype.fastest_cpu_dtype(path).dtype == "bfloat16"  # other hosts' entries are theirs
    monkeypatch.setattr(cpu_dtype, "host_signature", lambda: "a new host")
    assert cpu_dtype.fastest_cpu_dtype(path).dtype == "float32" and len(runs) == 2
    assert set(json.loads(path.read_text())) == {first.host, "other host", "a new host"}


def test_an_unreadable_or_unwritable_cache_still_decides(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_dtype, "measure", lambda: {"bfloat16": 10.0, "float32": 100.0})
    bad = tmp_path / "host-dtype.json"
    bad.write_text("{not json")
    assert cpu_dtype.fastest_cpu_dtype(bad).dtype == "float32"
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert cpu_dtype.fastest_cpu_dtype(blocked / "host-dtype.json").dtype == "float32"  # parent is a file


def test_measure_times_both_candidates():
    rates = cpu_dtype.measure(seconds=0.02)
    assert set(rates) == {"bfloat16", "float32"} and all(r > 0 for r in rates.values())
