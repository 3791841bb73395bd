"""`report.to_clients: private` (docs/report-schema.md "Private reports"): what a client is handed keeps only what its
own request decided, whatever kind of round it was, while /metrics count every round in full; the one place a report
is made private is the scheduler's hand-over (sglang_patch.scheduler.report.attach); /server_info's chunkcache state
loses the store's counters. No server: the builders, the hand-over and the state run on records and fakes."""

import dataclasses
import json
import types
from typing import get_type_hints

import pytest
import torch
from prometheus_client import CollectorRegistry

from chunkcache.blend import pipeline, round_report
from chunkcache.blend.cost import Prediction
from chunkcache.blend.request import ChunkRequest, Detection, RequestHint
from chunkcache.config import Config, ConfigError, ReportConfig
from chunkcache.store import Lookup
from sglang_patch.scheduler import metrics, report

IDS = torch.arange(3, 23)
SPANS, KEYS = ((2, 6), (6, 10)), ("a", "b")
NOTHING = Lookup({}, frozenset(), frozenset())

# what a private report may hold; everything else a full report has is dropped
KEPT = {"private", "exact", "reason", "selector", "fallback", "detail"}
# every key of the full shapes, but those a private exact round or a private kept fallback keeps
DROPPED = {"chunk_hits", "chunk_misses", "reused_tokens", "recomputed_tokens", "radix_tokens", "attended_pairs",
           "ratio", "select_s", "blend_s", "stages_s", "batch", "admitted_compute", "feature_passes", "fetched",
           "computed_instead", "choice", "predicted_blend_s", "predicted_full_s", "fidelity", "max_kl", "kl_over", "auto",
           "segments", "detect_s", "exact_carried", "learned", "rounds"}


def test_kept_and_dropped_cover_every_key_of_the_schema():
    keys = set().union(*map(get_type_hints, {*round_report.SHAPES.values(), *round_report.DETECTED.values()}))
    assert keys | {"rounds"} == KEPT | DROPPED and not KEPT & DROPPED


def hinted(*, detected=False, max_kl=None) -> ChunkRequest:
    hint = RequestHint(IDS, SPANS, KEYS, "mix", 0.15, "ns", auto=detected, max_kl=max_kl)
    detection = Detection(hint, NOTHING, looked_up=3, seconds=0.002, carried=4) if detected else None
    return ChunkRequest("r", hint=hint, detection=detection, charged=9)


def blended(r: ChunkRequest) -> dict:
    """A blended round of `r`: one chunk of two found (a fetch), its learned segments added."""
    b = pipeline.Blended(r.plan(0), hits=1, recomputed=torch.tensor([3, 7, 10, 11]), scores=None, select_s=0.001,
                         passes=("kv_deviation",), ratio=0.15, fetched=1)
    return pipeline.record(r, b, stages={"copy": 0.01}, blend_s=0.2, select_s=0.01,
                           batch={"requests": 2, "plain": 1, "decodes": 0, "forwards": 3})


def rounds() -> dict[str, ChunkRequest]:
    """A request per kind of round, each through the glue that counts and reports it."""
    out = {}
    report.blended(r := hinted(), blended(r))
    r.add_learned({"segments": 1, "tokens": 4, "bytes": 512})
    out["blended"] = r
    report.blended(r := hinted(detected=True), blended(r))
    out["detected blended"] = r
    report.blended(r := hinted(), pipeline.record_held(r, r.plan(12), computed=8))
    out["held"] = r
    report.auto_stock(r := hinted(detected=True), radix=3, computed=17,
                      learned={"segments": 2, "tokens": 8, "bytes": 4096})
    out["auto_stock"] = r
    report.fallback(r := hinted(), "predicted_slower", "blending (40 tokens computed, 900 pairs) predicted slower",
                    Prediction(0.3, 0.2).report())
    out["predicted_slower"] = r
    report.fallback(r := hinted(), "partial_prefill", "tokens [12, 20) of 20 (chunked prefill): computed in full")
    report.blended(r, blended(r))
    out["merged"] = r
    return out


