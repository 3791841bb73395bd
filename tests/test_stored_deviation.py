"""`mix` with `stored_deviation`: each chunk's KV deviation is measured in its first blend away from home (right after
the shared prefix, where its reused KV is exact), kept in its store entry as it would be at DEPTH_REF positions from
home, and read by later requests, scaled to the chunk's depth there, instead of a deviation pass. `first_reuse`
says where the first measurement runs: "measure" in the request (a deviation pass), "estimate" after it (a
DeviationJob), the request itself reading an estimate. Oracles: the engine's own pass output in the request that
measured it (recorded), a selector reading kv_deviation in the same order, the depth rule computed by hand, and the
product computed by hand from the stored slices."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from chunkcache import reference
from chunkcache.blend.features import (DEPTH_EXPONENT, DEPTH_REF, DEVIATION_MEASUREMENTS, OFFSET_EXPONENT,
                                       deviation_feature)
from chunkcache.hashing import chunk_key, prefix_key
from chunkcache.models import tiny_model
from chunkcache.reference import ReferenceBlender
from chunkcache.select.base import Layout, Selection, finish

NAME = deviation_feature(3, "k")  # mix's defaults: K at layer 3
STORED = dict(stored_deviation=True, first_reuse="measure")
ESTIMATED = dict(stored_deviation=True, first_reuse="estimate")  # the default
RHO = 0.3


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model("llama", initializer_range=0.1)  # large enough weights for deviations that differ by context


@pytest.fixture
def blender(model_dir):
    return ReferenceBlender.from_pretrained(model_dir)  # a fresh in-memory store per test


@pytest.fixture
def passes(monkeypatch):
    """The deviation passes the engine runs: one [N] tensor per call (the request's, as the pass returned it)."""
    seen = []
    measure = reference._Engine.kv_deviation

    def counted(self, requests, layer, which):
        out = measure(self, requests, layer, which)
        seen.append(out[0].clone())
        return out

    monkeypatch.setattr(reference._Engine, "kv_deviation", counted)
    return seen


@pytest.fixture(scope="module")
def parts():
    g = torch.Generator().manual_seed(5)

    def r(n):
        return torch.randint(5, 1000, (n,), generator=g).tolist()

    return r(6), {"A": r(15), "B": r(11), "C": r(13)}, r(5)


def order(parts, names):
    prefix, chunks, query = parts
    return prefix, [chunks[n] for n in names], query


def spans(parts, names):
    """Each named chunk's [start, end) in the prompt of that order."""
    prefix, chunks, _ = parts
    out, at = {}, len(prefix)
    for n in names:
        out[n] = (at, at + len(chunks[n]))
        at += len(chunks[n])
    return out


def stored(blender, parts, name=NAME):
    """Each chunk's remembered deviation, None where its entry has none."""
    prefix, chunks, _ = parts
    pkey = prefix_key(torch.tensor(prefix))
    keys = {n: chunk_key(blender.fingerprint, blender.namespace, pkey, torch.tensor(c)) for n, c in chunks.items()}
    entries = blender.store.get_many(list(keys.values()))
    return {n: entries[k].features.get(name) for n, k in keys.items()}


def counts(blender, parts):
    """How many measurements each chunk's remembered deviation averages (0: none)."""
    return {n: 0 if c is None else int(c) for n, c in stored(blender, parts, f"{NAME}/n").items()}


@dataclass
class Capture:
    """Reads the two signals mix weighs, as measured in this request; picks nothing but the forced tokens."""

    name: ClassVar[str] = "capture"
    seen: dict | None = None

    def select(self, layout: Layout, ratio: float, features) -> Selection:
        self.seen = {"qa": features.query_attention(), "dev": features.kv_deviation(3, "k"), "layout": layout}
        return finish(layout, torch.zeros(0, dtype=torch.long), None)


def measured(blender, parts, names):
    cap = Capture()
    blender.blend(*order(parts, names), selector=cap)
    return cap.seen


def at_ref(depth):
    """The factor from a deviation measured `depth` positions from home to the one an entry keeps, by hand."""
    return (DEPTH_REF / depth) ** DEPTH_EXPONENT


def shaped(tokens):
    """An estimated deviation over a chunk's tokens, by hand: (offset + 1) ** -OFFSET_EXPONENT, mean 1."""
    w = [(j + 1) ** -OFFSET_EXPONENT for j in range(tokens)]
    return torch.tensor([x * tokens / sum(w) for x in w], dtype=torch.float64)


def product(qa, dev, layout):
    """mix's default score by hand: the geometric mean of the two distributions over the context, renormalised."""
    ctx = layout.context_mask().double()
    rel, d = qa.double() * ctx, dev.double().clamp_min(0) * ctx
    mixed = (rel / rel.sum() * d / d.sum()).sqrt()
    return mixed / mixed.sum()


def test_first_blend_measures_once_and_stores_the_away_chunks(blender, parts, passes):
    blender.blend(*order(parts, "ABC"), selector="mix", ratio=RHO, **STORED)
    assert len(passes) == 1
    fresh = measured(blender, parts, "ABC")["dev"]  # the same order through kv_deviation, another request
    at, got = spans(parts, "ABC"), stored(blender, parts)
    assert got["A"] is None  # at home: its deviation here is zero and says nothing of elsewhere
    for n in "BC":
        s, e = at[n]
        depth = s - len(parts[0])  # the chunks before it: A (15 tokens), then B (11)
        assert got[n].dtype == torch.float32 and got[n].shape == (e - s,)
        torch.testing.assert_close(got[n], passes[0][s:e].float() * at_ref(depth))
        torch.testing.assert_close(got[n], fresh[s:e].float() * at_ref(depth))
        assert got[n].abs().sum() > 0  # away from home the reused KV is wrong: a real measurement, not zeros


def test_all_stored_runs_no_pass_and_scores_from_the_store(blender, parts, passes):
    blender.blend(*order(parts, "ABC"), selector="mix", ratio=RHO, **STORED)  # stores B, C
    blender.blend(*order(parts, "BAC"), selector="mix", ratio=RHO, **STORED)  # stores A (B at home)
    assert len(passes) == 2
    kept = stored(blender, parts)
    del passes[:]
    res = blender.blend(*order(parts, "CBA"), selector="mix", ratio=RHO, **STORED)  # C at home now
    assert passes == []
    # the expected product: the stored slices where the chunks sit now, zeros for C (exact at home)
    at = spans(parts, "CBA")
    dev = torch.zeros(res.layout.n)
    for n in "AB":
        dev[slice(*at[n])] = kept[n] / at_ref(at[n][0] - len(parts[0]))  # at its depth here
    qa = measured(blender, parts, "CBA")["qa"]  # query attention does not depend on the deviation
    expected = product(qa, dev, res.layout)
    torch.testing.assert_close(res.scores, expected.float(), rtol=1e-5, atol=1e-7)
    assert float(res.scores[slice(*at["C"])].abs().sum()) == 0.0
    # and it differs from the deviation measured in this order (C's is not stored as zero elsewhere: B's, A's are
    # from other contexts)
    assert not torch.allclose(dev, measured(blender, parts, "CBA")["dev"])


def test_a_chunk_without_one_runs_the_pass_and_the_away_chunks_average_its_measurement(blender, parts, passes):
    blender.blend(*order(parts, "ABC"), selector="mix", ratio=RHO, **STORED)  # stores B, C
    before = stored(blender, parts)
    res = blender.blend(*order(parts, "BCA"), selector="mix", ratio=RHO, **STORED)  # A away and missing
    assert len(passes) == 2
    after, at = stored(blender, parts), spans(parts, "BCA")
    here = {n: passes[1][slice(*at[n])].float() * at_ref(at[n][0] - len(parts[0])) for n in "CA"}
    torch.testing.assert_close(after["A"], here["A"])  # its first measurement
    torch.testing.assert_close(after["C"], (before["C"] + here["C"]) / 2)  # the mean of its two, each at DEPTH_REF
    assert torch.equal(after["B"], before["B"])  # at home here: nothing measured for it
    assert [counts(blender, parts)[n] for n in "ABC"] == [1, 1, 2]
    # the request that measured used its own measurement, not a mix of stored and fresh
    ref = blender.blend(*order(parts, "BCA"), selector="mix", ratio=RHO)
    torch.testing.assert_close(res.scores, ref.scores)
    assert torch.equal(res.recomputed, ref.recomputed)


def test_stored_in_the_same_order_selects_as_measured(blender, parts, passes):
    blender.blend(*order(parts, "ABC"), selector="mix", ratio=RHO, **STORED)
    seen = measured(blender, parts, "ABC")
    home = slice(*spans(parts, "ABC")["A"])
    fresh = seen["dev"].clone()
    assert fresh[home].max() < 1e-4 * fresh.max()  # measured at home: zero up to float rounding
    fresh[home] = 0
    for ratio in (0.1, RHO, 0.5):
        del passes[:]
        ours = blender.blend(*order(parts, "ABC"), selector="mix", ratio=ratio, **STORED)
        assert passes == []
        theirs = blender.blend(*order(parts, "ABC"), selector="mix", ratio=ratio)
        assert len(passes) == 1
        assert torch.equal(ours.recomputed, theirs.recomputed)
        assert torch.equal(ours.logits, theirs.logits)
        # the scores are the measured ones but for the home chunk's rounding residue, which the store holds as 0
        torch.testing.assert_close(ours.scores, product(seen["qa"], fresh, ours.layout).float(), rtol=1e-5, atol=1e-7)


def test_the_deviation_reaches_the_store(model_dir, parts, passes, tmp_path):
    """Kept through store.add_features: a second blender on the same disk tier reads it and runs no pass."""
    from chunkcache.store import ChunkStore

    first = ReferenceBlender.from_pretrained(model_dir, store=ChunkStore(disk_dir=str(tmp_path)))
    first.blend(*order(parts, "ABC"), selector="mix", ratio=RHO, **STORED)
    first.blend(*order(parts, "BAC"), selector="mix", ratio=RHO, **STORED)
    second = ReferenceBlender.from_pretrained(model_dir, store=ChunkStore(disk_dir=str(tmp_path)))
    del passes[:]
    second.blend(*order(parts, "CAB"), selector="mix", ratio=RHO, **STORED)
    assert passes == []
    assert all(v is not None for v in stored(second, parts).values())


def test_an_averaged_deviation_reaches_the_store(model_dir, parts, passes, tmp_path):
    """A remembered deviation a later pass refines is written through again, not only kept in memory."""
    from chunkcache.store import ChunkStore

    first = ReferenceBlender.from_pretrained(model_dir, store=ChunkStore(disk_dir=str(tmp_path)))
    first.blend(*order(parts, "ABC"), selector="mix", ratio=RHO, **STORED)
    first.blend(*order(parts, "BCA"), selector="mix", ratio=RHO, **STORED)  # C averaged with its second measurement
    second = ReferenceBlender.from_pretrained(model_dir, store=ChunkStore(host_bytes=0, disk_dir=str(tmp_path)))
    assert counts(second, parts) == {"A": 1, "B": 1, "C": 2}
    torch.testing.assert_close(stored(second, parts)["C"], stored(first, parts)["C"])


def test_the_eval_harness_warms_in_other_orders(blender, parts, passes):
    """chunkbench's measured blend reads deviations stored in other orders (the same order would store exactly what
    it then reads), and runs no pass of its own."""
    from chunkbench.quality.reference_path import blend

    res = blend(blender, order(parts, "ABC"), "mix", RHO, ESTIMATED)
    assert passes == []  # the warm-up orders' deviations measured after each blend (DeviationJob), not in it
    res = blend(blender, order(parts, "ABC"), "mix", RHO, STORED)
    assert len(passes) == 0  # every chunk remembers one since the first call
    blender = ReferenceBlender.from_pretrained(blender.model_dir)
    res = blend(blender, order(parts, "ABC"), "mix", RHO, STORED)
    assert len(passes) == 2  # the two warm-up orders (reversed: C at home; rotated: C away and missing), not the last
    assert res.passes == ("query_attention",)
    again = blender.blend(*order(parts, "ABC"), selector="mix", ratio=RHO, **STORED)
    assert torch.equal(res.recomputed, again.recomputed)
    fresh, at, kept = measured(blender, parts, "ABC")["dev"], spans(parts, "ABC"), stored(blender, parts)
    for n in "BC":
        assert not torch.allclose(kept[n], fresh[slice(*at[n])])
    prefix, chunks, query = parts
    with pytest.raises(RuntimeError, match="no stored deviation"):  # two chunks have no other order
        blend(blender, (prefix, [chunks["A"], chunks["B"][:5]], query), "mix", RHO, STORED)


def test_a_first_reuse_estimates_and_the_deviation_is_measured_after_it(blender, parts, passes):
    """No deviation pass in any request: the first blend reads an estimate (no chunk remembers one: 1 at DEPTH_REF,
    at each chunk's depth, falling with each token's offset in its chunk), and its deviation is measured after it,
    equal to what the request's own pass measures in that order."""
    first = blender.blend(*order(parts, "ABC"), selector="mix", ratio=RHO, **ESTIMATED)
    assert passes == [] and first.passes == ("query_attention",)
    seen = measured(blender, parts, "ABC")
    ctx = first.layout.context_mask().double()
    home = slice(*spans(parts, "ABC")["A"])
    estimate = ctx.clone()
    estimate[home] = 0  # A at home: exact, no deviation
    for n in "BC":
        s, e = spans(parts, "ABC")[n]
        estimate[s:e] = shaped(e - s) / at_ref(s - len(parts[0]))
    torch.testing.assert_close(first.scores, product(seen["qa"], estimate, first.layout).float(), rtol=1e-5,
                               atol=1e-7)
    at, got = spans(parts, "ABC"), stored(blender, parts)
    assert got["A"] is None
    for n in "BC":
        s, e = at[n]
        torch.testing.assert_close(got[n], seen["dev"][s:e].float() * at_ref(s - len(parts[0])), rtol=1e-4,
                                   atol=1e-5)


def test_a_chunk_without_one_reads_the_remembered_chunks_level(blender, parts, passes):
    """B, C remember theirs; in BCA, A is away and has none: it reads C's mean level at A's depth (B is at home),
    shaped by offset, and is measured after the request."""
    blender.blend(*order(parts, "ABC"), selector="mix", ratio=RHO, **ESTIMATED)
    kept = stored(blender, parts)
    res = blender.blend(*order(parts, "BCA"), selector="mix", ratio=RHO, **ESTIMATED)
    assert passes == []
    at = spans(parts, "BCA")
    dev = torch.zeros(res.layout.n)
    depth = {n: at[n][0] - len(parts[0]) for n in "CA"}
    dev[slice(*at["C"])] = kept["C"] / at_ref(depth["C"])
    dev[slice(*at["A"])] = float(kept["C"].mean()) / at_ref(depth["A"]) * shaped(at["A"][1] - at["A"][0])
    qa = measured(blender, parts, "BCA")["qa"]
    torch.testing.assert_close(res.scores, product(qa, dev, res.layout).float(), rtol=1e-5, atol=1e-7)
    assert counts(blender, parts) == {"A": 1, "B": 1, "C": 2}  # measured after it: A's first, C's second


# ---- a batch of requests (the server's case), on a stand-in engine --------------------------------------------------

class BatchEngine:
    """Zero KV for computed chunks; request i's deviation pass measures i + 1 on every context token."""

    fingerprint, entry_shape, n_layers = "f" * 32, (2, 1, 4), 2

    def __init__(self, plans):
        self.plans, self.deviation_passes = plans, []
        self.models = None

    def fill(self, chunks):
        from chunkcache.store import ChunkEntry

        out = []
        for i, c in chunks:
            ids = self.plans[i].chunk_ids(c)
            kv = torch.zeros(2, len(ids), 1, 4)
            out.append(ChunkEntry(c.key, ids, kv, kv.clone(), self.plans[i].shared_prefix_len, self.fingerprint))
        return out

    def copy(self, entries):
        pass

    def kv_deviation(self, requests, layer, which):
        self.deviation_passes.append(list(requests))
        return [(i + 1.0) * self.plans[i].layout().context_mask().float() for i in requests]

    def recompute(self, tokens):
        return None


@dataclass
class Known:
    name: ClassVar[str] = "known"
    needs: ClassVar[tuple] = (("known_deviation", (1, "k")),)
    seen: ClassVar[list] = []

    def select(self, layout, ratio, features) -> Selection:
        Known.seen.append(features.known_deviation(1, "k"))
        return finish(layout, torch.zeros(0, dtype=torch.long), None)


def test_a_batch_measures_once_and_each_measured_request_keeps_its_own():
    from chunkcache.blend import pipeline
    from chunkcache.blend.plan import plan_request
    from chunkcache.store import ChunkStore

    ids = torch.arange(3, 15)
    store = ChunkStore()

    def run(plans):
        Known.seen.clear()
        engine = BatchEngine(plans)
        pipeline.run(engine, store, plans, lambda _: Known())
        return engine.deviation_passes, list(Known.seen)

    # x and z at home (right after the 2-token prefix), y away in both; y has none stored: both requests measure
    plans = [plan_request(ids, [(2, 5), (5, 8)], ["x", "y"], 0, "known", 0.1, shared_prefix_len=2, context="p"),
             plan_request(ids, [(2, 5), (5, 8)], ["z", "y"], 0, "known", 0.1, shared_prefix_len=2, context="p")]
    passes, seen = run(plans)
    assert passes == [[0, 1]]  # one pass for the batch
    ctx = plans[0].layout().context_mask().float()
    torch.testing.assert_close(seen[0], 1.0 * ctx)
    torch.testing.assert_close(seen[1], 2.0 * ctx)  # its own, not request 0's that y stored meanwhile
    # the mean of both measurements (1 and 2), 3 positions from home (after the 2-token prefix and x), as it would
    # be DEPTH_REF away
    torch.testing.assert_close(store.get("y").features[deviation_feature(1, "k")], torch.full((3,), 1.5 * at_ref(3)))
    assert all(deviation_feature(1, "k") not in store.get(k).features for k in "xz")
    # again, y now stored: no pass, the stored deviation where y sits and zeros for the chunk at home
    passes, seen = run([plan_request(ids, [(2, 5), (5, 8)], ["z", "y"], 0, "known", 0.1, shared_prefix_len=2,
                                     context="p")])
    assert passes == []
    torch.testing.assert_close(seen[0], torch.tensor([0.0] * 5 + [1.5] * 3 + [0.0] * 4))
    # y twice as deep (after a 6-token chunk at home): no pass, and y reads 2 ** DEPTH_EXPONENT its measurements
    deeper = torch.cat([ids[:2], torch.arange(20, 26), ids[5:8], ids[8:]])  # prefix, u (6 tokens), y, the query
    passes, seen = run([plan_request(deeper, [(2, 8), (8, 11)], ["u", "y"], 0, "known", 0.1, shared_prefix_len=2,
                                     context="p")])
    assert passes == []
    torch.testing.assert_close(seen[0][8:11], torch.full((3,), 1.5 * 2.0 ** DEPTH_EXPONENT))


def test_a_remembered_deviation_averages_at_most_a_few_measurements():
    """Each refinement rewrites the entry in every tier: past DEVIATION_MEASUREMENTS a pass leaves it alone."""
    from chunkcache.blend import pipeline
    from chunkcache.blend.plan import plan_request
    from chunkcache.store import ChunkStore

    store, ids = ChunkStore(), torch.arange(3, 18)
    for i in range(DEVIATION_MEASUREMENTS + 2):  # x at home, a new chunk away (so the pass runs), y away after it
        plan = plan_request(ids, [(2, 5), (5, 8), (8, 11)], ["x", f"new{i}", "y"], 0, "known", 0.1,
                            shared_prefix_len=2, context="p")
        pipeline.run(BatchEngine([plan]), store, [plan], lambda _: Known())
        kept = store.get("y").features
        assert int(kept[f"{deviation_feature(1, 'k')}/n"]) == min(i + 1, DEVIATION_MEASUREMENTS)
        if i == DEVIATION_MEASUREMENTS - 1:
            full = kept[deviation_feature(1, "k")]
    assert kept[deviation_feature(1, "k")] is full  # not replaced, so not written again


def test_the_depth_study_recovers_a_power_law_by_hand():
    """chunkbench.studies.deviation_depth's fit, on chunks whose deviation is exactly c * depth ** 0.4 (c per chunk)."""
    import itertools
    import math

    from chunkbench.studies.deviation_depth import fit

    pairs = []
    for c, depths in ((1.0, (10, 40, 90)), (7.5, (3, 300)), (0.2, (50, 51, 900))):
        at = [(d, c * d ** 0.4) for d in depths]
        pairs += [(math.log(d1 / d2), math.log(m1 / m2)) for (d1, m1), (d2, m2) in itertools.combinations(at, 2)]
    slope, r = fit(pairs)
    assert slope == pytest.approx(0.4) and r == pytest.approx(1.0)
    # noise -0.1, +0.1, -0.1, +0.1 on x = -2, -1, 1, 2: slope -0.5 + sum(x * noise) / sum(x * x) = -0.5 + 0.2 / 10
    slope, r = fit([(x, -0.5 * x + (0.1 if i % 2 else -0.1)) for i, x in enumerate((-2.0, -1.0, 1.0, 2.0))])
    assert slope == pytest.approx(-0.48) and -1 < r < -0.9
