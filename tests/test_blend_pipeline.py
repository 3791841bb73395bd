"""chunkcache.blend with stand-ins for the engine and the selector: the plan is pure, the pipeline's steps run in
order, a chunk missing from several requests is computed once, and what a selector grows goes back to the store."""

import doctest
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from chunkcache.blend import pipeline, plan
from chunkcache.blend.auto import AutoChunks, Detected, Form, Segments
from chunkcache.blend.features import Models
from chunkcache.blend.plan import Placement, plan_request, recompute_set, to_compute
from chunkcache.blend.request import STAGES, ChunkRequest, RequestHint
from chunkcache.config import AutoConfig
from chunkcache.hashing import entry_key, prefix_key, tenant_key
from chunkcache.select.base import Layout, Selection, finish
from chunkcache.store import ChunkEntry, ChunkStore

FP = "f" * 32
SHAPE = (2, 1, 4)  # layers, KV heads, head dim


def test_plan_doctest():
    assert doctest.testmod(plan).failed == 0


def test_exact_prefix_into_a_chunk_keeps_its_head():
    p = plan_request(torch.arange(20), [(4, 8), (8, 12), (14, 17)], ["a", "b", "c"], matched=9, selector="epic",
                     ratio=0.5)
    assert p.chunks == (Placement("b", (9, 12), 1), Placement("c", (14, 17), 0))
    assert (p.shared_prefix_len, p.start, p.query) == (4, 9, 17)
    layout = p.layout()
    assert layout.prefix_len == 9 and layout.chunk_spans == ((9, 12), (14, 17)) and layout.query_span == (17, 20)
    assert p.chunks[0].chunk == (8, 12) and p.chunk_ids(p.chunks[0]).tolist() == [8, 9, 10, 11]
    # what holds KV before anything is computed: the exact prefix and the chunks, not the hole 12-13 or the query
    assert layout.held().tolist() == [*range(12), 14, 15, 16]


def test_exact_prefix_past_every_chunk_blends_nothing():
    p = plan_request(torch.arange(10), [(2, 4)], ["a"], matched=6, selector="none", ratio=0.1)
    assert not p.blends and p.start == 6
    without = plan_request(torch.arange(10), [], [], matched=0, selector="none", ratio=0.1, shared_prefix_len=3)
    assert without.start == 3 and without.layout().query_span == (3, 10)
    with pytest.raises(ValueError, match="shared prefix"):
        plan_request(torch.arange(10), [], [], matched=0, selector="none", ratio=0.1)


def test_missing_chunks_are_computed_once_per_batch():
    a = plan_request(torch.arange(10), [(1, 3), (3, 5)], ["x", "y"], 0, "none", 0.1)
    b = plan_request(torch.arange(10), [(1, 3), (3, 6)], ["y", "z"], 0, "none", 0.1)
    assert [(i, c.key) for i, c in to_compute([a, b], {"x"})] == [(0, "y"), (1, "z")]


def test_recompute_set_is_the_union_with_the_forced_tokens():
    layout = Layout(torch.arange(10), 2, ((2, 5), (6, 8)), (8, 10))
    assert recompute_set(layout, torch.tensor([3])).tolist() == [3, 5, 8, 9]
    with pytest.raises(ValueError, match="outside the prompt"):
        recompute_set(layout, torch.tensor([10]))


def entry(key, ids, start_pos):
    n = len(ids)
    return ChunkEntry(key, torch.as_tensor(ids), torch.zeros(SHAPE[0], n, *SHAPE[1:]),
                      torch.zeros(SHAPE[0], n, *SHAPE[1:]), start_pos, FP)


class FakeEngine:
    """Records the steps; computes chunks as zero KV, features as constants."""

    fingerprint, entry_shape, n_layers = FP, SHAPE, SHAPE[0]

    def __init__(self, plans):
        self.plans, self.steps = plans, []
        self.models = Models("unused", lambda *a: pytest.fail("no draft here"))

    def fill(self, chunks):
        self.steps.append(("fill", [c.key for _, c in chunks]))
        return [entry(c.key, self.plans[i].chunk_ids(c), self.plans[i].shared_prefix_len) for i, c in chunks]

    def copy(self, entries):
        self.steps.append(("copy", [[e.key for e in es] for es in entries]))

    def query_attention(self, requests):
        self.steps.append(("query_attention", list(requests)))
        return [torch.ones(self.plans[i].n) for i in requests]

    def kv_deviation(self, requests, layer, which):
        raise AssertionError("not asked for")

    def recompute(self, tokens):
        self.steps.append(("recompute", [t.tolist() for t in tokens]))
        return "logits"


@dataclass
class GrowsFeatures:
    """Asks for the batched query attention and keeps a per-chunk feature, like CacheClip's auxiliary KV."""

    name: ClassVar[str] = "grows"
    needs: ClassVar[tuple] = (("query_attention", ()),)

    def select(self, layout, ratio, features) -> Selection:
        assert features.query_attention().shape == (layout.n,)
        features.chunk_features(0).setdefault("grows:kv", torch.zeros(1))
        return finish(layout, torch.tensor([layout.chunk_spans[0][0]]), None)


