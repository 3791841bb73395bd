"""SGLang glue of the request contract and observability, hook functions driven with small stand-in objects
(the live path is covered by tests/test_hints_serving.py)."""

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry
from sglang.srt.managers.kv_hints import decode_kv_hints_envelope
from sglang.srt.managers.tokenizer_manager import TokenizerManager

from chunkcache.blend.request import ChunkRequest
from chunkcache.hints import ACTION_TYPE, HintError
from chunkcache.store import ChunkEntry, ChunkStore
from sglang_patch.http import hint_validation
from sglang_patch.scheduler import metrics, report, request_hint


def envelope(payload, other=True):
    actions = [{"action_id": "c", "action_type": ACTION_TYPE, "action_version": "1", "payload": payload}]
    if other:  # someone else's action, which must pass through untouched
        actions.insert(0, {"action_id": "o", "action_type": "router.pin", "action_version": "3", "payload": {"k": 1}})
    return decode_kv_hints_envelope({"protocol_version": "1", "message_id": "m", "actions": actions})


class Tokenizer:
    """"Hello world.\\n\\nDoc two?" -> 7 tokens, as a fast tokenizer reports them."""

    is_fast = True
    ids = [10, 11, 12, 13, 14, 15, 16]
    offsets = [(0, 5), (5, 11), (11, 12), (12, 14), (14, 17), (17, 21), (21, 22)]

    def __call__(self, text, return_offsets_mapping):
        assert text == TEXT and return_offsets_mapping
        return {"input_ids": list(self.ids), "offset_mapping": list(self.offsets)}


TEXT = "Hello world.\n\nDoc two?"
MANAGER = SimpleNamespace(tokenizer=Tokenizer())
TEXT_REQ = SimpleNamespace(input_ids=None, input_embeds=None)
IDS_REQ = SimpleNamespace(input_ids=Tokenizer.ids, input_embeds=None)


def check(kv_hints, obj, text=None, ids=Tokenizer.ids):
    tokenized = SimpleNamespace(kv_hints=kv_hints)
    hint_validation.check_request(tokenized, MANAGER, obj, text, ids, None, None, None)
    return tokenized.kv_hints


# --- hint_validation --------------------------------------------------------------------------------------------------

def test_reserved_extra_key_is_refused_on_any_request():
    """No request may name a hinted request's radix partition, or it would read that request's approximate KV: the
    partition starts with a reserved prefix that no request may send as its extra_key."""
    forged = request_hint.radix_partition("tenant-a", None)
    for kv_hints in (None, envelope({"token_spans": [[0, 2]]})):
        tokenized = SimpleNamespace(kv_hints=kv_hints, extra_key=forged)
        with pytest.raises(ValueError, match="extra_key: values starting with .* are reserved"):
            hint_validation.check_request(tokenized, MANAGER, IDS_REQ, None, Tokenizer.ids)
    plain = SimpleNamespace(kv_hints=None, extra_key="chunkcache::")  # no reserved prefix: an ordinary extra_key
    hint_validation.check_request(plain, MANAGER, IDS_REQ, None, Tokenizer.ids)


def test_radix_partition_is_unambiguous():
    """Distinct (namespace, extra_key) pairs get distinct partitions, including namespace "x:y" against namespace "x"
    with extra_key "y:", which a plain f"chunkcache:{ns}:{key}" would merge."""
    parts = {request_hint.radix_partition(ns, key) for ns, key in [
        ("x:y", None), ("x", "y:"), ("x", "y"), ("x\x1f1", None), ("x", "\x1f1"), (None, None), ("", "x")]}
    assert len(parts) == 7
    assert request_hint.radix_partition("kb", "user").endswith("user")  # SGLang reads a LoRA id from the end


def test_too_many_spans_is_a_hint_error():
    """The span count is bounded (limits.max_spans): hundreds of one-token spans would stall the scheduler."""
    ids = list(range(200))
    spans = [[i, i + 1] for i in range(1, 100)]
    with pytest.raises(HintError, match=r"token_spans has 99 spans; at most 64 per request \(server limits.max_spans\)"):
        check(envelope({"token_spans": spans}), IDS_REQ, ids=ids)
    assert check(envelope({"token_spans": spans[:64]}), IDS_REQ, ids=ids) is not None


