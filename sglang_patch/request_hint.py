"""What a hinted request asks of the blend, parsed once per request and kept on SGLang's `Req`.

Admission (sglang_patch.admission) needs it to charge the request its compute; the blend (sglang_patch.blend) needs it
to plan. Both read it through `of(cache, req)`, which parses the validated payload and hashes the chunk keys the first
time and returns the kept value afterwards (the prompt of a request never changes).

`radix_partition` is the radix-tree namespace (SGLang's `extra_key`) of a hinted request: its KV is approximate past
the first chunk, so no request without chunks may ever match it as an exact prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkcache.hashing import chunk_key, prefix_key
from chunkcache.hints import find_payload, parse

ATTR = "chunkcache_hint"
COMPUTE = "chunkcache_compute"  # Req attribute: the compute estimate admission charged it (sglang_patch.admission)
# Every hinted request's extra_key starts with this, and the HTTP layer refuses it on any other request
# (hints_http.check_request), so a plain request can never name a hinted request's radix partition.
RESERVED_EXTRA_KEY = "chunkcache\x1f"


@dataclass(frozen=True)
class RequestHint:
    spans: tuple[tuple[int, int], ...]  # the chunks' token spans in the prompt (end exclusive)
    selector: str
    ratio: float
    namespace: str
    keys: tuple[str, ...]  # chunk-store key of each span

    @property
    def shared(self) -> int:
        """The shared prefix is prompt[:shared]: every chunk's KV was computed right after it."""
        return self.spans[0][0]

    @property
    def query(self) -> int:
        """First token after the last chunk (the query and the last prompt token follow)."""
        return self.spans[-1][1]


def of(cache, req) -> RequestHint | None:
    """The request's hint, or None for a request without chunks (or one SGLang aborted before its prefill). Raises
    HintError for a malformed one (the HTTP layer validates, an Engine-side bypass may not)."""
    if ATTR in req.__dict__:
        return req.__dict__[ATTR]
    payload = find_payload(getattr(req, "kv_hints", None))
    hint = None
    # An aborted request (e.g. longer than the KV pool) has its prompt replaced by one token to skip the prefill:
    # it is not served at all, so it is neither blended nor a malformed hint.
    if payload is not None and getattr(req, "to_finish", None) is None:
        ids = req.origin_input_ids
        parsed = parse(payload, len(ids), cache.config.limits.max_spans)
        select = cache.config.select
        namespace = parsed.namespace or cache.config.store.namespace
        salt = getattr(req, "cache_salt", None)
        prefix = prefix_key(list(ids[: parsed.token_spans[0][0]]))
        hint = RequestHint(
            spans=parsed.token_spans, selector=parsed.selector or select.selector,
            ratio=select.ratio if parsed.ratio is None else parsed.ratio, namespace=namespace,
            keys=tuple(chunk_key(cache.fingerprint, namespace, prefix, list(ids[s:e]), salt)
                       for s, e in parsed.token_spans))
    req.__dict__[ATTR] = hint
    return hint


def radix_partition(namespace: str | None, extra_key: str | None) -> str:
    """The extra_key of a hinted request: the reserved prefix, then the namespace length-prefixed (so namespace
    "x:y" and namespace "x" with extra_key "y:" differ), then the request's own extra_key last (SGLang appends a
    LoRA id to it and reads it back from the end)."""
    namespace = namespace or ""
    return f"{RESERVED_EXTRA_KEY}{len(namespace)}\x1f{namespace}\x1f{extra_key or ''}"
