"""A hinted request's chunk report: written in the scheduler, returned as the response's `meta_info["chunkcache"]`,
logged and counted in /metrics (sglang_patch.scheduler.metrics).

Each prefill round of the request adds one entry: `blended` (what the blend did, or that the radix tree already
held every chunk) or `fallback` (computed in full, and why). SGLang already carries per-request extras to the
TokenizerManager: `Req.customized_info` -> BatchTokenIDOutput -> detokenizer -> BatchStrOutput ->
`TokenizerManager.update_request_meta_info`. The report rides on it through three hooks (plugin.hooks):
  * scheduler, before `_GenerationStreamAccumulator.accept` (`attach`): copy `req.chunkcache_info` into
    `req.customized_info`;
  * scheduler, after `SchedulerOutputStreamer.is_request_level_customized_info_key` (`request_level`): our key is
    request-level, so it is sent once (when a non-streamed request finishes, or with a streamed request's first
    chunk) rather than sliced per output token;
  * main process, around `TokenizerManager.update_request_meta_info` (`to_meta_info`): put the dict itself in
    meta_info and keep it out of SGLang's per-token accumulation (which would turn it into a growing list).
"""

from __future__ import annotations

import logging

from chunkcache.blend.pipeline import Blended
from chunkcache.blend.plan import RequestPlan

from . import metrics

log = logging.getLogger(__name__)
KEY = "chunkcache"
STAGES = ("match_fill", "copy", "features", "select", "prefill")  # stages_s: the batch's blend, in order
# Req attribute: the segments automatic detection looked up past the radix match (sglang_patch.scheduler.auto_chunks)
AUTO_SEGMENTS = "chunkcache_auto_segments"
AUTO_DETECT_S = "chunkcache_auto_detect_s"  # Req attribute: seconds automatic detection took
EXACT = "chunkcache_exact"  # Req attribute: why a request with a chunkcache payload is computed exactly
NO_BATCH = {"requests": 0, "plain": 0, "decodes": 0, "forwards": 0}


def blended(req, plan: RequestPlan, *, hits: int, reused: int, recomputed: int,
            admitted_compute: int | None, select_s: float = 0.0, blend_s: float = 0.0,
            stages: dict[str, float] | None = None, batch: dict[str, int] | None = None, auto: bool = False,
            passes: tuple[str, ...] = (), pairs: int = 0, predicted=None, blended: Blended | None = None) -> None:
    """A round served from the plan: chunk hits, reused and recomputed tokens, the radix match, the selector, timings
    (`stages` and `batch` are the whole batch's; none when the radix tree held every chunk and nothing blended).
    `auto`: the chunks were found by automatic detection, not marked by the client. `passes`: the model passes the
    selector's features took (a remembered deviation takes none: mix's stored_deviation). `pairs`: the (query, key)
    pairs the recomputed tokens attend, against the n(n+1)/2 of a causal prefill (the benches' floor). `predicted`:
    the blend-or-full decision (chunkcache.blend.cost.Prediction), when the server made one. `blended`: the
    pipeline's record (its rho, fidelity estimate, quality floor, and of its chunks those fetched from the remote tier
    and those computed instead); none when nothing blended."""
    info = {
        **(_auto(req) if auto else {}),
        "chunk_hits": hits, "chunk_misses": len(plan.chunks) - hits, "reused_tokens": reused,
        "recomputed_tokens": recomputed, "attended_pairs": pairs, "radix_tokens": plan.matched, "selector": plan.selector,
        "ratio": plan.ratio if blended is None else blended.ratio,
        "select_s": round(select_s, 6), "blend_s": round(blend_s, 6),
        "stages_s": {k: round((stages or {}).get(k, 0.0), 6) for k in STAGES}, "batch": batch or dict(NO_BATCH),
        "admitted_compute": admitted_compute, "feature_passes": list(passes),
        **(predicted.report() if predicted is not None else {}),
        **(_fidelity(req, plan, blended) if blended is not None else {}),
        **({"fetched": blended.fetched, "computed_instead": blended.computed_instead} if blended is not None else {}),
    }
    log.info("chunkcache: request %s %s", getattr(req, "rid", "?"), info)
    metrics.record_request(info)
    _add_round(req, info)