class Reuse:
    """ChunkReuse as a stand-in: a hint is the payload's spans (nothing hashed), a span past the prompt malformed."""

    store = SimpleNamespace(stats=lambda: None)
    auto = None  # automatic chunk detection off
    config = SimpleNamespace(select=SimpleNamespace(selector="mix"))  # the server's default selector

    @staticmethod
    def hint(payload, token_ids, cache_salt=None):
        if max(e for _, e in payload["token_spans"]) >= len(token_ids):
            raise HintError("span past the prompt")
        return SimpleNamespace(spans=payload["token_spans"], prompt=list(token_ids))


def test_hint_is_resolved_once_at_creation_and_kept():
    req = SimpleNamespace(kv_hints=envelope({"token_spans": [[0, 2]], "namespace": "kb"}), origin_input_ids=[5, 6, 7],
                          extra_key=None, cache_salt=None, to_finish=None)
    request_hint.attach(Reuse(), None, req)
    hint = request_hint.of(req)
    assert hint.spans == [[0, 2]] and hint.prompt == [5, 6, 7]
    assert req.extra_key == request_hint.radix_partition("kb", None)
    plain = SimpleNamespace(kv_hints=None, extra_key="user", to_finish=None)
    request_hint.attach(Reuse(), None, plain)
    assert request_hint.of(plain) is None and plain.extra_key == "user"


@pytest.mark.parametrize("payload, default, why", [
    ({"exact": True}, "mix", "exact"),
    ({"token_spans": [[0, 2]], "exact": True}, "mix", "exact"),
    ({"token_spans": [[0, 2]], "selector": "full"}, "mix", "selector_full"),
    ({"token_spans": [[0, 2]]}, "full", "selector_full"),
])
def test_a_request_asking_for_exact_kv_gets_no_hint_and_keeps_its_partition(payload, default, why):
    """No hint: admission and the forward treat it as plain (SGLang's own prefill); its own partition: the radix
    tree can serve it only exact KV."""
    reuse = Reuse()
    reuse.config = SimpleNamespace(select=SimpleNamespace(selector=default))
    req = SimpleNamespace(kv_hints=envelope(payload), origin_input_ids=[5, 6, 7], extra_key="user", cache_salt=None,
                          to_finish=None)
    request_hint.attach(reuse, None, req)
    assert request_hint.of(req) is None and req.extra_key == "user"
    assert request_hint.exact(req) == why


def test_malformed_hint_at_creation_is_a_bad_hint_round():
    """A hint the HTTP layer did not validate (an Engine-side bypass): the request is served in full, and says so."""
    req = SimpleNamespace(kv_hints=envelope({"token_spans": [[0, 9]]}), origin_input_ids=[5, 6, 7], extra_key=None,
                          cache_salt=None, to_finish=None)
    request_hint.attach(Reuse(), None, req)
    assert request_hint.of(req) is None
    assert request_hint.record(req).report == {"fallback": "bad_hint",
                                               "detail": "chunkcache hint: span past the prompt"}
    assert [k for k in vars(req) if k.startswith("chunkcache")] == [request_hint.ATTR]  # the one record on the Req


def test_aborted_request_is_not_blended():
    """SGLang replaces the prompt of a request it refuses (longer than the KV pool) by one token; it is not served, so
    it is neither blended nor a malformed hint."""
    req = SimpleNamespace(kv_hints=envelope({"token_spans": [[0, 2]]}), origin_input_ids=[5, 6, 7], extra_key=None,
                          cache_salt=None, to_finish=None)
    request_hint.attach(Reuse(), None, req)
    req.origin_input_ids, req.to_finish = [0], "abort"
    assert request_hint.of(req) is None


def test_request_without_our_action_is_untouched():
    assert check(None, IDS_REQ) is None
    other = decode_kv_hints_envelope({"protocol_version": "1", "message_id": "m", "actions": [
        {"action_id": "o", "action_type": "router.pin", "action_version": "3", "payload": {"token_spans": "junk"}}]})
    assert check(other, IDS_REQ) is other


