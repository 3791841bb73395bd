"""The chunk report's schema (chunkcache.blend.round_report): every shape a server's builders make validates, as
built and as a client reads it back from JSON; a round that drifts from its shape is refused where it is built; a
report of several rounds is their merge; each round is one key=value log line; docs/report-schema.md documents
exactly the schema's keys, with their shapes."""

import json
import logging
import re
from pathlib import Path
from typing import get_args, get_type_hints, is_typeddict

import pytest
import torch

from chunkcache.blend import pipeline, round_report
from chunkcache.blend.cost import Prediction
from chunkcache.blend.fidelity import Estimate
from chunkcache.blend.request import STAGES, ChunkRequest, Detection, RequestHint
from chunkcache.blend.round_report import ReportError
from chunkcache.store import Lookup
from sglang_patch.scheduler import report

DOC = Path(__file__).resolve().parents[1] / "docs" / "report-schema.md"
IDS = torch.arange(3, 23)
SPANS, KEYS = ((2, 6), (6, 10)), ("a", "b")
NOTHING = Lookup({}, frozenset(), frozenset())


def request(*, detected=False, max_kl=None, charged=9) -> ChunkRequest:
    hint = RequestHint(IDS, SPANS, KEYS, "mix", 0.15, "ns", auto=detected, max_kl=max_kl)
    detection = Detection(hint, NOTHING, looked_up=3, seconds=0.002, carried=4) if detected else None
    return ChunkRequest("r", hint=hint, detection=detection, charged=charged)


def blend_of(r: ChunkRequest, **fields) -> pipeline.Blended:
    """What the pipeline's blend of `r` (no radix match) returns: one chunk of two found, 4 tokens recomputed."""
    return pipeline.Blended(r.plan(0), hits=1, recomputed=torch.tensor([3, 7, 10, 11]), scores=None,
                            select_s=0.001, passes=("kv_deviation",), ratio=0.15, **fields)


def built() -> list[tuple[str, dict]]:
    """(expected shape, round) for every variant the server's builders make."""
    estimate = Estimate(kl=0.012, agree=0.97, fitted_for="SmolLM2-135M-Instruct", covers=1)
    stages = dict.fromkeys(STAGES, 0.01)
    batch = {"requests": 2, "plain": 1, "decodes": 0, "forwards": 3}
    rounds = [
        ("blended", pipeline.record(request(), blend_of(request()), stages=stages, blend_s=0.2, select_s=0.01,
                                    batch=batch)),
        ("blended", pipeline.record(request(detected=True), blend_of(request(detected=True), fetched=1),
                                    stages=stages, prediction=Prediction(0.1, 0.3, 40, 900, 200, 0.1))),
        ("blended", pipeline.record(request(max_kl=0.05), blend_of(request(max_kl=0.05), estimate=estimate,
                                                                  floor_met=True))),
        ("blended", pipeline.record(request(max_kl=0.05), blend_of(request(max_kl=0.05), estimate=estimate,
                                                                  floor_met=False))),
        ("blended", pipeline.record(request(max_kl=0.05), blend_of(request(max_kl=0.05), floor_met=False,
                                                                  uncalibrated=True))),
        ("held", pipeline.record_held(request(), request().plan(12), computed=8)),
        ("held", pipeline.record_held(request(detected=True), request(detected=True).plan(12), computed=8)),
    ]
    glue = ChunkRequest("g", exact="selector_full")
    report.exact(glue, radix=4, computed=16)
    report.auto_stock(auto := request(detected=True), radix=0, computed=20,
                      learned={"segments": 2, "tokens": 8, "bytes": 4096})
    report.fallback(full := request(), "predicted_slower", "blending predicted slower",
                    Prediction(0.3, 0.2).report())
    full.add_learned({"segments": 0, "tokens": 0, "bytes": 0})
    report.fallback(bad := ChunkRequest("b"), "bad_hint", "token_spans[0] is empty")
    return rounds + [("exact", glue.report), ("auto_stock", auto.report), ("fallback", full.report),
                     ("fallback", bad.report), ("private", round_report.private(glue.report)),
                     ("private", round_report.private(bad.report)), ("private", round_report.private(auto.report))]


def test_every_round_a_builder_makes_validates_as_built_and_read_back_from_json():
    shapes = set()
    for shape, r in built():
        assert round_report.validate(r) == shape, r
        assert round_report.validate(json.loads(json.dumps(r))) == shape
        shapes.add(shape)
    assert shapes == set(round_report.SHAPES)


