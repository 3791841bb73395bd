"""A request's chunk report: each prefill round's record (chunkcache.blend.pipeline.record, or a round computed in
full) added to its ChunkRequest, logged and counted in /metrics (sglang_patch.scheduler.metrics), returned as the
response's `meta_info["chunkcache"]`.

Each prefill round of the request adds one entry, of one of the shapes chunkcache.blend.round_report checks
(docs/report-schema.md): `blended` (what the blend did, or that the radix tree already held every chunk), `exact`,
`auto_stock` or `fallback` (computed in full, and why). Each round is one log line of key=value fields (`_line`): at
DEBUG for a round served as asked (`--log-level debug` shows them), at WARNING for one computed in full. SGLang carries
per-request extras to the TokenizerManager: `Req.customized_info` -> BatchTokenIDOutput -> detokenizer ->
BatchStrOutput -> `TokenizerManager.update_request_meta_info`. The report rides on it through three hooks
(plugin.hooks):
  * scheduler, before `_GenerationStreamAccumulator.accept` (`attach`): copy the report of the request's record
    (request_hint.record(req).report) into `req.customized_info`; under `report.to_clients: private`, the one place
    where it is made private (`for_clients`) before it leaves the scheduler, so that every client path (/generate,
    chat, OpenAI usage, ingest, the Engine API) gets the private report, while /metrics (counted by the builders
    below) and the log keep every key;
  * scheduler, after `SchedulerOutputStreamer.is_request_level_customized_info_key` (`request_level`): our key is
    request-level, so it is sent once (when a non-streamed request finishes, or with a streamed request's first
    chunk) rather than sliced per output token;
  * main process, around `TokenizerManager.update_request_meta_info` (`to_meta_info`): put the dict itself in
    meta_info and keep it out of SGLang's per-token accumulation (which would turn it into a growing list).
"""

from __future__ import annotations

import functools
import json
import logging
import weakref

from chunkcache.blend import pipeline, round_report
from chunkcache.blend.request import ChunkRequest

from . import metrics

log = logging.getLogger(__name__)
KEY = "chunkcache"  # meta_info's key, and SGLang's customized_info's
ATTR = "chunkcache"  # the Req attribute holding its ChunkRequest (request_hint.attach), the only one chunkcache sets


def blended(request: ChunkRequest, info: dict) -> None:
    """A round the pipeline recorded (chunkcache.blend.pipeline.record / record_held): logged, counted, reported. A
    round that recomputed every context token after all (a quality floor no rho met) is a fallback, said as one."""
    if "fallback" in info:
        _warn_full(request, info["fallback"], info["detail"])
    if log.isEnabledFor(logging.DEBUG):
        log.debug(_line("blended", request, selector=info["selector"], rho=info["ratio"], hits=info["chunk_hits"],
                        misses=info["chunk_misses"], reused=info["reused_tokens"],
                        recomputed=info["recomputed_tokens"], radix=info["radix_tokens"],
                        s=info["blend_s"] + info["select_s"]))
    metrics.record_request(info)
    request.add_round(info)


def auto_stock(request: ChunkRequest, *, radix: int, computed: int, learned: dict) -> None:
    """A request automatic detection served as stock (too few stored segments): what it computed and taught the
    store."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug(_line("auto_stock", request, radix=radix, recomputed=computed, learned=learned["segments"]))
    auto = {"auto": True, "segments": 0, "detect_s": 0.0, **pipeline.detection_fields(request)}
    request.add_round(round_report.to_json("auto_stock", {
        **auto, "chunk_hits": 0, "reused_tokens": 0, "recomputed_tokens": computed, "radix_tokens": radix,
        "learned": learned}))


def exact(request: ChunkRequest, *, radix: int, computed: int) -> None:
    """A round computed by SGLang's own prefill because the request asked for exact KV (request_hint.exact_reason):
    no reused KV, its output stock's."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug(_line("exact", request, reason=request.exact, radix=radix, recomputed=computed))
    metrics.record_exact(request.exact)
    request.add_round(round_report.to_json("exact", {
        "exact": True, "reason": request.exact, "selector": "full", "chunk_hits": 0, "reused_tokens": 0,
        "recomputed_tokens": computed, "radix_tokens": radix}))


