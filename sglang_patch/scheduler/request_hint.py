"""A request's chunk reuse record (chunkcache.blend.request.ChunkRequest), attached once when the scheduler creates
its `Req`: the one attribute chunkcache keeps on it (`ATTR`).

`attach` runs at the Req's creation (plugin.hooks, after `Scheduler._create_generation_req`): it moves the request
into its radix partition and resolves its validated payload against the server's `ChunkReuse` (defaults filled in,
chunk keys hashed). Admission, the blend, learning and the report read the record with `record(req)`, the hint with
`of(req)`.

A request that asks for exact KV (`exact: true`, or `selector: full` by its payload or the server's default) gets no
hint: it stays in its own partition and SGLang's own prefill computes it, so its output is stock's bit for bit; `exact`
says why, for its report (sglang_patch.scheduler.report.exact).

`radix_partition` is the radix-tree namespace (SGLang's `extra_key`) of a hinted request: its KV is approximate past
the first chunk, so no request without chunks may ever match it as an exact prefix. With automatic chunk detection
on, a request without a hint whose stored segments are enough to blend gets an auto hint
(sglang_patch.scheduler.auto_chunks) and moves to `auto_partition`, for the same reason.
"""

from __future__ import annotations

import dataclasses
import logging

from chunkcache.blend.request import ChunkRequest, RequestHint
from chunkcache.blend.reuse import ChunkReuse
from chunkcache.hints import EXACT_SELECTOR, HintError, find_payload

from . import auto_chunks, report
from .server import reuse_of

log = logging.getLogger(__name__)
ATTR = report.ATTR
# Every hinted request's extra_key starts with this, and the HTTP layer refuses it on any other request
# (hint_validation.check_request), so a plain request can never name a hinted request's radix partition.
RESERVED_EXTRA_KEY = "chunkcache\x1f"


def on_created(req, scheduler, recv_req, *args, **kwargs) -> None:
    """AFTER hook on Scheduler._create_generation_req: the request's record, once."""
    attach(reuse_of(scheduler.tree_cache), scheduler.tree_cache, req, input_logprobs(recv_req))


def input_logprobs(recv_req) -> bool:
    """Whether the request asked for logprobs of its prompt's tokens (the scheduler resolves `logprob_start_len`
    after creating the Req: -1, its default, scores output tokens only)."""
    start = getattr(recv_req, "logprob_start_len", -1)
    return bool(getattr(recv_req, "return_logprob", False)) and 0 <= start < len(recv_req.input_ids)


def attach(reuse: ChunkReuse | None, tree_cache, req, input_logprobs: bool = False) -> None:
    """`reuse`: the scheduler's, None when its tree cache is not chunkcache's (a stock server still partitions).
    With automatic detection on, a request without chunks of its own may get some (auto_chunks.detect), in its own
    tenant (its payload's namespace, else the server's, and its cache_salt), unless it asked for `input_logprobs`
    over its prompt; and a request that may teach keeps its segments for learning (`teaches`)."""
    request = ChunkRequest(rid=str(getattr(req, "rid", "?")))
    req.__dict__[ATTR] = request
    try:
        payload = find_payload(getattr(req, "kv_hints", None))
        if payload is not None:
            request.exact = exact_reason(reuse, payload)
            if request.exact is None and "token_spans" in payload:
                req.extra_key = radix_partition(payload.get("namespace"), req.extra_key)
                if reuse is not None:
                    request.hint = reuse.hint(payload, req.origin_input_ids, getattr(req, "cache_salt", None))
        if reuse is None or reuse.auto is None:
            return
        named = tenant_named(payload, req)
        request.learn = teaches(reuse, payload, request, named)
        namespace = None if payload is None else payload.get("namespace")
        if request.hint is not None or request.exact is not None or getattr(req, "to_finish", None) is not None \
                or reuse.config.select.selector == EXACT_SELECTOR:  # a server serving `full` blends nothing
            if request.learn:
                request.segments = reuse.segments(req.origin_input_ids, namespace, getattr(req, "cache_salt", None),
                                                  readings=False)  # only taught: nothing is looked up
        elif not named and reuse.config.auto.require_tenant:
            report.fallback(request, "no_tenant", NO_TENANT)
        else:
            _detect(reuse, tree_cache, req, request, payload, input_logprobs)
    except HintError as exc:  # validated at the HTTP layer; an Engine-side bypass still must not fail the request
        if reuse is not None:
            report.fallback(request, "bad_hint", str(exc))


