"""The schema of a request's chunk report, one typed shape per kind of prefill round, and `to_json`, the one way a
round becomes the dict a response carries (`meta_info["chunkcache"]`, an OpenAI answer's `chunkcache`, the reference
blender's `BlendResult.report`). docs/report-schema.md is this schema in prose, key by key, with units.

Each builder hands `to_json` the shape it builds: chunkcache.blend.pipeline's `record` (`blended`) and `record_held`
(`held`: the radix tree held every chunk), and the rounds the glue reports without a blend,
sglang_patch.scheduler.report (`exact`, `auto_stock`, `fallback`). `to_json` refuses a missing or unknown key and a
value of another type, so no builder drifts from the schema unseen: every shape's builder runs in the tests.
`validate` checks a report as a client receives it (one round, or several merged: ChunkRequest.report) and names its
shape. The shapes are told apart by their keys alone (`shape_of`), so the wire carries no shape name. `private` is
the report a client gets under `report.to_clients: private` (shape `private`: what the request itself decided).

No `from __future__ import annotations` here: TypedDict reads `NotRequired` from evaluated annotations (Python 3.11).
"""

import functools
import types
from collections.abc import Mapping
from typing import Literal, NotRequired, Required, TypedDict, get_args, get_origin, get_type_hints, is_typeddict

from .request import STAGES, ChunkRequest


class ReportError(ValueError):
    """A report, or a round a builder made, that does not match the schema."""


class Learned(TypedDict):
    """The segments the request's prefill taught the store (automatic detection on), added to its last round."""

    segments: int
    tokens: int
    bytes: int


class Batch(TypedDict):
    """The engine's batch the round ran in (pipeline.NO_BATCH: a round that blended nothing)."""

    requests: int  # requests blended in it
    plain: int  # rows computed exactly beside them
    decodes: int  # decode rows mixed in (--enable-mixed-chunk)
    forwards: int  # model forwards it took


StageSeconds = TypedDict("StageSeconds", dict.fromkeys(STAGES, float))  # seconds per stage, request.STAGES' names


class Fidelity(TypedDict, total=False):
    """The fidelity estimate (chunkcache.blend.fidelity); only `fitted_for: None` when the model has no estimator."""

    kl: float  # predicted upper quantile of the KL against full recompute over `covers` answer tokens, nats
    agree: float  # predicted chance its greedy first token is full recompute's
    fitted_for: Required[str | None]  # the model whose cases the estimator was fitted on; None: no estimator
    covers: int  # the answer tokens `kl` bounds (the largest KL over the first `covers` of full's answer)


class _Counted(TypedDict):
    """What every round that prefilled the prompt counts."""

    chunk_hits: int
    reused_tokens: int
    recomputed_tokens: int
    radix_tokens: int
    learned: NotRequired[Learned]


class _Priced(TypedDict):
    """The blend-or-full prediction (chunkcache.blend.cost.Prediction.report), when the server made one."""

    choice: NotRequired[Literal["blend", "full"]]
    predicted_blend_s: NotRequired[float]
    predicted_full_s: NotRequired[float]


class _Detected(TypedDict):
    """What automatic detection did for the request (pipeline.detection_fields)."""

    auto: Literal[True]
    segments: int
    detect_s: float
    exact_carried: NotRequired[int]


class _Blend(_Counted):
    """What every round of a hinted request's prefill reports, blended or not (pipeline.record, record_held)."""

    chunk_misses: int
    attended_pairs: int
    selector: str
    ratio: float
    select_s: float
    blend_s: float
    stages_s: StageSeconds
    batch: Batch
    admitted_compute: int | None
    feature_passes: list[str]
    fetched: int
    computed_instead: int


# Why a round was computed in full, one short fixed token each: the report's `fallback`, the `reason` label of
# chunkcache_fallbacks_total (every one registered at start, at 0) and docs/report-schema.md's list read this alone.
# A blended round carries the first two (its every context token recomputed after all); a fallback round the rest.
Fallback = Literal["quality_floor", "uncalibrated", "input_logprobs", "partial_prefill", "predicted_slower",
                   "bad_hint", "no_tenant", "auto_error", "error"]
