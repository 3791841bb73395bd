"""chunkcache.blend.cost: the blend-or-full prediction, priced by hand on rates chosen to isolate each term."""

import functools
import math
from types import SimpleNamespace

import torch

from chunkcache.blend.cost import (Calibration, ComputeCost, ModelShape, Prediction, Rates, full_s, host_rates, predict,
                                   work)
from chunkcache.blend.plan import plan_request
from chunkcache.select import REGISTRY
from chunkcache.select.base import QUERY_PASS_TOKENS

QUERY_PASS = SimpleNamespace(needs=(("query_attention", ()),))  # a selector reading the query's attention
NO_PASS = SimpleNamespace(needs=())
LAYERS = 30


def priced(plan, query_pass: bool, rates: Rates, margin: float = 0.0):
    return predict(plan, QUERY_PASS if query_pass else NO_PASS, rates, LAYERS, margin)

# 10 prefix tokens, two chunks of 100, a 5-token query: n = 215
PLAN = plan_request(torch.arange(215), [(10, 110), (110, 210)], ["a", "b"], matched=0, selector="prophet", ratio=0.1)


def test_tokens_the_blend_computes_against_the_whole_extend():
    p = priced(PLAN, query_pass=True, rates=Rates(token_s=1.0, pair_s=0.0, copy_s=0.0))
    # the prefix (10, computed exactly), ceil(0.1 x 200) picks, the query, the query pass again
    assert (p.blend_s, p.stock_s) == (10 + 20 + 5 + 5, 215) and p.blend
    holes = plan_request(torch.arange(215), [(10, 20), (200, 210)], ["a", "b"], matched=0, selector="prophet",
                         ratio=0.1)  # 180 tokens between the chunks: recomputed whatever the selector picks
    assert priced(holes, query_pass=False, rates=Rates(1.0, 0.0, 0.0)).blend_s == 10 + 2 + 180 + 5
    assert priced(holes, query_pass=True, rates=Rates(1.0, 0.0, 0.0)).blend_s == 10 + 2 + 180 + 5 + 5
    # an unstored passage after the last chunk is query: the recompute computes its 105 tokens, the query pass only
    # the last QUERY_PASS_TOKENS, attending the 110 held tokens and each other
    tail = plan_request(torch.arange(215), [(10, 60), (60, 110)], ["a", "b"], matched=0, selector="prophet", ratio=0.1)
    assert priced(tail, query_pass=True, rates=Rates(1.0, 0.0, 0.0)).blend_s == 10 + 10 + 105 + QUERY_PASS_TOKENS
    assert priced(tail, query_pass=True, rates=Rates(0.0, 1.0, 0.0)).blend_s == (
        10 * 10 / 2 + 10 * (10 + 110) / 2 + 105 * 215 + QUERY_PASS_TOKENS * (110 + QUERY_PASS_TOKENS))


def test_each_stage_is_priced_where_its_forward_runs():
    """The exact prefix (10 tokens of PLAN, nothing matched) runs in the first forward after it that attends it: the
    fill's when a chunk is missing, else the query pass, else the recompute; before a deviation pass (which stops
    early) in a forward of its own. One forward per stage that runs."""
    tokens = Rates(token_s=1.0, pair_s=0.0, copy_s=0.0)
    query = priced(PLAN, query_pass=True, rates=tokens)
    assert query.stages == {"fill": 0, "query": 5 + 10, "deviation": 0, "recompute": 20 + 5, "copy": 0}
    assert query.forwards == 2 and sum(query.stages.values()) == query.blend_s
    assert priced(PLAN, query_pass=False, rates=tokens).stages["recompute"] == 10 + 20 + 5
    missing = work(PLAN, QUERY_PASS, LAYERS, held=[True, False]).priced(tokens)
    assert missing["fill"] == 10 + 100 and missing["query"] == 5
    deviation_first = SimpleNamespace(needs=(("kv_deviation", (1, "k")), ("query_attention", ())))
    stages = work(PLAN, deviation_first, LAYERS).priced(tokens)
    assert stages["fill"] == 10 and stages["query"] == 5 and stages["deviation"] == math.ceil((215 - 10) * 2 / LAYERS)


def test_pairs_each_side_attends():
    p = priced(PLAN, query_pass=True, rates=Rates(token_s=0.0, pair_s=1.0, copy_s=0.0))
    assert p.stock_s == 215 * 216 / 2
    # the prefix's causal pairs; 20 picks spread over [10, 210), each attending its position; the query's 5 rows
    # (and the query pass's) attending all 215 keys
    assert p.blend_s == 10 * 10 / 2 + 20 * (10 + 210) / 2 + 5 * 215 + 5 * 215


def test_copying_the_reused_kv_can_make_the_blend_lose():
    p = priced(PLAN, query_pass=False, rates=Rates(token_s=1.0, pair_s=0.0, copy_s=10.0))
    assert p.blend_s == 35 + 200 * 10 and not p.blend
    assert p.report() == {"choice": "full", "predicted_blend_s": 2035.0, "predicted_full_s": 215.0}