NO_TENANT = ("the request names no tenant (no chunkcache namespace, no cache_salt) and auto.require_tenant is set: "
             "served as stock, nothing learned")


def _detect(reuse: ChunkReuse, tree_cache, req, request: ChunkRequest, payload: dict | None,
            input_logprobs: bool) -> None:
    try:
        auto_chunks.detect(reuse, tree_cache, req, request, payload, input_logprobs)
    except Exception as exc:  # noqa: BLE001 - e.g. the shared tier failing mid-lookup: serve it as stock
        log.exception("chunkcache: automatic chunk detection failed for request %s", request.rid)
        request.hint = request.detection = None
        report.fallback(request, "auto_error", f"{type(exc).__name__}: {exc}")
    if request.hint is not None:
        plain, req.extra_key = req.extra_key, auto_partition(req.extra_key)
        try:
            carried = auto_chunks.carry_exact_prefix(tree_cache, req, plain, reuse.ranks)
        except Exception:  # noqa: BLE001 - the blend's fill computes the prefix instead
            log.exception("chunkcache: carrying request %s's exact prefix into the auto partition failed; "
                          "its fill computes it", request.rid)
            carried = 0
        request.detection = dataclasses.replace(request.detection, carried=carried)


def tenant_named(payload: dict | None, req) -> bool:
    """Whether the request names its tenant: a namespace in its chunkcache payload, or a cache_salt."""
    return bool((payload or {}).get("namespace") or getattr(req, "cache_salt", None))


def teaches(reuse: ChunkReuse, payload: dict | None, request: ChunkRequest, named: bool) -> bool:
    """Whether the request's paragraphs may be learned (in its own tenant): not when the server does not learn, the
    request asked for exact KV or `learn: false`, or names no tenant where the server requires one."""
    return (reuse.config.auto.learn and request.exact is None and (payload or {}).get("learn") is not False
            and (named or not reuse.config.auto.require_tenant))


def exact_reason(reuse: ChunkReuse | None, payload: dict) -> str | None:
    """"exact" (asked), "selector_full" (the payload's selector or the server's default), or None (blended)."""
    if payload.get("exact") is True:
        return "exact"
    default = reuse.config.select.selector if reuse is not None else None
    return "selector_full" if (payload.get("selector") or default) == EXACT_SELECTOR else None


def record(req) -> ChunkRequest | None:
    """The request's record; None for a request the scheduler created before chunkcache saw it (none)."""
    return req.__dict__.get(ATTR)


def exact(req) -> str | None:
    """Why the request is computed exactly (exact_reason), None for any other request."""
    request = record(req)
    return None if request is None else request.exact


def of(req) -> RequestHint | None:
    """The request's hint; None for a request without chunks, or one SGLang aborted (its prompt is then replaced
    by one token to skip the prefill: it is not served at all, so it is neither blended nor a malformed hint)."""
    if getattr(req, "to_finish", None) is not None:
        return None
    request = record(req)
    return None if request is None else request.hint


def radix_partition(namespace: str | None, extra_key: str | None) -> str:
    """The extra_key of a hinted request: the reserved prefix, then the namespace length-prefixed (so namespace
    "x:y" and namespace "x" with extra_key "y:" differ), then the request's own extra_key last (SGLang appends a
    LoRA id to it and reads it back from the end)."""
    namespace = namespace or ""
    return f"{RESERVED_EXTRA_KEY}{len(namespace)}\x1f{namespace}\x1f{extra_key or ''}"


def auto_partition(extra_key: str | None) -> str:
    """The extra_key of a request blended by automatic detection: never a hinted partition's (those have a digit
    after the reserved prefix), never a plain request's."""
    return f"{RESERVED_EXTRA_KEY}auto\x1f{extra_key or ''}"