def test_embedding_request_has_no_hints_to_check():
    tokenized = SimpleNamespace()  # TokenizedEmbeddingReqInput has no kv_hints field
    hint_validation.check_request(tokenized, MANAGER, IDS_REQ, None, [1, 2])


def test_token_spans_are_validated_and_canonicalised():
    original = envelope({"token_spans": [[0, 3], [4, 6]], "ratio": 1})
    out = check(original, IDS_REQ)
    assert out.actions[0] == original.actions[0]
    assert out.actions[1].payload == {"token_spans": [[0, 3], [4, 6]], "ratio": 1.0}
    assert original.actions[1].payload == {"token_spans": [[0, 3], [4, 6]], "ratio": 1}  # frozen, shared: not edited


def test_char_spans_become_token_spans_for_text_requests():
    original = envelope({"char_spans": [[0, 12], [14, 21]], "selector": "full"})
    out = check(original, TEXT_REQ, text=TEXT)
    assert out.actions[1].payload == {"token_spans": [[0, 3], [4, 6]], "selector": "full"}
    assert out.actions[1].action_id == "c" and out.message_id == "m"


def test_one_envelope_shared_by_a_batch():
    """A batch request with one kv_hints dict gives every sub-request the same envelope object."""
    shared = envelope({"token_spans": [[0, 2]]})
    first, second = check(shared, IDS_REQ), check(shared, IDS_REQ, ids=[1, 2, 3])
    assert first is not second and first.actions[1].payload == second.actions[1].payload == {"token_spans": [[0, 2]]}
    with pytest.raises(HintError, match="contains the last prompt token"):
        check(shared, IDS_REQ, ids=[1, 2])


@pytest.mark.parametrize("payload, obj, text, ids, message", [
    ({"token_spans": [[0, 7]]}, IDS_REQ, None, Tokenizer.ids, "contains the last prompt token (index 6)"),
    ({"char_spans": [[0, 5]]}, IDS_REQ, None, Tokenizer.ids, "char_spans is for a text request"),
    ({"token_spans": [[0, 2]]}, TEXT_REQ, TEXT, Tokenizer.ids, "token_spans is for an input_ids request"),
    ({"char_spans": [[0, 8]]}, TEXT_REQ, TEXT, Tokenizer.ids, "end offset 8 falls inside token 1"),
    ({"char_spans": [[0, 5]]}, TEXT_REQ, TEXT, [10, 11, 99], "not a plain tokenization of its text"),
    ({"token_spans": [[0, 1]]}, SimpleNamespace(input_ids=None, input_embeds=[[0.0]]), None, None,
     "not input_embeds"),
])
def test_bad_hints_raise(payload, obj, text, ids, message):
    with pytest.raises(HintError) as e:
        check(envelope(payload), obj, text=text, ids=ids)
    assert message in str(e.value)


def test_slow_tokenizer_cannot_map_char_spans():
    manager = SimpleNamespace(tokenizer=SimpleNamespace(is_fast=False))
    with pytest.raises(HintError, match="need a fast tokenizer"):
        hint_validation.check_request(SimpleNamespace(kv_hints=envelope({"char_spans": [[0, 5]]})), manager, TEXT_REQ,
                                 TEXT, Tokenizer.ids)


# --- report -----------------------------------------------------------------------------------------------------------

INFO = {"chunk_hits": 2, "chunk_misses": 1, "reused_tokens": 700, "recomputed_tokens": 120, "selector": "full",
        "ratio": 0.15, "select_s": 0.01, "blend_s": 0.2}


def reported(info: dict, **fields) -> SimpleNamespace:
    """A Req whose record holds one round, `info`."""
    request = ChunkRequest(rid="r")
    request.add_round(info)
    return SimpleNamespace(**fields, **{request_hint.ATTR: request})


