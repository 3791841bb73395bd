"""The `mix` selector and its adaptive budget: hand-computed picks on a hand-made request, the single-signal limits
equal to the anchors they come from (prophet, cacheblend) on a tiny model, and the adaptive budget's invariants
(smallest k reaching the mass, inside [floor, min(cap, rho)], reported as Selection.ratio)."""

import math

import pytest
import torch

from chunkbench.quality.quality import table
from chunkcache.config import Config
from chunkcache.models import tiny_model
from chunkcache.reference import ReferenceBlender
from chunkcache.select import REGISTRY, create
from chunkcache.select.adaptive import AdaptiveBudget
from chunkcache.select.base import Layout
from chunkcache.select.budget import rank

# prefix [0, 2), chunks [2, 6) and [6, 10), query [10, 12): context tokens 2..9
LAYOUT = Layout(torch.arange(12), 2, ((2, 6), (6, 10)), (10, 12))
# raw signals; the prefix and query values must be ignored (a sink in the prefix, the query's own attention)
QA = torch.tensor([100.0, 9, 0, 4, 0, 0, 0, 0, 2, 2, 50, 50])  # on the context: 3: 1/2, 8: 1/4, 9: 1/4
DEV = torch.tensor([0.0, 0, 0, 0, 3, 1, 0, 0, 0, 0, 7, 7])  # on the context: 4: 3/4, 5: 1/4
# mixed at (relevance .5, deviation .3, boundary .2, 1 boundary token: 2 and 6 get 1/2 each):
# 2: .1, 3: .25, 4: .225, 5: .075, 6: .1, 7: 0, 8: .125, 9: .125
ORDER = [3, 4, 8, 9, 2, 6, 5, 7]
FORCED = [10, 11]


class Stub:
    """Hand-made Features."""

    def __init__(self, qa=QA, dev=DEV):
        self.qa, self.dev, self.asked = qa, dev, []

    def query_attention(self):
        self.asked.append(("query_attention", ()))
        return self.qa

    def kv_deviation(self, layer, which):
        self.asked.append(("kv_deviation", (layer, which)))
        return self.dev


def mix(**options):
    return create("mix", **{"relevance": 0.5, "deviation": 0.3, "boundary": 0.2, "boundary_tokens": 1,
                            "combine": "sum", **options})


# product: overlapping signals (context tokens 2..9); relevance .1 .4 .2 .3 0 0 0 0, deviation 0 .1 .3 .1 .1 .2 .2 0
QA2 = torch.tensor([100.0, 9, 1, 4, 2, 3, 0, 0, 0, 0, 50, 50])
DEV2 = torch.tensor([0.0, 0, 0, 1, 3, 1, 1, 2, 2, 0, 7, 7])


def test_product_hand_computed():
    # weights 1, 1: .04 .06 .03 at tokens 3, 4, 5, zero elsewhere (token 2 is read but exact: no deviation)
    sel = create("mix", relevance=1, deviation=1).select(LAYOUT, 0.25, Stub(QA2, DEV2))
    assert sel.indices.tolist() == [3, 4] + FORCED
    expected = torch.tensor([0, 0, 0, 4 / 13, 6 / 13, 3 / 13, 0, 0, 0, 0, 0, 0])
    torch.testing.assert_close(sel.scores, expected.float())
    # weights are exponents: the default half and half is the geometric mean, same order, its own distribution
    half = create("mix").select(LAYOUT, 0.375, Stub(QA2, DEV2))
    assert half.indices.tolist() == [3, 4, 5] + FORCED
    geo = torch.tensor([0.04, 0.06, 0.03]).sqrt()
    torch.testing.assert_close(half.scores[3:6], (geo / geo.sum()).float())
    # disjoint signals leave no product: uniform over the context, nothing preferred
    flat = create("mix").select(LAYOUT, 0.25, Stub())
    torch.testing.assert_close(flat.scores, (LAYOUT.context_mask().float() / 8))