def fallback(request: ChunkRequest, reason: round_report.Fallback, detail: str, extra: dict | None = None) -> None:
    """A round computed in full instead of blended: logged, counted and reported, with why."""
    _warn_full(request, reason, detail)
    request.add_round(round_report.to_json("fallback", {"fallback": reason, "detail": detail, **(extra or {})}))


def _warn_full(request: ChunkRequest, reason: str, detail: str) -> None:
    """A WARNING, so that the default log level shows every round computed in full, and
    chunkcache_fallbacks_total{reason}."""
    log.warning(_line("fallback", request, reason=reason, detail=detail))
    metrics.record_fallback(reason)


def _line(event: str, request: ChunkRequest, **fields) -> str:
    """One request's log line, `chunkcache: EVENT rid=... key=value ...` (logfmt: text with spaces double-quoted),
    for grep and log pipelines; floats rounded to 3 decimals."""
    def text(value) -> str:
        value = str(round(value, 3) if isinstance(value, float) else value)
        return json.dumps(value) if not value or any(c in value for c in ' "=') else value

    return " ".join([f"chunkcache: {event}", *(f"{key}={text(value)}" for key, value in
                                                {"rid": request.rid, **fields}.items())])


@functools.cache
def to_clients() -> str:
    """The server's `report.to_clients` ("full" or "private"), read once per process."""
    from ..serve.launcher import load_server_config

    return load_server_config().report.to_clients


def for_clients(request: ChunkRequest | None) -> dict | None:
    """The request's report as its client gets it: as is under "full"; under "private", round_report.private for a
    request whose client marked its chunks or asked for exact KV (`marked`), and none at all for one whose chunks
    automatic detection looked for: whether it gets a report, and of what kind, would say whether its segments were
    stored (such a request then reads as on a server without detection)."""
    info = None if request is None else request.report
    if info is None or to_clients() != "private":
        return info
    return round_report.private(info) if marked(request) else None


def marked(request: ChunkRequest) -> bool:
    """Whether what happened to the request follows from the request itself: its client marked the chunks (a hint
    not found by detection), asked for exact KV, or was refused before any lookup (a malformed hint, no tenant)."""
    if request.exact is not None:
        return True
    if request.hint is not None:
        return not request.hint.auto
    return any(r.get("fallback") in round_report.PRIVATE_FALLBACKS for r in request.rounds)


# Req -> (its report, what for_clients made of it): a private report is made once per report, not once per output
# step (a report changes as a new dict: ChunkRequest.add_round, add_learned)
_handed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach(*args, req, **kwargs) -> None:
    request = req.__dict__.get(ATTR)
    info = None if request is None else request.report
    if info is not None and to_clients() != "full":
        made = _handed.get(req)
        if made is None or made[0] is not info:
            made = _handed[req] = (info, for_clients(request))
        info = made[1]
    if info is not None:
        if req.customized_info is None:
            req.customized_info = {}
        req.customized_info[KEY] = [info]


def request_level(result: bool, streamer, key: str) -> bool | None:
    return True if key == KEY else None  # None: SGLang's own answer stands


def to_meta_info(original, manager, meta_info: dict, state, customized_info: dict, index: int, *args, **kwargs):
    if KEY in customized_info:
        values = customized_info[KEY][index]  # [] for requests of the batch without a report
        if values:
            meta_info[KEY] = values[-1]
        customized_info = {k: v for k, v in customized_info.items() if k != KEY}
    return original(manager, meta_info, state, customized_info, index, *args, **kwargs)