def blend_round() -> dict:
    return built()[2][1]  # a blended round with a fidelity estimate and its floor


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("radix_tokens"), r"missing \['radix_tokens'\]"),
    (lambda r: r.update(radix=3), r"unknown \['radix'\]"),
    (lambda r: r.update(chunk_hits=True), r"chunk_hits: True is not <class 'int'>"),
    (lambda r: r.update(ratio="0.15"), "ratio: '0.15' is not <class 'float'>"),
    (lambda r: r.update(admitted_compute=1.5), "admitted_compute: 1.5 is none of int | None"),
    (lambda r: r.update(feature_passes=("kv_deviation",)), "feature_passes: .* is not a list"),
    (lambda r: r["stages_s"].pop("detect"), r"stages_s: missing \['detect'\]"),
    (lambda r: r.update(fidelity={"kl": 0.1}), r"fidelity: missing \['fitted_for'\]"),
    (lambda r: r.update(fallback="partial_prefill", detail="d"), "fallback: 'partial_prefill' is not"),
    (lambda r: r.update(auto=True), r"missing \['detect_s', 'segments'\]"),
])
def test_a_round_that_drifts_from_its_shape_is_refused_where_it_is_built(change, message):
    fields = blend_round()
    change(fields)
    with pytest.raises(ReportError, match=message):
        round_report.to_json("blended", fields)


def test_a_builder_naming_another_shape_is_refused():
    with pytest.raises(ReportError, match="a held round with the keys of a blended one"):
        round_report.to_json("held", blend_round())
    assert round_report.to_json("blended", blend_round()) == blend_round()


def test_a_report_of_several_rounds_is_their_merge():
    r = request()
    report.fallback(r, "partial_prefill", "tokens [0, 12) of 20")
    report.blended(r, blend_round())
    assert round_report.validate(r.report) == "blended" and r.report["fallback"] == "partial_prefill"
    assert round_report.validate(json.loads(json.dumps(r.report))) == "blended"
    with pytest.raises(ReportError, match="not its rounds merged"):
        round_report.validate({**r.report, "chunk_hits": 2})
    with pytest.raises(ReportError, match=r"rounds\[0\]: missing \['detail'\]"):
        round_report.validate({**r.report, "rounds": [{"fallback": "x"}, r.rounds[1]]})
    with pytest.raises(ReportError, match="at least two rounds"):
        round_report.validate({**r.rounds[1], "rounds": [r.rounds[1]]})


def test_each_round_is_one_key_value_log_line_at_debug_unless_computed_in_full(caplog):
    """Rounds served as asked stay out of the default log (INFO); every round computed in full is a WARNING."""
    fields, r = blend_round(), request()
    caplog.clear()
    caplog.set_level(logging.INFO, logger=report.log.name)
    report.blended(r, fields)
    assert caplog.records == []
    caplog.set_level(logging.DEBUG, logger=report.log.name)
    report.blended(r, {**fields, "select_s": 0.012, "blend_s": 0.4})
    report.fallback(r, "partial_prefill", "tokens [0, 12) of 20")
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == [
        ("DEBUG", "chunkcache: blended rid=r selector=mix rho=0.15 hits=1 misses=1 reused=6 recomputed=4 radix=0 "
                  "s=0.412"),
        ("WARNING", 'chunkcache: fallback rid=r reason=partial_prefill detail="tokens [0, 12) of 20"')]


def schema_keys() -> dict[str, set[str]]:
    """Every key of the schema (a nested object's as `parent.key`, the stages' as `stages_s`) -> its shapes; the
    merged report's own key, `rounds`, -> {"merged"}."""
    keys: dict[str, set[str]] = {"rounds": {"merged"}}
    for shape, schema in round_report.SHAPES.items():
        for variant in {schema, round_report.DETECTED.get(schema, schema)}:
            for key, hint in get_type_hints(variant).items():
                names = [key]
                if is_typeddict(hint) and hint is not round_report.StageSeconds:
                    names += [f"{key}.{inner}" for inner in get_type_hints(hint)]
                for name in names:
                    keys.setdefault(name, set()).add(shape)
    return keys


def documented_keys() -> dict[str, set[str]]:
    """docs/report-schema.md's key table: `key` -> the shapes its row names."""
    rows = re.findall(r"^\| `([\w.]+)` \|[^|]*\|[^|]*\| ([\w, ]+) \|", DOC.read_text(), re.MULTILINE)
    assert rows, "no key rows in docs/report-schema.md"
    return {key: {s.strip() for s in shapes.split(",")} for key, shapes in rows}


def test_the_documented_schema_is_the_checked_one():
    assert documented_keys() == schema_keys()
    text = DOC.read_text()
    assert all(f"`{stage}`" in text for stage in STAGES)


def test_the_fallback_reasons_are_one_list_the_docs_and_rounds_read():
    """round_report.Fallback is every reason: docs/report-schema.md's `fallback` row names exactly those, a blended
    round's are among them, and a round with any other reason is refused."""
    (row,) = re.findall(r"^\| `fallback` \| str \|.*$", DOC.read_text(), re.MULTILINE)  # the key table's row
    named = set(re.findall(r"`(\w+)`", row.split("|")[5])) - {"chunkcache_fallbacks_total", "reason"}
    assert named == set(round_report.FALLBACKS)
    assert set(get_args(round_report.BlendedFallback)) < set(round_report.FALLBACKS)
    for reason in round_report.FALLBACKS:
        assert round_report.to_json("fallback", {"fallback": reason, "detail": "d"})["fallback"] == reason
    with pytest.raises(round_report.ReportError):
        round_report.to_json("fallback", {"fallback": "because", "detail": "d"})