class CountingStore(ChunkStore):
    def __init__(self):
        super().__init__(model_fingerprint=FP)
        self.puts = []

    def put(self, e):
        self.puts.append(("put", e.key))
        return super().put(e)

    def add_features(self, key, features):
        self.puts.append(("add_features", key, sorted(features)))
        return super().add_features(key, features)


def test_pipeline_runs_the_steps_in_order():
    ids = torch.arange(3, 15)
    store = CountingStore()
    store.put(entry("x", ids[2:4], 2))
    store.puts.clear()
    plans = [plan_request(ids, [(2, 4), (4, 6)], ["x", "y"], 0, "grows", 0.1, context="p"),
             plan_request(ids, [(2, 4), (4, 7)], ["y", "z"], 3, "grows", 0.1)]
    # keys are plain labels here: the pipeline trusts them (real keys hash the chunk's tokens); the second request's
    # keys name no context its fill computes them after (automatic detection's): what it computes is not stored
    engine = FakeEngine(plans)
    run = pipeline.run(engine, store, plans, lambda name: GrowsFeatures())
    assert [s[0] for s in engine.steps] == ["fill", "copy", "query_attention", "recompute"]
    assert engine.steps[0] == ("fill", ["y", "z"])
    assert engine.steps[1] == ("copy", [["x", "y"], ["y", "z"]])
    assert engine.steps[2] == ("query_attention", [0, 1])  # one pass for the batch
    assert run.output == "logits"
    assert [b.hits for b in run.requests] == [1, 0]
    assert run.requests[0].recomputed.tolist() == [2, 6, 7, 8, 9, 10, 11]
    assert run.requests[1].recomputed.tolist() == [3, 7, 8, 9, 10, 11]
    assert run.requests[0].reused_tokens == 3 and run.requests[1].reused_tokens == 3
    # learn: the computed chunk its key names the context of, then the features selectors kept (request 0's "x",
    # request 1's "y")
    assert store.puts == [("put", "y"), ("add_features", "x", ["grows:kv"]),
                          ("add_features", "y", ["grows:kv"])]
    assert set(run.seconds) == set(STAGES)


def test_an_entry_holding_other_tokens_is_a_miss():
    ids = torch.arange(3, 15)
    store = CountingStore()
    store.put(entry("x", [1, 1], 2))
    plans = [plan_request(ids, [(2, 4)], ["x"], 0, "grows", 0.1, context="p")]
    engine = FakeEngine(plans)
    run = pipeline.run(engine, store, plans, lambda name: GrowsFeatures())
    assert engine.steps[0] == ("fill", ["x"]) and run.requests[0].hits == 0
    assert store.get("x").token_ids.tolist() == ids[2:4].tolist()  # replaced by the computed chunk


# ---- the request's lifecycle around the batch's blend ----------------------------------------------------------------


class ThreeSegments:
    """AutoChunks' contract as a stand-in: segments (2, 4), (4, 6), (6, 8) of the prompt are "a", "b", "c"; a
    prompt blends when two of them are stored; every segment computed and not stored is learned."""

    def detect(self, segments, n, matched, stored):
        picked = [(span, key) for span, key in zip(segments.spans, segments.keys)
                  if key in stored and span[0] >= matched]
        if len(picked) < 2:
            return None
        spans = tuple(s for s, _ in picked)
        return Detected(spans, tuple(k for _, k in picked), sum(e - s for s, e in spans))


SEGMENTS = Segments(((2, 4), (4, 6), (6, 8)), ("a", "b", "c"), (2, 2, 2), ("x", "x", "x"), "t",
                    (Form(0, 0, (2, 4), "a"), Form(1, 0, (4, 6), "b"), Form(2, 0, (6, 8), "c")))
DEFAULTS = pipeline.Defaults("grows", 0.1, "ns")


class AskedStore(CountingStore):
    """Records every key the store is asked for."""

    def lookup(self, keys, costs=None):
        self.puts.append(("lookup", sorted(keys)))
        return super().lookup(keys, costs)


def test_detection_fetches_once_and_the_blend_reuses_its_entries():
    ids = torch.arange(3, 15)
    store = AskedStore()
    store.put(entry("a", ids[2:4], 2))
    store.put(entry("c", ids[6:8], 6))
    store.puts.clear()
    found = pipeline.detect(store, ThreeSegments(), ids, SEGMENTS, 0, DEFAULTS)
    assert found.hint.spans == ((2, 4), (6, 8)) and found.hint.auto and found.hint.selector == "grows"
    assert set(found.found.entries) == {"a", "c"} and found.looked_up == 3
    request = ChunkRequest("r", hint=found.hint, detection=found)
    plans = [request.plan(0)]
    assert request.plan(0) is plans[0]  # built once per radix match
    run = pipeline.run(FakeEngine(plans), store, plans, lambda name: GrowsFeatures(),
                       prefetched=[request.prefetched()])
    assert [p for p in store.puts if p[0] == "lookup"] == [("lookup", ["a", "b", "c"])]  # detection's only
    assert run.requests[0].hits == 2 and request.prefetched() is None  # handed over once