@pytest.mark.parametrize("ratio,picked", [(0.25, [3, 4]), (0.5, [3, 4, 8, 9]), (0.75, [2, 3, 4, 6, 8, 9])])
def test_hand_computed_picks(ratio, picked):
    sel = mix().select(LAYOUT, ratio, Stub())
    assert sel.indices.tolist() == sorted(picked + FORCED)
    assert sel.ratio is None  # a fixed budget spends the request's rho
    expected = torch.tensor([0, 0, .1, .25, .225, .075, .1, 0, .125, .125, 0, 0])
    torch.testing.assert_close(sel.scores, expected.float())
    # each anchor alone would pick otherwise: prophet {3, 8}, cacheblend {4, 5}, epic {2, 6}
    assert rank(QA, LAYOUT.context_mask())[:2].tolist() == [3, 8]
    assert rank(DEV, LAYOUT.context_mask())[:2].tolist() == [4, 5]


def test_scores_are_a_distribution_over_the_context_whatever_the_scales():
    for scale in (1e-6, 1.0, 1e6):
        sel = mix().select(LAYOUT, 0.5, Stub(QA * scale, DEV / scale))
        assert sel.scores.sum().item() == pytest.approx(1.0)
        assert float(sel.scores[~LAYOUT.context_mask()].abs().sum()) == 0.0
        assert rank(sel.scores, LAYOUT.context_mask()).tolist() == ORDER


def test_asks_only_for_the_signals_it_weighs():
    assert create("mix").needs == (("query_attention", ()), ("kv_deviation", (3, "k")))
    assert create("mix", relevance=0, layer=3, which="v").needs == (("kv_deviation", (3, "v")),)
    stub = Stub()
    mix(deviation=0).select(LAYOUT, 0.5, stub)
    assert stub.asked == [("query_attention", ())]


@pytest.mark.parametrize("options,message", [
    ({"relevance": -1}, "weights"), ({"relevance": 0, "deviation": 0, "boundary": 0}, "positive sum"),
    ({"boundary_tokens": 0}, "boundary_tokens"), ({"which": "q"}, "which"), ({"mass": 0}, "mass"),
    ({"combine": "max"}, "combine"), ({"boundary": 0.2}, "boundary=0"),
    ({"mass": 0.8, "rho_floor": 0.5, "rho_cap": 0.2}, "above cap"), ({"mass": 0.8, "rho_cap": 2}, "cap"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        create("mix", **options)


# ---- adaptive budget ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options,ratio,picked", [
    ({"mass": 0.4}, 1.0, [3, 4]),  # .25 + .225 = .475 >= .4
    ({"mass": 0.55}, 1.0, [3, 4, 8]),  # .475 < .55 <= .6
    ({"mass": 0.99}, 0.25, [3, 4]),  # capped by the request's rho (K = 2)
    ({"mass": 0.99, "rho_cap": 0.5}, 1.0, [3, 4, 8, 9]),  # capped by rho_cap
    ({"mass": 0.2, "rho_floor": 0.5}, 1.0, [3, 4, 8, 9]),  # .25 would do; the floor gives K = 4
    ({"mass": 1.0}, 1.0, [2, 3, 4, 5, 6, 8, 9]),  # every token with a positive score, not token 7 (0)
])
def test_adaptive_hand_computed(options, ratio, picked):
    sel = mix(**{"rho_floor": 0.0, **options}).select(LAYOUT, ratio, Stub())
    assert sel.indices.tolist() == sorted(picked + FORCED)
    assert sel.ratio == len(picked) / 8


def test_adaptive_without_signal_spends_the_floor():
    budget = AdaptiveBudget(mass=0.9, floor=0.25, cap=1.0)
    picked, rho = budget.pick(LAYOUT, torch.zeros(12), 1.0)
    assert picked.tolist() == [2, 3] and rho == 0.25  # ties to the lower index


def test_adaptive_invariants_on_random_scores():
    g = torch.Generator().manual_seed(0)
    layout = Layout(torch.arange(200), 10, ((10, 70), (70, 130), (130, 190)), (190, 200))
    ctx = layout.context_mask()
    n_ctx = int(ctx.sum())
    for _ in range(200):
        scores = torch.rand(200, generator=g) ** float(torch.randint(1, 8, (1,), generator=g))
        mass, floor, cap, ratio = (float(x) for x in torch.rand(4, generator=g))
        mass = max(mass, 0.01)
        floor, cap = min(floor, cap), max(floor, cap)
        picked, rho = AdaptiveBudget(mass, floor, cap).pick(layout, scores, ratio)
        k = picked.numel()
        high = layout.budget(min(cap, ratio))
        low = min(layout.budget(min(floor, ratio)), high)
        assert low <= k <= high and rho == k / n_ctx
        assert picked.tolist() == rank(scores, ctx)[:k].tolist()  # the best-scored k
        held = scores[ctx].sort(descending=True).values.double().cumsum(0) / float(scores[ctx].sum())
        if k < high:  # not capped: the picks reach the mass
            assert held[k - 1] >= mass * (1 - 1e-9)
        if k > max(low, 1):  # not floored: one fewer would not
            assert held[k - 2] < mass


# ---- on a model ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def blender():
    return ReferenceBlender.from_pretrained(tiny_model("llama"))


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(5, 1000, (5,), generator=g).tolist()
    chunks = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (20, 13, 18)]
    return prefix, chunks, torch.randint(5, 1000, (6,), generator=g).tolist()


