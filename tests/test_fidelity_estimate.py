"""The fidelity estimate (chunkcache/blend/fidelity.py): the signals computed by hand on a hand-made request, the
choice of rho (monotone in the bound, None when even the cap misses it, the grid's smallest when the bound is loose),
and the shipped coefficients file."""

import json
import math
import random
from dataclasses import fields, replace

import pytest
import torch

from chunkcache.blend import fidelity
from chunkcache.blend.fidelity import Linear, Model, Signals
from chunkcache.hashing import model_fingerprint
from chunkcache.select import create
from chunkcache.select.base import Layout

# prefix [0, 2), chunks [2, 6) and [6, 10), query [10, 12): context tokens 2..9
LAYOUT = Layout(torch.arange(12), 2, ((2, 6), (6, 10)), (10, 12))
SCORES = torch.tensor([0, 0, .1, .2, .3, .1, .1, .1, .05, .05, 0, 0])  # a distribution on the context
ATTENTION = torch.tensor([1.0, .2, .1, .2, .3, .1, .1, .1, .05, .05, .5, .3])  # three layers: sums to 3
DEVIATION = torch.tensor([0.0, 0, 0, 0, 0, 0, 2, 4, 1, 3, 9, 9])  # the first chunk is at home: exact, no deviation
RECOMPUTED = torch.tensor([4, 7, 10, 11])  # context tokens 4 and 7, and the query


def test_signals_by_hand():
    s = fidelity.signals(fidelity.Evidence(LAYOUT, SCORES, ATTENTION, DEVIATION), RECOMPUTED)
    assert s.ratio == 2 / 8
    assert s.mass_left == pytest.approx(1 - .3 - .1)
    # context tokens left: 2, 3, 5, 6, 8, 9
    assert s.attention_left == pytest.approx((.1 + .2 + .1 + .1 + .05 + .05) / 3)
    assert s.deviation == pytest.approx((.1 * 2 + .1 * 4 + .05 * 1 + .05 * 3) / 3)  # the query and prefix: not context
    assert s.deviation_left == pytest.approx((.1 * 2 + .05 * 1 + .05 * 3) / 3)  # token 7's deviation 4 recomputed


def test_signals_without_attention_or_deviation():
    s = fidelity.signals(fidelity.Evidence(LAYOUT, SCORES, None, None), RECOMPUTED)
    assert (s.attention_left, s.deviation, s.deviation_left) == (None, None, None)
    reads_deviation = replace(IDENTITY, kl=Linear(0.0, {"deviation_left": 1.0}))
    assert fidelity.estimate(s, reads_deviation) is None  # no estimate: a bound is then met by computing in full
    assert fidelity.smallest_ratio(lambda r: replace(s, ratio=r), 1e9, reads_deviation) is None
    assert fidelity.signals(fidelity.Evidence(LAYOUT, SCORES, ATTENTION, None), RECOMPUTED).deviation_left is None
    everything = fidelity.signals(fidelity.Evidence(LAYOUT, SCORES, ATTENTION, DEVIATION), torch.arange(2, 12))
    assert (everything.ratio, everything.mass_left, everything.attention_left, everything.deviation_left) == \
        (1.0, 0.0, 0.0, 0.0)
    assert everything.deviation == pytest.approx((.1 * 2 + .1 * 4 + .05 * 1 + .05 * 3) / 3)


def test_evidence_reads_the_memoised_features():
    values = {("query_attention", ()): ATTENTION, ("remembered_deviation", (3, "k")): DEVIATION,
              ("prompt_text", ()): ("", [])}
    ev = fidelity.evidence(LAYOUT, SCORES, values)
    assert torch.equal(ev.attention, ATTENTION) and torch.equal(ev.deviation, DEVIATION)
    assert fidelity.evidence(LAYOUT, SCORES, {}).attention is None


class Memo:
    """Features with every value memoised, as RequestFeatures holds them after the prefetch."""

    def __init__(self):
        self.values = {("query_attention", ()): ATTENTION, ("kv_deviation", (3, "k")): DEVIATION}

    def query_attention(self):
        return self.values["query_attention", ()]

    def kv_deviation(self, layer, which):
        return self.values["kv_deviation", (layer, which)]