def auto_stock(req, *, radix: int, computed: int, learned: dict[str, int]) -> None:
    """A request automatic detection served as stock (too few stored segments): what it computed and taught the
    store."""
    log.info("chunkcache: request %s served as stock by automatic detection (too few stored segments); learned %s",
             getattr(req, "rid", "?"), learned)
    _add_round(req, {**_auto(req), "chunk_hits": 0, "reused_tokens": 0, "recomputed_tokens": computed,
                     "radix_tokens": radix, "learned": learned})


def _fidelity(req, plan: RequestPlan, blended: Blended) -> dict:
    """The fidelity estimate at the rho the request got and, with a quality floor, the bound and whether a rho up to
    the cap met it: one that none met had every context token recomputed, a fallback said in the log and metrics."""
    est = blended.estimate
    info = {} if est is None else {"fidelity": {"kl": round(est.kl, 6), "agree": round(est.agree, 4)}}
    if plan.max_kl is None:
        return info
    info["max_kl"] = plan.max_kl
    if not blended.floor_met:
        detail = (f"no rho up to select.max_kl_cap has an estimated first-token KL of at most {plan.max_kl}"
                  if est is not None else f"selector {plan.selector!r} gives no fidelity estimate (the estimator "
                  f"reads mix's signals)") + ": every context token recomputed"
        log.warning("chunkcache: request %s computed in full (quality_floor): %s", getattr(req, "rid", "?"), detail)
        metrics.record_fallback("quality_floor")
        info.update(fallback="quality_floor", detail=detail)
    return info


def exact(req, *, radix: int, computed: int) -> None:
    """A round computed by SGLang's own prefill because the request asked for exact KV (request_hint.exact_reason):
    no reused KV, its output stock's."""
    why = req.__dict__[EXACT]
    log.info("chunkcache: request %s computed by the model's own prefill (%s)", getattr(req, "rid", "?"), why)
    metrics.record_exact(why)
    _add_round(req, {"exact": True, "reason": why, "selector": "full", "chunk_hits": 0, "reused_tokens": 0,
                     "recomputed_tokens": computed, "radix_tokens": radix})


def _auto(req) -> dict:
    return {"auto": True, "segments": req.__dict__.get(AUTO_SEGMENTS, 0),
            "detect_s": round(req.__dict__.get(AUTO_DETECT_S, 0.0), 6)}


def add_learned(req, learned: dict[str, int]) -> None:
    """The segments a blended request's prefill taught the store, added to its last round's report."""
    info = getattr(req, "chunkcache_info", None)
    if info is not None:
        info["learned"] = learned


def fallback(req, reason: str, detail: str, extra: dict | None = None) -> None:
    """A round computed in full instead of blended: said in the log, a metric and its meta_info."""
    log.warning("chunkcache: request %s computed in full (%s): %s", getattr(req, "rid", "?"), reason, detail)
    metrics.record_fallback(reason)
    _add_round(req, {"fallback": reason, "detail": detail, **(extra or {})})


def _add_round(req, info: dict) -> None:
    """`req.chunkcache_info` accounts for every prefill round of the request: the last round's report, with all
    rounds listed when there were several, and a round computed in full stays visible as the top-level `fallback`
    after a later round blends."""
    rounds = req.__dict__.setdefault("chunkcache_rounds", [])
    rounds.append(info)
    merged = dict(info)
    if len(rounds) > 1:
        merged["rounds"] = list(rounds)
        full = next((r for r in rounds if "fallback" in r), None)
        if full is not None and "fallback" not in merged:
            merged["fallback"], merged["detail"] = full["fallback"], full["detail"]
    req.chunkcache_info = merged


def attach(*args, req, **kwargs) -> None:
    info = getattr(req, "chunkcache_info", None)
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
