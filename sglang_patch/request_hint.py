"""What a hinted request asks of the blend, parsed once per request and kept on SGLang's `Req`.

Admission (sglang_patch.admission) needs it to charge the request its compute; the blend (sglang_patch.blend) needs it
to plan. Both read it through `of(cache, req)`, which parses the validated payload and hashes the chunk keys the first
time and returns the kept value afterwards (the prompt of a request never changes).
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkcache.hashing import chunk_key, prefix_key
from chunkcache.hints import find_payload, parse

ATTR = "chunkcache_hint"
COMPUTE = "chunkcache_compute"  # Req attribute: the compute estimate admission charged it (sglang_patch.admission)


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
    """The request's hint, or None for a request without chunks. Raises HintError for a malformed one (the HTTP
    layer validates, an Engine-side bypass may not)."""
    if ATTR in req.__dict__:
        return req.__dict__[ATTR]
    payload = find_payload(getattr(req, "kv_hints", None))
    hint = None
    if payload is not None:
        ids = req.origin_input_ids
        parsed = parse(payload, len(ids))
        select = cache.config.select
        namespace = parsed.namespace or cache.config.store.namespace
        prefix = prefix_key(list(ids[: parsed.token_spans[0][0]]))
        hint = RequestHint(
            spans=parsed.token_spans, selector=parsed.selector or select.selector,
            ratio=select.ratio if parsed.ratio is None else parsed.ratio, namespace=namespace,
            keys=tuple(chunk_key(cache.fingerprint, namespace, prefix, list(ids[s:e])) for s, e in parsed.token_spans))
    req.__dict__[ATTR] = hint
    return hint