def test_too_few_stored_segments_detect_no_hint():
    ids = torch.arange(3, 15)
    store = ChunkStore(model_fingerprint=FP)
    store.put(entry("b", ids[4:6], 4))
    found = pipeline.detect(store, ThreeSegments(), ids, SEGMENTS, 0, DEFAULTS)
    assert found.hint is None and found.found.entries == {}


def test_a_prompt_teaches_by_naming_paragraphs_each_stored_from_its_own_forward():
    """to_encode names the paragraphs holding segments no tier holds (once per prompt, none for a request that may
    not teach); store_encode stores each segment from one forward of exactly its head and paragraph, with the
    tenant and context its key names."""
    auto = AutoChunks(AutoConfig(enabled=True, segment_min_tokens=8, segment_mean_tokens=1 << 20), frozenset({0}), FP,
                      head=[1])
    ids = torch.tensor([0] + list(range(10, 20)) + [0] + list(range(30, 40)) + [0, 99])
    segments = auto.segments(ids, "ns", None)
    assert segments.spans == ((1, 11), (12, 22))
    store = ChunkStore(model_fingerprint=FP)
    kv = torch.arange(SHAPE[0] * 11 * SHAPE[1] * SHAPE[2], dtype=torch.float32).view(SHAPE[0], 11, *SHAPE[1:])
    forwards = []

    def kv_of(token_ids):
        forwards.append(token_ids.tolist())
        return kv[:, : len(token_ids)], -kv[:, : len(token_ids)]

    request = ChunkRequest("r", segments=segments)
    store.put(ChunkEntry(segments.keys[0], ids[1:11], kv[:, 1:], -kv[:, 1:], 1, FP, tenant=segments.tenant,
                         context=segments.contexts[0]))
    encodes = pipeline.to_encode(store, auto, request, ids)
    assert request.segments is None and pipeline.to_encode(store, auto, request, ids) == []  # once per prompt
    assert [pipeline.store_encode(store, e, kv_of(e.token_ids), FP)["segments"] for e in encodes] == [1]
    assert forwards == [[1] + list(range(30, 40))]  # the head, then the second paragraph alone
    b = store.get(segments.keys[1])
    assert b.start_pos == 1 and b.token_ids.tolist() == list(range(30, 40))
    assert (b.tenant, b.context) == (segments.tenant, segments.contexts[1])
    torch.testing.assert_close(b.k, kv[:, 1:11])
    torch.testing.assert_close(b.v, -kv[:, 1:11])
    quiet = ChunkRequest("q", segments=auto.segments(ids, "other", None), learn=False)
    assert pipeline.to_encode(ChunkStore(model_fingerprint=FP), auto, quiet, ids) == []  # learn: false


def test_the_store_refuses_an_entry_that_is_not_what_its_key_names():
    store = ChunkStore(model_fingerprint=FP)
    good = entry_key(FP, tenant_key("ns"), prefix_key([1, 2]), [5, 6])
    kv = torch.zeros(SHAPE[0], 2, *SHAPE[1:])
    assert store.put(ChunkEntry(good, torch.tensor([5, 6]), kv, kv, 2, FP, tenant=tenant_key("ns"),
                                context=prefix_key([1, 2])))
    for tenant, context in ((tenant_key("other"), prefix_key([1, 2])), (tenant_key("ns"), prefix_key([9, 2]))):
        with pytest.raises(ValueError, match="not what its tenant, context and tokens name"):
            store.put(ChunkEntry(good, torch.tensor([5, 6]), kv, kv, 2, FP, tenant=tenant, context=context))


def test_a_round_record_has_every_stage_and_the_request_report_merges_rounds():
    ids = torch.arange(3, 15)
    store = ChunkStore(model_fingerprint=FP)
    request = ChunkRequest("r", hint=RequestHint(ids, ((2, 4), (4, 6)), ("x", "y"), "grows", 0.1, "ns"), charged=7)
    plans = [request.plan(0)]
    run = pipeline.run(FakeEngine(plans), store, plans, lambda name: GrowsFeatures())
    info = pipeline.record(request, run.requests[0], stages=run.seconds, blend_s=0.5)
    assert list(info["stages_s"]) == list(STAGES) and info["admitted_compute"] == 7
    assert (info["chunk_hits"], info["chunk_misses"], info["reused_tokens"]) == (0, 2, 3)
    assert info["attended_pairs"] == sum(i + 1 for i in run.requests[0].recomputed.tolist())
    assert "auto" not in info and request.report is None
    request.add_round({"fallback": "partial_prefill", "detail": "d"})
    request.add_round(info)
    merged = request.report
    assert merged["rounds"] == [{"fallback": "partial_prefill", "detail": "d"}, info]
    assert merged["fallback"] == "partial_prefill" and merged["chunk_hits"] == 0