def test_at_ratios_is_the_selectors_pick():
    mix = create("mix")
    at = fidelity.at_ratios(mix, LAYOUT, Memo())
    for ratio in (0.25, 0.5):
        sel = mix.select(LAYOUT, ratio, Memo())
        ev = fidelity.Evidence(LAYOUT, sel.scores, ATTENTION, DEVIATION)
        assert at(ratio) == fidelity.signals(ev, sel.indices)
    assert at(0.25).ratio == 0.25 and at(0.5).mass_left < at(0.25).mass_left


# the estimate is the share of score mass left itself: log KL = log(mass_left)
IDENTITY = Model(quantile=0.9, kl=Linear(0.0, {"mass_left": 1.0}), margin=0.0, agree=Linear(0.0, {}),
                 fitted_on="by hand", covers=1, fingerprint=None, name="by-hand")
BASE = Signals(ratio=0, mass_left=1, attention_left=0, deviation=1, deviation_left=0)
# not monotone in rho (0.15 estimates more than 0.1): the choice must be monotone in the bound anyway
LEFT = {0.05: 0.5, 0.1: 0.3, 0.15: 0.35, 0.25: 0.1, 0.4: 0.05, 0.6: 0.02, 0.8: 0.005}


def at(ratio: float) -> Signals:
    return replace(BASE, ratio=ratio, mass_left=LEFT[ratio])


def test_estimate_by_hand():
    est = fidelity.estimate(at(0.1), IDENTITY)
    assert est.kl == pytest.approx(0.3) and est.agree == 0.5
    shifted = fidelity.estimate(at(0.1), replace(IDENTITY, margin=math.log(2)))
    assert shifted.kl == pytest.approx(0.6)


@pytest.mark.parametrize(("max_kl", "cap", "chosen"), [(1.0, 1.0, 0.05), (0.5, 1.0, 0.05), (0.32, 1.0, 0.1),
                                                      (0.08, 1.0, 0.4), (0.03, 1.0, 0.6), (0.01, 1.0, 0.8),
                                                      (0.001, 1.0, None), (0.08, 0.25, None), (0.3, 0.05, None),
                                                      (0.01, 0.6, None)])
def test_smallest_ratio(max_kl, cap, chosen):
    assert fidelity.smallest_ratio(at, max_kl, IDENTITY, cap=cap) == chosen


def test_an_estimator_chooses_only_from_the_rho_it_was_fitted_on():
    # fitted up to 0.4: a bound only 0.6 would meet is computed in full, not met by extrapolating the estimate
    earlier = replace(IDENTITY, ratios=fidelity.EARLIER_RATIOS)
    assert fidelity.smallest_ratio(at, 0.03, earlier) is None and fidelity.smallest_ratio(at, 0.03, IDENTITY) == 0.6
    assert fidelity.smallest_ratio(at, 0.08, earlier) == 0.4


def test_a_first_token_floor_reads_the_first_token_estimator_and_the_shipped_ones_have_it():
    first = replace(IDENTITY, covers=1, margin=math.log(0.1))  # estimates a tenth of the answer's
    answer = replace(IDENTITY, covers=16, first_token=first)
    assert fidelity.bounding(answer, "answer") is answer and fidelity.bounding(answer, "first_token") is first
    assert fidelity.bounding(IDENTITY, "first_token") is None and fidelity.bounding(None, "answer") is None
    # the same request and bound: the looser promise needs less rho
    assert fidelity.smallest_ratio(at, 0.04, fidelity.bounding(answer, "answer")) == 0.6
    assert fidelity.smallest_ratio(at, 0.04, fidelity.bounding(answer, "first_token")) == 0.1
    for name, model in fidelity.load().models.items():
        assert model.covers == 16 and model.first_token.covers == 1 and model.first_token.first_token is None, name
        assert model.first_token.ratios == model.ratios, name
    data = json.loads(fidelity.PACKAGED.read_text())
    entry = data["models"][data["default"]]
    with pytest.raises(ValueError, match="first_token must be an estimator"):
        fidelity.parse_model("m", {**entry, "first_token": {**entry["first_token"], "covers": 16}})


def test_an_entry_without_its_grid_reads_the_earlier_one_and_a_bad_grid_is_refused():
    data = json.loads(fidelity.PACKAGED.read_text())
    entry = dict(data["models"][data["default"]])
    del entry["ratios"], entry["first_token"]
    assert fidelity.parse_model("m", entry).ratios == fidelity.EARLIER_RATIOS  # a calibrations file of an earlier
    old = {**data, "doc": {k: v for k, v in data["doc"].items() if k != "ratios"}, "models": {"m": entry}}
    assert fidelity.parse({**old, "default": "m"}).model("m").ratios == fidelity.EARLIER_RATIOS  # version loads
    for bad in ([], [0.1, 1.0], [0.1, True], "0.1"):
        with pytest.raises(ValueError, match="ratios"):
            fidelity.parse_model("m", {**entry, "ratios": bad})