def test_scheduler_side_attaches_the_report_as_request_level_info():
    req = reported(INFO, customized_info=None)
    report.attach(object(), req=req)
    assert req.customized_info == {"chunkcache": [INFO]}
    req = reported(INFO, customized_info={"x": [1]})
    report.attach(object(), req=req)
    assert req.customized_info == {"x": [1], "chunkcache": [INFO]}
    plain = SimpleNamespace(customized_info=None)  # a request the blend did not touch
    report.attach(object(), req=plain)
    assert plain.customized_info is None
    assert report.request_level(False, object(), "chunkcache") is True
    assert report.request_level(False, object(), "other") is None


def test_tokenizer_side_puts_the_dict_in_meta_info():
    """Driven through SGLang's own update_request_meta_info: the other keys keep its per-token accumulation."""
    manager = SimpleNamespace(_accumulate_request_meta_info=TokenizerManager._accumulate_request_meta_info)
    original = TokenizerManager.update_request_meta_info
    original = getattr(original, "__wrapped__", original)
    customized = {"chunkcache": [[INFO], []], "other": [[1, 2], [3]]}
    for index, expected in ((0, INFO), (1, None)):
        state = SimpleNamespace(customized_info_accumulated={}, customized_info_reported_keys=set())
        info = {}
        report.to_meta_info(original, manager, info, state, customized, index, None)
        assert info.get("chunkcache") == expected
        assert info["other"] == customized["other"][index]
        assert "chunkcache" not in state.customized_info_accumulated


# --- metrics ----------------------------------------------------------------------------------------------------------

MODEL = "served-model"  # the model_name label every series carries in these tests (--served-model-name)


@pytest.fixture
def registry():
    r = CollectorRegistry()
    metrics.start(True, model_name=MODEL, registry=r)
    yield r
    metrics.start(False)


def values(registry):
    """`registry`'s sample values by name and the labels after model_name."""
    return lambda name, labels=None: registry.get_sample_value(name, {"model_name": MODEL, **(labels or {})})


def stats(**fields):
    """A StoreStats snapshot: the given fields, the others zero (no remote tier)."""
    return SimpleNamespace(**{"memory_bytes": 0, "disk_bytes": 0, "evictions": 0, "corrupt": 0, "disk_full": 0,
                              "remote": None, **fields})


def test_dropped_entries_and_disk_full_are_series(registry):
    """Corrupt entries and disk-full refusals are /metrics series."""
    value = values(registry)
    assert value("chunkcache_store_corrupt_total") == 0 and value("chunkcache_store_disk_full_total") == 0
    metrics.set_store_stats(stats(corrupt=2, disk_full=1))
    metrics.set_store_stats(stats(corrupt=3, disk_full=1))
    assert value("chunkcache_store_corrupt_total") == 3 and value("chunkcache_store_disk_full_total") == 1


def test_cluster_nodes_are_series_of_their_own(registry):
    """Per node: up while its breaker is closed, counters from cumulative snapshots (a late older one adds nothing)."""
    from chunkcache.store.endpoint import NodeStats
    from chunkcache.store.remote import RemoteStats

    def remote(*nodes):
        return RemoteStats("redis+cluster://a:1", all(n.up for n in nodes), *[0] * 12, nodes=nodes)

    a, b = NodeStats("a:1", True, True, 5, 1, 0, 0, 0, 2), NodeStats("b:2", True, False, 3, 0, 4, 1, 7, 0)
    metrics.set_store_stats(stats(remote=remote(a, b)))
    metrics.set_store_stats(stats(remote=remote(NodeStats("a:1", True, True, 2, 1, 0, 0, 0, 2), b)))  # older: a no-op
    value = values(registry)
    assert value("chunkcache_remote_node_up", {"node": "a:1"}) == 1
    assert value("chunkcache_remote_node_up", {"node": "b:2"}) == 0
    assert value("chunkcache_remote_node_hits_total", {"node": "a:1"}) == 5
    assert value("chunkcache_remote_node_errors_total", {"node": "b:2"}) == 4
    assert value("chunkcache_remote_node_skipped_total", {"node": "b:2"}) == 7
    assert value("chunkcache_remote_up") == 0