def test_a_blend_predicted_within_the_margin_is_computed_in_full():
    # token_s 1, copy_s 0.7: blend 35 + 200 x 0.7 = 175 against 215 in full, 18.6 % faster
    rates = Rates(token_s=1.0, pair_s=0.0, copy_s=0.7)
    assert priced(PLAN, query_pass=False, rates=rates).blend  # no margin: any predicted gain blends
    assert priced(PLAN, query_pass=False, rates=rates, margin=0.15).blend
    assert not priced(PLAN, query_pass=False, rates=rates, margin=0.2).blend
    calibrated = Calibration()
    for side in ("blend", "full"):
        for _ in range(Calibration.MIN_OBSERVED):
            calibrated.observe(side, 1.0, 1.0)
    assert not calibrated.apply(priced(PLAN, query_pass=False, rates=rates, margin=0.2)).blend  # kept when scaled


def test_rates_are_measured_once_per_host_and_shape(tmp_path, monkeypatch):
    from chunkcache.blend import cost

    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path))
    runs = []
    monkeypatch.setattr(cost, "measure", lambda shape: runs.append(shape) or Rates(1e-4, 1e-9, 1e-7))
    shape = ModelShape(2, 64, 128, 4, 2, 16, "float32")
    assert host_rates(shape) == host_rates(shape) == Rates(1e-4, 1e-9, 1e-7) and runs == [shape]
    host_rates(ModelShape(4, 64, 128, 4, 2, 16, "float32"))
    assert len(runs) == 2


def test_measuring_rates_leaves_the_global_generator_as_it_was(tmp_path, monkeypatch):
    """Only the tensor-parallel ranks lacking a kept rates file measure; torch's global generator, seeded alike on
    every rank, samples their tokens: measuring must not draw from it."""
    from chunkcache.blend import cost

    monkeypatch.setenv("CHUNKCACHE_HOME", str(tmp_path))  # no kept rates: measured now
    monkeypatch.setattr(cost, "measure", functools.partial(cost.measure, tokens=16, keys=32))
    torch.manual_seed(1)
    before = torch.get_rng_state()
    host_rates(ModelShape(2, 64, 128, 4, 2, 16, "float32"))
    assert (tmp_path / "host-rates.json").is_file() and torch.equal(torch.get_rng_state(), before)


def test_the_measurement_gives_positive_rates():
    from chunkcache.blend.cost import measure

    r = measure(ModelShape(2, 64, 128, 4, 2, 16, "float32"), tokens=32, keys=64)
    assert r.token_s > 0 and r.pair_s > 0 and r.copy_s > 0


def _served(calibration: Calibration, fixed: float, scale: dict[str, float], query: float, recompute: float,
            full: float) -> None:
    """One blend and one full prefill on a server whose every forward takes `fixed` plus its side's `scale` of the
    rates' price: the blend's query pass (a probe) and recompute, and the full prefill."""
    calibration.observe("probe", query, fixed + scale["blend"] * query)
    calibration.observe("blend", recompute, fixed + scale["blend"] * recompute)
    calibration.observe("full", full, fixed + scale["full"] * full)


def test_calibration_learns_the_fixed_time_per_forward_and_each_sides_scale():
    c = Calibration()
    short = Prediction(blend_s=0.05, stock_s=0.08, stages={"query": 0.01, "recompute": 0.035, "copy": 0.005})
    assert c.apply(short) == short and c.state()["fixed_s"] is None and c.scale("blend") == 1.0  # nothing seen
    # forwards of 60 ms beyond their price, both sides at the rates: sizes vary, the fit is exact
    for query, recompute, full in [(0.01, 0.04, 0.08), (0.02, 0.3, 1.0), (0.015, 0.1, 0.3)]:
        _served(c, 0.06, {"blend": 1.0, "full": 1.0}, query, recompute, full)
    for _ in range(5):  # one-token extends (a prompt the radix tree holds): their time is the fixed part and noise
        c.observe("full", 0.0005, 0.065)
    fixed, scale = c.fit()
    assert abs(fixed - 0.06) < 1e-9 and scale == {"blend": 1.0, "full": 1.0}
    # a short prompt: the blend saves 30 ms of priced work but runs one forward more than the full prefill
    assert short.blend and not c.apply(short).blend
    calibrated = c.apply(short)
    assert abs(calibrated.blend_s - (2 * 0.06 + 0.045 + 0.005)) < 1e-9 and abs(calibrated.stock_s - 0.14) < 1e-9
    long = Prediction(blend_s=0.4, stock_s=1.2, stages={"query": 0.03, "recompute": 0.35, "copy": 0.02})
    assert c.apply(long).blend  # a long one still blends
    c.observe("blend", 0.2, 1000.0)  # one stalled forward: the medians do not move
    assert c.fit() == (fixed, scale)
    assert full_s(10, 5, Rates(1.0, 1.0, 0.0)) == 10 + (15 * 16 - 5 * 6) / 2