@pytest.mark.parametrize("kind", ["blended", "detected blended", "held", "auto_stock", "predicted_slower", "merged"])
def test_a_private_report_of_any_served_round_is_the_same_and_holds_no_count(kind):
    """Blended (hits, misses, a fetch, learned segments), held (the radix tree had every chunk), auto-stock (too few
    stored segments), a fallback the store decided and a merged report all read the same: nothing a client could
    tell other tenants' traffic from, and the full report stays on the request."""
    r = rounds()[kind]
    full = json.loads(json.dumps(r.report))
    private = round_report.private(r.report)
    assert private == {"private": True}
    assert not DROPPED & private.keys()
    assert DROPPED & full.keys()  # the full report had them (a predicted_slower round: the prediction)
    assert round_report.validate(json.loads(json.dumps(private))) == "private"
    assert r.report == full  # made private as a copy: /metrics and the log read the full one


def test_a_private_report_keeps_what_the_request_itself_decided():
    report.exact(exact := ChunkRequest("e", exact="exact"), radix=4, computed=16)
    assert round_report.private(exact.report) == {"private": True, "exact": True, "reason": "exact",
                                                  "selector": "full"}
    report.fallback(bad := ChunkRequest("b"), "bad_hint", "token_spans[0] is empty")
    assert round_report.private(bad.report) == {"private": True, "fallback": "bad_hint",
                                                "detail": "token_spans[0] is empty"}
    report.fallback(scored := hinted(), "input_logprobs", "input logprobs of the last 7 prompt tokens ...")
    kept = round_report.private(scored.report)
    assert kept["fallback"] == "input_logprobs" and "7" not in kept["detail"]  # the round's own counts tokens
    for kind, reason in [("uncalibrated", "uncalibrated"), ("auto_error", "auto_error"), ("error", "error")]:
        report.fallback(r := hinted(), reason, "anything")
        assert round_report.private(r.report) == {"private": True}, kind
    floor = hinted(max_kl=0.05)
    b = pipeline.Blended(floor.plan(0), hits=2, recomputed=torch.arange(8), scores=None, select_s=0.0, passes=(),
                         ratio=1.0, floor_met=False, uncalibrated=True)
    report.blended(floor, pipeline.record(floor, b))
    assert floor.report["fallback"] == "uncalibrated" and round_report.private(floor.report) == {"private": True}


def test_a_private_report_refuses_a_kept_key_it_does_not_know():
    with pytest.raises(round_report.ReportError):
        round_report.validate({"private": True, "chunk_hits": 1})
    with pytest.raises(round_report.ReportError):
        round_report.validate({"private": True, "fallback": "predicted_slower", "detail": "x"})


class Req:
    """SGLang's Req as the hand-over reads it: the ChunkRequest chunkcache attached, customized_info."""

    def __init__(self, request: ChunkRequest):
        self.customized_info = None
        self.__dict__[report.ATTR] = request


@pytest.fixture
def private(monkeypatch):
    monkeypatch.setattr(report, "to_clients", lambda: "private")


def handed(request: ChunkRequest) -> dict | None:
    req = Req(request)
    report.attach(None, req=req)
    return None if req.customized_info is None else req.customized_info[report.KEY][-1]


def test_the_hand_over_to_clients_makes_every_report_private(private):
    """Every client path (meta_info, usage, metadata, ingest) reads what `attach` put in customized_info."""
    r = rounds()
    assert handed(r["blended"]) == handed(r["held"]) == handed(r["merged"]) == {"private": True}
    assert handed(r["predicted_slower"]) == {"private": True}
    # a request whose chunks detection looked for gets none at all, found or not: a plain request's answer
    assert handed(r["detected blended"]) is None and handed(r["auto_stock"]) is None
    report.exact(exact := ChunkRequest("e", exact="selector_full"), radix=0, computed=9)
    assert handed(exact) == {"private": True, "exact": True, "reason": "selector_full", "selector": "full"}
    report.fallback(bad := ChunkRequest("b"), "bad_hint", "no spans")
    assert handed(bad) == {"private": True, "fallback": "bad_hint", "detail": "no spans"}
    assert handed(ChunkRequest("none")) is None  # no round yet