def test_request_counters(registry):
    metrics.record_request(INFO)
    metrics.record_request({**INFO, "chunk_hits": 0, "chunk_misses": 3, "selector": "spec"})
    value = values(registry)
    assert value("chunkcache_chunk_hits_total") == 2
    assert value("chunkcache_chunk_misses_total") == 4
    assert value("chunkcache_reused_tokens_total") == 1400
    assert value("chunkcache_recomputed_tokens_total") == 240
    assert value("chunkcache_requests_total", {"selector": "spec"}) == 1
    assert value("chunkcache_select_seconds_count") == 2
    assert value("chunkcache_blend_seconds_sum") == pytest.approx(0.4)


def test_estimated_kl_counts_only_blends_with_an_estimate(registry):
    """A model without a fitted estimator reports `fidelity: {"fitted_for": null}`: the blend is counted, no KL."""
    metrics.record_request({**INFO, "fidelity": {"fitted_for": None}})
    metrics.record_request({**INFO, "fidelity": {"kl": 0.02, "agree": 0.9, "fitted_for": "m"}})
    value = values(registry)
    assert value("chunkcache_chunk_hits_total") == 4
    assert value("chunkcache_estimated_kl_count") == 1 and value("chunkcache_estimated_kl_sum") == 0.02


def test_store_and_fallback_metrics(registry):
    value = values(registry)
    assert value("chunkcache_store_bytes", {"tier": "host"}) == 0
    metrics.set_store_stats(stats(memory_bytes=100, disk_bytes=5, evictions=3))
    metrics.set_store_stats(stats(memory_bytes=80, disk_bytes=7, evictions=5))
    assert value("chunkcache_store_bytes", {"tier": "host"}) == 80
    assert value("chunkcache_store_bytes", {"tier": "disk"}) == 7
    assert value("chunkcache_evictions_total") == 5  # cumulative snapshots, counted once
    metrics.set_store_bytes("device", 64)
    assert value("chunkcache_store_bytes", {"tier": "device"}) == 64
    metrics.record_fallback("logprobs")
    metrics.record_fallback("logprobs")
    assert value("chunkcache_fallbacks_total", {"reason": "logprobs"}) == 2


def test_store_series_follow_the_store_without_a_request_report(registry):
    """The store reports its own changes (ChunkStore on_change, wired in sglang_patch.scheduler.cache), not the request
    reports: a put that evicts shows in /metrics before any request is reported."""
    def entry(i):
        return ChunkEntry(f"{i:032x}", torch.arange(4), torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2), 0, "f" * 32)

    store = ChunkStore(host_bytes=entry(0).nbytes, on_change=metrics.set_store_stats)
    value = values(registry)
    store.put(entry(0))
    assert value("chunkcache_store_bytes", {"tier": "host"}) == entry(0).nbytes
    old = store.stats()
    store.put(entry(1))
    assert value("chunkcache_evictions_total") == 1
    metrics.set_store_stats(old)  # a snapshot from another thread, arriving late
    store.put(entry(2))
    assert value("chunkcache_evictions_total") == 2


def samples(registry) -> dict:
    """Every chunkcache sample of `registry`: (name, labels after model_name) -> value."""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for m in registry.collect() for s in m.samples if s.name.startswith("chunkcache_")}


def test_every_series_carries_the_served_model_name(registry, monkeypatch):
    """Each chunkcache family, once recorded, has `model_name` first, the served model's name as SGLang's own series
    have it (the hook reads it where SGLang's collectors do: the serving config, resolved)."""
    from chunkcache.store.endpoint import NodeStats
    from chunkcache.store.link import LinkEstimate
    from chunkcache.store.remote import RemoteStats

    metrics.record_request({**INFO, "fidelity": {"kl": 0.01, "agree": 0.9, "fitted_for": "m"}})
    metrics.record_exact("exact")
    metrics.record_auto_lookup(2, 1, 0.01)
    metrics.record_auto_learned(3, 1024, 0.05)
    metrics.record_fallback("bad_hint")
    link = LinkEstimate(0.001, 1e8, 3)
    node = NodeStats("a:1", True, True, 5, 1, 0, 0, 0, 2, link=link)
    remote = RemoteStats("redis+cluster://a:1", True, *range(1, 13), decode_s_per_mb=0.01, link=link, nodes=(node,))
    metrics.set_store_stats(stats(memory_bytes=1, disk_bytes=1, evictions=1, corrupt=1, disk_full=1, remote=remote))
    families = list(registry.collect())
    assert all(f.samples for f in families), [f.name for f in families if not f.samples]  # every family recorded
    assert {s.labels.get("model_name") for f in families for s in f.samples} == {MODEL}
    assert all(next(iter(s.labels)) == "model_name" for f in families for s in f.samples)
    started = []
    monkeypatch.setattr(metrics, "start", lambda enabled, **kwargs: started.append((enabled, kwargs)))
    monkeypatch.setattr(metrics, "get_serving", lambda: SimpleNamespace(served_model_name="qwen-rag"))
    scheduler = SimpleNamespace(metrics_collector_context=SimpleNamespace(current_scheduler_metrics_enabled=True),
                                server_args=SimpleNamespace(served_model_name=None))  # as the scheduler has it
    metrics._on_scheduler_init(None, scheduler)
    assert started == [(True, {"model_name": "qwen-rag"})]