def test_each_side_is_scaled_by_its_own_forwards_and_an_unseen_side_by_the_others():
    c = Calibration()
    for _ in range(Calibration.MIN_OBSERVED):  # blends only, at twice the rates, no fixed time
        c.observe("blend", 0.5, 1.0)
    p = Prediction(blend_s=1.0, stock_s=1.2, stages={"recompute": 1.0})
    # the full side, never observed, takes the blend's scale: scaling one side alone would bias the choice
    assert c.fit() == (0.0, {"blend": 2.0, "full": 2.0}) and c.apply(p).blend and c.apply(p).stock_s == 2.4
    c.observe("full", 0.01, 0.06)  # a one-token extend: too short to scale by (no probe: under MIN_PRICED_S)
    for priced in (0.3, 0.5, 1.0):  # full prefills at the rates
        c.observe("full", priced, priced)
    assert c.fit() == (0.0, {"blend": 2.0, "full": 1.0}) and not c.apply(p).blend
    assert c.state() == {"fixed_s": 0.0, "scale": {"blend": 2.0, "full": 1.0},
                         "observed": {"probe": 0, "blend": 3, "full": 4}}


def test_a_chunks_compute_cost_is_the_fills_measured_rate_else_the_rates_else_unknown():
    rates = None
    cost = ComputeCost(lambda: rates, Calibration())
    assert cost.chunk_s(100) is None  # nothing measured, no rates: the store fetches
    rates = Rates(token_s=1e-3, pair_s=1e-6, copy_s=0.0)
    assert cost.chunk_s(100) == 100 * 1e-3 + 100 * 101 / 2 * 1e-6  # a chunk after no prefix, at the rates
    cost.observe(ComputeCost.MIN_TOKENS - 1, 100.0)  # too few tokens to say a rate: not observed
    assert cost.per_token_s is None
    for tokens, seconds in [(100, 0.2), (200, 0.2), (400, 1.2)]:  # 2, 1 and 3 ms per token
        cost.observe(tokens, seconds)
    assert cost.per_token_s == 2e-3 and cost.chunk_s(50) == 50 * 2e-3  # the median, over the rates


def test_admission_charges_the_work_the_prediction_prices():
    """One count of a blend's work (cost.work): its tokens are what the server's admission charges and what the
    prediction prices at token_s; the query pass is at most QUERY_PASS_TOKENS rows, a measured deviation pass its
    share of the layers, a missing chunk its tokens, and `none` recomputes no picks whatever rho."""
    long_query = plan_request(torch.arange(300), [(10, 110), (110, 210)], ["a", "b"], matched=0, selector="prophet",
                              ratio=0.1)  # a 90-token query
    prophet = REGISTRY.create("prophet")
    w = work(long_query, prophet, LAYERS)
    assert (w.exact_prefix, w.recomputed, w.query_rows, w.deviation) == (10, 20 + 90, QUERY_PASS_TOKENS, 0)
    assert w.reused == 200
    assert predict(long_query, prophet, Rates(1.0, 0.0, 0.0), LAYERS).blend_s == w.tokens
    assert work(long_query, prophet, LAYERS, held=[True, False]).tokens == w.tokens + 100
    assert work(long_query, REGISTRY.create("none"), LAYERS).recomputed == 90
    measured = REGISTRY.create("cacheblend")  # K deviation at its check layer, measured in the request
    (name, (layer, _)), = measured.needs
    share = -(-(300 - 10) * (layer + 1) // LAYERS)  # every token after the prefix, through the check layer
    assert name == "kv_deviation" and work(long_query, measured, LAYERS).deviation == share


def test_a_sides_scale_is_read_at_the_size_it_prices():
    """Short forwards run the matmuls' few rows slower than the rates (measured on 512) say, long ones as they say:
    a prediction takes the scale of the forwards nearest its size."""
    c = Calibration()
    for _ in range(Calibration.MIN_OBSERVED):  # blends at the rates
        c.observe("blend", 0.5, 0.5)
    for i in range(Calibration.NEAREST):
        c.observe("full", 0.3 + 0.01 * i, 3 * (0.3 + 0.01 * i))  # short full prefills at 3x the rates
        c.observe("full", 2.0 + 0.1 * i, 2.0 + 0.1 * i)  # long ones at the rates
    assert abs(c.apply(Prediction(blend_s=1.0, stock_s=2.2, stages={"recompute": 1.0})).stock_s - 2.2) < 1e-9
    assert abs(c.apply(Prediction(blend_s=0.2, stock_s=0.33, stages={"recompute": 0.2})).stock_s - 0.99) < 1e-9