def test_the_hand_over_makes_a_report_private_once_until_it_changes(private):
    req = Req(r := ChunkRequest("b"))
    report.fallback(r, "bad_hint", "no spans")
    report.attach(None, req=req)
    first = req.customized_info[report.KEY][-1]
    report.attach(None, req=req)  # the next output step
    assert req.customized_info[report.KEY][-1] is first == {"private": True, "fallback": "bad_hint",
                                                            "detail": "no spans"}
    report.fallback(r, "error", "RuntimeError: x")  # a later round: the merged report is a new dict
    report.attach(None, req=req)
    assert req.customized_info[report.KEY][-1] == {"private": True}


def test_a_full_server_hands_the_report_as_it_is(monkeypatch):
    monkeypatch.setattr(report, "to_clients", lambda: "full")
    r = rounds()
    for kind in ("blended", "detected blended", "auto_stock"):
        assert handed(r[kind]) == r[kind].report


def test_metrics_count_the_full_round_of_a_private_report(private):
    registry = CollectorRegistry()
    metrics.start(True, model_name="m", registry=registry)
    try:
        report.blended(r := hinted(), blended(r))
        report.fallback(f := hinted(), "predicted_slower", "slower")
        assert handed(r) == {"private": True} and handed(f) == {"private": True}

        def value(name, **labels):
            return registry.get_sample_value(name, {"model_name": "m", **labels})

        assert value("chunkcache_chunk_hits_total") == 1 and value("chunkcache_chunk_misses_total") == 1
        assert value("chunkcache_reused_tokens_total") == r.report["reused_tokens"] > 0
        assert value("chunkcache_recomputed_tokens_total") == 4
        assert value("chunkcache_requests_total", selector="mix") == 1
        assert value("chunkcache_fallbacks_total", reason="predicted_slower") == 1
    finally:
        metrics.start(False)


def test_the_knob_defaults_to_full_and_refuses_another_level():
    assert Config().report.to_clients == "full"
    ReportConfig(to_clients="private").check()
    with pytest.raises(ConfigError, match="to_clients"):
        ReportConfig(to_clients="none").check()


@dataclasses.dataclass
class Stats:
    hits: int = 5
    memory_entries: int = 3


def test_server_info_drops_the_store_counters_when_private():
    from chunkcache.ranks import Ranks
    from sglang_patch.scheduler.server import ChunkServer

    config = Config()
    reuse = types.SimpleNamespace(
        config=config, store=types.SimpleNamespace(stats=Stats), ranks=Ranks(), fidelity=None,
        calibration=types.SimpleNamespace(state=lambda: {"observed": 7}),
        compute=types.SimpleNamespace(per_token_s=1e-3))
    server = ChunkServer(reuse)
    server.idle.put("encode", lambda: None)
    pool = types.SimpleNamespace(available_size=lambda: 100)
    cache = types.SimpleNamespace(token_to_kv_pool_allocator=pool, evictable_size=lambda: 40, protected_size=lambda: 2)
    full = server.state(cache)
    assert full["store"] == {"hits": 5, "memory_entries": 3} and full["kv_pool"]["evictable"] == 40
    assert full["encodes_waiting"] == 1
    assert full["fidelity"] == {"fitted_for": None, "covers": None, "ratios": None, "first_token": False,
                                "margin": 1.0}  # no estimator: max_kl in full
    config.report.to_clients = "private"
    state = server.state(cache)
    assert state.keys() == {"backend", "tree_cache", "scheduler_pid", "private"}
    assert state["backend"] == full["backend"] and state["private"] is True