def test_metrics_off_is_a_no_op():
    """With metrics off (SGLang's decision for this scheduler) every recording function returns without a trace:
    the registry that recorded while metrics were on stays as it was, and no chunkcache series appears in
    prometheus_client's default registry, the one SGLang's /metrics exports."""
    from prometheus_client import REGISTRY

    earlier = CollectorRegistry()
    metrics.start(True, model_name=MODEL, registry=earlier)
    metrics.record_request(INFO)
    before, exported = samples(earlier), samples(REGISTRY)
    assert before[("chunkcache_chunk_hits_total", ())] == INFO["chunk_hits"]  # recording reached it while on
    metrics.start(False)
    metrics.record_request(INFO)
    metrics.record_auto_lookup(2, 1, 0.01)
    metrics.record_auto_learned(3, 1024, 0.05)
    metrics.record_fallback("x")
    metrics.set_store_bytes("device", 64)
    remote = SimpleNamespace(up=False, **dict.fromkeys([*metrics.REMOTE_COUNTERS, *metrics.REMOTE_SKIPS], 5))
    metrics.set_store_stats(stats(memory_bytes=1, disk_bytes=1, evictions=1, corrupt=1, disk_full=1, remote=remote))
    assert samples(earlier) == before
    assert samples(REGISTRY) == exported


# --- auto_chunks: a prompt names the paragraphs it teaches; they are encoded alone later ---------------------------


def _learning_forward(monkeypatch, starved_s: float = 5.0):
    """One finished 25-token prompt prefill (no radix match) in slots 20..44 of a 2-layer pool whose two paragraphs
    are new to the store; the engine's one-row forward replaced by one that records what it computes and returns
    KV that is a function of those tokens alone: (server, scheduler whose tree cache holds it, request, forwards)."""
    from chunkcache.blend.auto import AutoChunks
    from chunkcache.blend.reuse import ChunkReuse
    from chunkcache.config import AutoConfig, Config
    from chunkcache.ranks import Ranks
    from sglang_patch.scheduler import auto_chunks, server as server_module
    from sglang_patch.scheduler.server import ChunkServer

    keys, values = [torch.randn(50, 1, 4) for _ in range(2)], [torch.randn(50, 1, 4) for _ in range(2)]
    pool = SimpleNamespace(layer_num=2, get_key_buffer=keys.__getitem__, get_value_buffer=values.__getitem__)
    slots = torch.arange(20, 45)
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=slots[None]))
    batch = SimpleNamespace(seq_lens_cpu=torch.tensor([25]), req_pool_indices=torch.tensor([0]),
                            extend_prefix_lens_cpu=torch.tensor([0]))
    ids = [9] * 3 + [0] + list(range(10, 20)) + [0] + list(range(30, 38)) + [0, 99]
    req = SimpleNamespace(origin_input_ids=ids, output_ids=[])
    fingerprint = "f" * 32
    config = Config()
    config.auto = AutoConfig(enabled=True, segment_min_tokens=8, segment_mean_tokens=1 << 20,
                             encode_starved_s=starved_s)
    reuse = ChunkReuse.__new__(ChunkReuse)
    reuse.config, reuse.ranks, reuse.fingerprint = config, Ranks(), fingerprint
    reuse.store = ChunkStore(model_fingerprint=fingerprint)
    reuse.auto = AutoChunks(config.auto, frozenset({0}), fingerprint, head=[1, 2])
    request = ChunkRequest("r", segments=reuse.auto.segments(ids, "default", None))
    assert request.segments.spans == ((4, 14), (15, 23))
    forwards = []

    class Aside:
        def __init__(self, model_runner, forward_batch, slice_tokens):
            pass

        def kv(self, token_ids, layers=None):
            forwards.append(token_ids.tolist())
            kv = token_ids.float()[None, :, None, None].expand(2, -1, 1, 4).clone()
            return kv, -kv
            yield  # one step

    monkeypatch.setattr(server_module, "Aside", Aside)
    server = ChunkServer(reuse)
    auto_chunks.learn(reuse, server.teach, runner, batch, [req], lambda r: request)
    return server, SimpleNamespace(tree_cache=SimpleNamespace(chunk_server=server)), request, forwards