@pytest.mark.parametrize("options,anchor", [
    ({"relevance": 1, "deviation": 0, "boundary": 0}, "prophet"),
    ({"relevance": 0, "deviation": 1, "boundary": 0, "layer": 1, "which": "v"}, "cacheblend"),  # CacheBlend's layer, V
])
def test_one_signal_alone_picks_what_its_anchor_picks(blender, prompt, options, anchor):
    for ratio in (0.1, 0.3):
        ours = blender.blend(*prompt, selector="mix", ratio=ratio, **options)
        theirs = blender.blend(*prompt, selector=anchor, ratio=ratio)
        assert torch.equal(ours.recomputed, theirs.recomputed)


def test_adaptive_on_a_model_stays_within_floor_and_the_requests_rho(blender, prompt):
    for ratio in (0.1, 0.2, 0.4):
        for mass in (0.3, 0.9):
            res = blender.blend(*prompt, selector="mix", ratio=ratio, mass=mass, rho_floor=0.05)
            ctx = res.layout.context_mask()
            k = int(ctx[res.recomputed].sum())
            assert res.layout.budget(min(0.05, ratio)) <= k <= res.layout.budget(ratio)
            assert res.layout.forced_mask()[res.recomputed].sum() == res.layout.forced_mask().sum()


def test_adaptive_knobs_are_checked_when_the_config_loads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("select:\n  selector: mix\n  options:\n    mix: {mass: 0.8, rho_floor: 0.02, rho_cap: 0.3, "
                    "overlap: 0}\n")
    sel = create("mix", **Config.load(path, selectors=REGISTRY).select.options["mix"])
    assert (sel.mass, sel.rho_floor, sel.rho_cap) == (0.8, 0.02, 0.3)
    for bad, message in (("{mass: 1.5, overlap: 0}", r"select:options:mix: mass must be in \(0, 1\]"),
                         ("{masss: 0.8}", "select:options:mix: .*unexpected keyword argument 'masss'"),
                         ("{mass: 0.8, rho_floor: 0.4, rho_cap: 0.3, overlap: 0}", "floor 0.4 is above cap 0.3"),
                         ("{mass: 0.8}", "set overlap: 0 beside mass")):
        path.write_text(f"select:\n  options:\n    mix: {bad}\n")
        with pytest.raises(ValueError, match=message):
            Config.load(path, selectors=REGISTRY)


def test_eval_table_reports_the_rho_used():
    rows = [{"selector": "mix", "ratio": 0.15, "rho_used": r, "f1": 1.0} for r in (0.05, 0.1, 0.15)]
    line = table(rows, resamples=99)[0]
    assert math.isclose(line["rho_used"], 0.1) and line["ci"]["rho_used"][0] <= 0.1 <= line["ci"]["rho_used"][1]