FALLBACKS: tuple[str, ...] = get_args(Fallback)
BlendedFallback = Literal["quality_floor", "uncalibrated"]


class HeldRound(_Blend):
    """A round whose chunks the radix tree held entirely: computed exactly, nothing blended, no chunk looked up."""


class BlendedRound(_Blend, _Priced):
    """A round the blend served."""

    fidelity: NotRequired[Fidelity]
    max_kl: NotRequired[float]
    kl_over: NotRequired[Literal["answer", "first_token"]]  # what max_kl bounds (hints.KL_OVER); with max_kl
    fallback: NotRequired[BlendedFallback]  # every context token recomputed after all
    detail: NotRequired[str]


class DetectedHeldRound(HeldRound, _Detected):
    """A held round of a request whose chunks automatic detection found."""


class DetectedBlendedRound(BlendedRound, _Detected):
    """A blended round of a request whose chunks automatic detection found."""


class ExactRound(_Counted):
    """A round the model's own prefill computed because the request asked for exact KV."""

    exact: Literal[True]
    reason: Literal["exact", "selector_full"]
    selector: Literal["full"]


class AutoStockRound(_Counted, _Detected):
    """A request automatic detection served as stock (too few stored segments)."""


class FallbackRound(_Priced):
    """A round computed in full instead of blended, and why."""

    fallback: Fallback
    detail: str
    learned: NotRequired[Learned]


class PrivateRound(TypedDict):
    """A report as `report.to_clients: private` hands it to clients (`private`): only what the request itself
    decided, never what depends on what other requests stored or ran (docs/report-schema.md "Private reports")."""

    private: Literal[True]
    exact: NotRequired[Literal[True]]  # an exact round: the request asked for it, nothing was looked up
    reason: NotRequired[Literal["exact", "selector_full"]]
    selector: NotRequired[Literal["full"]]
    fallback: NotRequired[Literal["input_logprobs", "bad_hint", "no_tenant"]]  # PRIVATE_FALLBACKS
    detail: NotRequired[str]


SHAPES = {"blended": BlendedRound, "held": HeldRound, "exact": ExactRound, "auto_stock": AutoStockRound,
          "fallback": FallbackRound, "private": PrivateRound}
# a blended or held round with `auto` is checked against its detected variant
DETECTED = {BlendedRound: DetectedBlendedRound, HeldRound: DetectedHeldRound}


def shape_of(fields: Mapping) -> str:
    """Which shape a round is, from its keys: `private` marks a private report; `exact` an exact round; a fallback
    round counts no chunks; an auto-stock round names no selector; a held round found no chunk to look up (a blend
    has at least one)."""
    if "private" in fields:
        return "private"
    if "exact" in fields:
        return "exact"
    if "chunk_hits" not in fields:
        return "fallback"
    if "selector" not in fields:
        return "auto_stock"
    return "held" if fields["chunk_hits"] + fields.get("chunk_misses", 0) == 0 else "blended"


def to_json(shape: str, fields: Mapping) -> dict:
    """The round a builder made, as the dict the response carries, once it matches `shape`'s schema."""
    if shape_of(fields) != shape:
        raise ReportError(f"a {shape} round with the keys of a {shape_of(fields)} one: {sorted(fields)}")
    _check_round(fields, shape)
    return dict(fields)


# The fallback reasons a private report keeps, each decided from the request alone before any store or radix
# lookup, with the detail it carries (None: the round's own, which names only the request's hint). Every other reason
# is dropped: `partial_prefill` follows the radix match and the server's load, `predicted_slower` the chunks stored,
# `quality_floor` and a blended round's `uncalibrated` happen only once a blend ran, `auto_error`/`error` anything;
# and an automatically detected request meets any of them only once detection found stored segments (so a fallback
# round's `uncalibrated`, decided before any lookup for a client's own chunks, is dropped too).
PRIVATE_FALLBACKS = {
    # the round's own detail counts the scored tokens of this prefill round, whose bounds follow the radix match
    "input_logprobs": "input logprobs of prompt tokens (logprob_start_len) need those tokens' logits, which a blend "
                      "does not compute: computed in full (output logprobs alone are served blended)",
    "bad_hint": None,
    "no_tenant": None,  # the request named no tenant where the server requires one (auto.require_tenant)
}
PRIVATE_EXACT = ("exact", "reason", "selector")  # an exact round's keys a private report keeps