def test_a_prompt_teaches_its_paragraphs_encoded_alone_never_its_own_kv(monkeypatch):
    """Invariant (chunkcache/store/entry.py): the forward only names the paragraphs to learn, each queued; nothing
    of the request's pool is stored. A starved server (the oldest waiting past auto.encode_starved_s) encodes one
    after a batch's outputs: the head, then that paragraph, alone; its entry holds what that forward computed."""
    from sglang_patch.scheduler.server import after_batch

    registry = CollectorRegistry()
    metrics.start(True, model_name=MODEL, registry=registry)
    server, scheduler, request, forwards = _learning_forward(monkeypatch, starved_s=1e-9)
    reuse = server.reuse
    token_bytes = 2 * 2 * 1 * 4 * 4  # K and V, 2 layers, 1 head of 4 float32
    assert request.rounds[-1]["learned"] == {"segments": 2, "tokens": 18, "bytes": 18 * token_bytes}
    assert server.idle.waiting("encode") == 2 and forwards == []
    assert not any(k in reuse.store for k in request_keys(reuse))
    after_batch(None, scheduler, None, None)
    assert forwards == [[1, 2, *range(10, 20)]] and server.idle.waiting("encode") == 1
    assert samples(registry)[("chunkcache_auto_learned_segments_total", ())] == 1
    metrics.start(False)
    first = reuse.store.get(reuse.auto.segments(list(range(10, 20)) + [0], "default", None).keys[0])
    assert first.start_pos == 2 and first.token_ids.tolist() == list(range(10, 20))
    torch.testing.assert_close(first.k[0, :, 0, 0], torch.arange(10, 20).float())


def request_keys(reuse):
    ids = [9] * 3 + [0] + list(range(10, 20)) + [0] + list(range(30, 38)) + [0, 99]
    return reuse.auto.segments(ids, "default", None).keys


def test_a_server_that_is_not_starved_leaves_encodes_to_its_idle_turns(monkeypatch):
    from sglang_patch.scheduler.server import after_batch

    server, scheduler, _, forwards = _learning_forward(monkeypatch, starved_s=3600.0)
    reuse = server.reuse
    after_batch(None, scheduler, None, None)
    assert forwards == [] and server.idle.waiting("encode") == 2
    assert server.idle.run_one() == ("encode", True) and server.idle.run_one() == ("encode", True)
    assert len(forwards) == 2 and all(k in reuse.store for k in request_keys(reuse))
    assert server.idle.run_one() is None


@pytest.mark.parametrize("return_logprob, start, expected", [
    (False, 0, False), (True, -1, False), (True, 10, False), (True, 0, True), (True, 9, True)])
def test_only_logprobs_over_the_prompt_keep_a_request_from_automatic_detection(return_logprob, start, expected):
    """-1 (SGLang's default) and a start at the prompt's end score output tokens only, which a blend serves."""
    from sglang_patch.scheduler import request_hint

    recv = SimpleNamespace(return_logprob=return_logprob, logprob_start_len=start, input_ids=list(range(10)))
    assert request_hint.input_logprobs(recv) is expected