def test_smallest_ratio_is_monotone_in_the_bound():
    rng = random.Random(0)
    for _ in range(50):
        left = {r: rng.random() for r in fidelity.RATIOS}
        signals_at = (lambda r, left=left: replace(BASE, ratio=r, mass_left=left[r]))
        chosen = [fidelity.smallest_ratio(signals_at, b, IDENTITY) for b in sorted(rng.random() for _ in range(20))]
        as_rho = [2.0 if c is None else c for c in chosen]  # None: computed in full, more than any rho
        assert as_rho == sorted(as_rho, reverse=True)


def test_smallest_ratio_refuses_a_negative_bound():
    with pytest.raises(ValueError, match="max_kl"):
        fidelity.smallest_ratio(at, -0.1, IDENTITY)


def test_the_shipped_coefficients_load_with_a_doc_line_per_field():
    data = json.loads(fidelity.PACKAGED.read_text())
    assert set(data["doc"]) == set(fidelity.FILE_FIELDS) | set(fidelity.MODEL_FIELDS) and all(data["doc"].values())
    assert not set(data["doc"]) - set(fidelity.FILE_FIELDS) - {f.name for f in fields(Model)}
    assert set(fidelity.MODEL_FIELDS) == {f.name for f in fields(Model)} - {"name"}
    coefficients = fidelity.load()
    assert coefficients.default in data["models"]
    for name, model in coefficients.models.items():
        assert model.name == name and 0.5 < model.quantile < 1 and model.fitted_on == data["models"][name]["fitted_on"]
        assert name in model.fitted_on  # the doc line names the model the cases ran on
        assert set(model.kl.weights) <= {f.name for f in fields(Signals)}
        est = fidelity.estimate(at(0.15), model)
        assert est.kl > 0 and 0 < est.agree < 1 and est.fitted_for == name


def test_a_served_model_gets_its_own_estimator_and_none_pretends_to_be_another_models():
    own = replace(IDENTITY, name="own")
    other = replace(IDENTITY, kl=Linear(1.0, {"mass_left": 1.0}), name="other")
    coefficients = fidelity.Coefficients({"own": own, "other": other}, default="other")
    assert coefficients.model("/home/x/.chunkcache/models/own") is own  # a served directory, named after it
    assert coefficients.model("own") is own and coefficients.model(None) is other
    assert coefficients.model("/models/unknown") is None


def test_a_calibration_matches_its_weights_only_and_a_name_never_stands_in_for_a_fingerprint(tmp_path):
    from chunkcache.models import tiny_model

    mine, other = tiny_model("llama"), tiny_model("llama", seed=1)
    calibrated = replace(IDENTITY, fingerprint=model_fingerprint(mine), name="calibrated")
    # an entry keyed by the served directory's name but fitted on other weights: not the served model's
    stale = replace(IDENTITY, fingerprint="0" * 16, name=other.name)
    coefficients = fidelity.Coefficients({"calibrated": calibrated, other.name: stale}, default="calibrated")
    assert coefficients.model(mine) is calibrated and coefficients.model(other) is None
    # the calibrations file comes before the shipped one, which stays; a damaged one is named
    path = tmp_path / "fidelity.json"
    assert fidelity.coefficients(path).models == fidelity.load().models  # none yet
    data = json.loads(fidelity.PACKAGED.read_text())
    data["models"] = {"calibrated": {**data["models"][data["default"]], "fingerprint": model_fingerprint(mine)}}
    data["default"] = "calibrated"
    path.write_text(json.dumps(data))
    merged = fidelity.coefficients(path)
    assert merged.model(mine).name == "calibrated" and merged.default == fidelity.load().default
    assert set(fidelity.load().models) < set(merged.models)
    # an entry of the file under a shipped model's name is the one used, not the shipped one
    shipped = fidelity.load().default
    data["models"][shipped] = {**data["models"]["calibrated"], "fingerprint": None, "margin": 9.0}
    clash = tmp_path / "clash.json"
    clash.write_text(json.dumps(data))
    assert fidelity.coefficients(clash).model(shipped).margin == 9.0
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**data, "default": "nobody"}))
    with pytest.raises(ValueError, match="broken.json"):
        fidelity.coefficients(broken)