def private(report: Mapping) -> dict:
    """`report` (one round, or merged) as a client gets it under `report.to_clients: private`: `private: true`; an
    exact round's `exact`, `reason` and `selector` (the request asked for exact KV: nothing was looked up); a
    `fallback` in PRIVATE_FALLBACKS with its `detail`. Nothing else, so that the report's keys and values are the
    same whatever other requests stored, fetched, taught or ran: no hits, misses, reused, recomputed or learned
    tokens, no radix match, segments, fetches, stage seconds, batch, selector's rho, fidelity estimate, quality
    floor, rounds, and no shape (blended, held, auto_stock and a dropped fallback all read `{"private": true}`). The
    full report stays on the request for /metrics and the log (sglang_patch.scheduler.report)."""
    kept: dict = {"private": True}
    if "exact" in report:
        kept |= {key: report[key] for key in PRIVATE_EXACT}
    elif (reason := report.get("fallback")) in PRIVATE_FALLBACKS:
        kept |= {"fallback": reason, "detail": PRIVATE_FALLBACKS[reason] or report["detail"]}
    return to_json("private", kept)


def validate(report: Mapping) -> str:
    """The shape of `report` as a response carries it, checked: one round, or several (`rounds`) merged as
    ChunkRequest.report merges them."""
    if "rounds" not in report:
        return _check_round(report)
    rounds = report["rounds"]
    if not isinstance(rounds, list) or len(rounds) < 2:
        raise ReportError(f"rounds: a list of at least two rounds, not {rounds!r}")
    request = ChunkRequest(rid="validate")
    for i, r in enumerate(rounds):
        _check_round(r, f"rounds[{i}]")
        request.add_round(dict(r))
    if request.report != report:
        raise ReportError("the report is not its rounds merged (the last round, an earlier fallback kept visible)")
    return shape_of(rounds[-1])


def _check_round(fields, where: str = "report") -> str:
    if not isinstance(fields, Mapping):
        raise ReportError(f"{where}: {fields!r} is not an object")
    shape = shape_of(fields)
    schema = SHAPES[shape]
    _check(fields, DETECTED.get(schema, schema) if "auto" in fields else schema, where)
    return shape


@functools.cache
def _hints(schema) -> dict:
    return get_type_hints(schema)


def _check(value, hint, where: str) -> None:
    """Raise ReportError unless `value` is of `hint`: a TypedDict (its keys exactly), a union, a Literal, list[...],
    int (never a bool), float (any JSON number), or a plain type."""
    if is_typeddict(hint):
        if not isinstance(value, Mapping):
            raise ReportError(f"{where}: {value!r} is not an object")
        hints = _hints(hint)
        missing, unknown = hint.__required_keys__ - value.keys(), value.keys() - hints.keys()
        if missing or unknown:
            raise ReportError(f"{where}: missing {sorted(missing)}, unknown {sorted(unknown)}")
        for key, item in value.items():
            _check(item, hints[key], f"{where}.{key}")
        return
    origin, args = get_origin(hint), get_args(hint)
    if origin is types.UnionType:
        if not any(_matches(value, arg, where) for arg in args):
            raise ReportError(f"{where}: {value!r} is none of {hint}")
        return
    if origin is list:
        if not isinstance(value, list):
            raise ReportError(f"{where}: {value!r} is not a list")
        for i, item in enumerate(value):
            _check(item, args[0], f"{where}[{i}]")
        return
    if origin is Literal:
        ok = any(value == arg and type(value) is type(arg) for arg in args)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is type(None):
        ok = value is None
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ReportError(f"{where}: {value!r} is not {hint}")


def _matches(value, hint, where: str) -> bool:
    try:
        _check(value, hint, where)
    except ReportError:
        return False
    return True
