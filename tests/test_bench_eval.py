"""`chunkcache eval --smoke` on the reference path: the selector x rho table as JSON, with the SpecCache analyses."""

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_eval_smoke_json(tmp_path, default_model):
    run = subprocess.run([sys.executable, "-m", "sglang_patch.serve.cli", "eval", "--smoke", "--selectors", "none,epic",
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


@pytest.fixture(scope="module")
def fp32_server(tmp_path_factory, default_model):
    """A server in the reference blender's float32: in the server's default bfloat16, its own teacher-forced prefill
    of full recompute's answer disagreed with its greedy decoding at 1 of 16 positions."""
    from conftest import start_server

    d = tmp_path_factory.mktemp("fp32")
    (d / "chunkcache.yaml").write_text("serve:\n  dtype: float32\n")
    srv = start_server(d / "server.log", "--chunkcache-config", str(d / "chunkcache.yaml"))
    yield srv
    srv.stop()


def test_reference_and_server_paths_agree(fp32_server, default_model):
    """One case through both paths: the same layout (prompt and chunk spans) and the same selection (full
    recompute; epic, which depends on the layout only) give the same answer, teacher-forced agreement and KL."""
    server = fp32_server
    from chunkbench.quality import fidelity_measures
    from chunkbench.quality.reference_path import ReferenceMeasure
    from chunkbench.quality.server_path import ServerMeasure
    from chunkbench.workloads import WorkloadConfig, items
    from chunkcache.reference import ReferenceBlender

    item = items(WorkloadConfig("synthetic:multikey", requests=1, docs=3, words=80))[0]
    blender = ReferenceBlender.from_pretrained(default_model)
    on_ref, on_server = ReferenceMeasure(blender, 16), ServerMeasure(server.url, blender.tokenizer, 16, 20)
    ref, ref_fields = on_ref.full(item)
    srv, srv_fields = on_server.full(item)
    assert srv.continuation == ref.continuation and srv_fields["text"] == ref_fields["text"]
    assert srv_fields["tf_agreement"] == ref_fields["tf_agreement"] == 1.0 and srv_fields["kl_first"] == 0.0
    logprobs = ref.result.logits.double().log_softmax(-1)
    for token, lp in list(srv.first.items())[:5]:  # the head of full's first-token distribution
        assert lp == pytest.approx(float(logprobs[token]), abs=1e-3)
    for name in ("full", "epic"):
        r = on_ref.blended(ref, name, 0.15, {})
        s = on_server.blended(srv, name, 0.15, {})
        assert (s["text"], s["tf_agreement"]) == (r["text"], r["tf_agreement"]), name
        # the server runs `full` as stock's own prefill (radix prefix reused, nothing blended); epic blends
        assert s["exact"] == (name == "full"), name
        if name == "epic":
            assert s["recomputed"] == r["recomputed"]
        # the server's KL is bucketed over full's top-k: compare it with the same bucketing of the reference logits
        blended = blender.blend(*ref.parts, selector=name, ratio=0.15).logits.double().log_softmax(-1)
        bucketed = fidelity_measures.kl_top({t: float(logprobs[t]) for t in srv.first},
                                            {t: float(blended[t]) for t in srv.first})
        assert s["kl_first"] == pytest.approx(bucketed, abs=1e-4, rel=0.05) and bucketed <= r["kl_first"] + 1e-9
    assert r["kl_first"] > 0  # epic moves the distribution: the comparison above is not of zeros