def test_a_coefficients_file_without_a_doc_line_is_refused():
    data = json.loads(fidelity.PACKAGED.read_text())
    del data["doc"]["margin"]
    with pytest.raises(ValueError, match="doc line"):
        fidelity.parse(data)
    data = json.loads(fidelity.PACKAGED.read_text())
    data["models"][data["default"]]["kl"]["weights"]["nonsense"] = 1.0
    with pytest.raises(ValueError, match="nonsense"):
        fidelity.parse(data)
    data = json.loads(fidelity.PACKAGED.read_text())
    data["default"] = "unfitted"
    with pytest.raises(ValueError, match="unfitted"):
        fidelity.parse(data)


def test_the_fits_quantile_regression_and_wilson_interval():
    import numpy as np

    from chunkbench.quality.fidelity_fit import quantile_regression
    from chunkbench.intervals import wilson

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, 2000)
    y = 2 + 3 * x + rng.uniform(0, 1, 2000)  # the 0.9 quantile of y given x: 2.9 + 3x
    beta = quantile_regression(np.stack([np.ones_like(x), x], 1), y, 0.9)
    np.testing.assert_allclose(beta, [2.9, 3.0], atol=0.05)
    assert wilson(10, 100) == pytest.approx((0.0552, 0.1744), abs=1e-4)
    assert wilson(0, 100)[0] == 0.0 and wilson(0, 20)[1] == pytest.approx(0.1611, abs=1e-4) and wilson(5, 5)[1] == 1.0


def test_the_calibration_tables_ttft_column_reads_ttft_shuffleds_table(tmp_path):
    from chunkbench.quality.fidelity_fit import read_ttft

    head = ("side        TTFT median s  speed-up vs stock  hits\n"
            "stock               0.800               1.00\n")
    sides = {**{r: 0.2 + 0.08 * i for i, r in enumerate(fidelity.RATIOS)}, 1: 0.88}
    table = tmp_path / "t.txt"
    table.write_text(head + "".join(f"mix@{r:<8g}{t:>15.3f}{0.8 / t:>19.2f}     7\n" for r, t in sides.items()))
    assert read_ttft(str(table)) == pytest.approx({float(r): t / 0.8 for r, t in sides.items()})
    table.write_text(head + "mix@0.05            0.200               4.00     7\n")
    with pytest.raises(ValueError, match="a side at each rho"):
        read_ttft(str(table))


def test_the_margin_is_calibrated_per_bound_not_pooled_over_bounds(monkeypatch):
    """Two cases with the same measured KL; case 1's log-KL estimate underrates rho 0.05 by 0.5, case 2's is right. At
    bound 0.02 case 1 chooses 0.05 and exceeds: half the family at that bound, 1/12 pooled over the six bounds, which
    a 10 % target pooled would pass at margin 0. Per bound, the smallest margin is 0.5 - log(0.03 / 0.02)."""
    from types import SimpleNamespace

    from chunkbench.quality import fidelity_fit
    from chunkbench.quality.fidelity_fit import BOUNDS, _exceeded, calibrate, choose

    kl = {0.05: 0.03, 0.1: 0.015, 0.15: 0.012, 0.25: 0.006, 0.4: 0.001}
    right = {r: math.log(v) for r, v in kl.items()}
    under = {**right, 0.05: right[0.05] - 0.5}
    cases = {("multikey", f"multikey{i}"): {r: SimpleNamespace(row={"kl": v}) for r, v in kl.items()} for i in (1, 2)}
    estimates = {("multikey", "multikey1"): under, ("multikey", "multikey2"): right}
    assert choose(under, 0.02, 0.0) == 0.05 and _exceeded(cases, estimates, 0.0, 0.02) == 0.5
    assert sum(_exceeded(cases, estimates, 0.0, b) for b in BOUNDS) / len(BOUNDS) <= 0.1  # pooled: would pass
    needed = 0.5 - math.log(0.03 / 0.02)  # case 1's estimate at 0.05 then just above log(0.02): it chooses 0.1
    assert _exceeded(cases, estimates, needed + 1e-9, 0.02) == 0.0
    monkeypatch.setattr(fidelity_fit, "held_out", lambda *args: estimates)  # given, not fitted
    margin = calibrate(cases, ("ratio",), 0.9, 0.1, 5)
    assert needed <= margin < needed + 0.05
