"""The request contract: how a request marks its chunks, inside SGLang's own `kv_hints` envelope.

    {"protocol_version": "1", "message_id": "...",
     "actions": [{"action_id": "...", "action_type": "chunkcache.chunks", "action_version": "1",
                  "payload": {"token_spans": [[start, end], ...]}}]}

`token_spans` (end exclusive) index the prompt's tokens and go with `input_ids` requests; a `text` request sends
`char_spans` instead, which the server maps to token spans with the tokenizer's offsets before the scheduler sees
them. Optional payload keys: `namespace` (str of at most MAX_NAMESPACE_CHARS), `selector` (a registered selector
name), `ratio` (float in [0, 1]). The server bounds the number of spans (config `limits.max_spans`).
A request without a chunkcache action is not ours: it must be served exactly like stock SGLang.

Pure Python: the envelope may be a plain dict (JSON) or SGLang's typed struct (read by attribute), so this module
never imports sglang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from .select import REGISTRY

ACTION_TYPE = "chunkcache.chunks"
ACTION_VERSION = "1"
PROTOCOL_VERSION = "1"  # of SGLang's kv_hints envelope: the only one whose semantics this contract knows
# A namespace is hashed into chunk keys and names the request's radix partition: it identifies a tenant, it is not
# a place for data, so it is bounded (a megabyte namespace would be copied into every radix key of the request).
MAX_NAMESPACE_CHARS = 256
OPTIONAL_KEYS = ("namespace", "selector", "ratio")


class HintError(ValueError):
    """A malformed chunkcache hint. A ValueError, so SGLang's /generate answers it with HTTP 400."""

    def __init__(self, message: str):
        super().__init__(f"chunkcache hint: {message}")


@dataclass(frozen=True)
class ChunkHint:
    token_spans: tuple[tuple[int, int], ...]  # sorted, disjoint, non-empty, before the last prompt token
    namespace: str | None = None
    selector: str | None = None
    ratio: float | None = None

    def to_payload(self) -> dict:
        """The canonical payload (token spans only), as the server forwards it to the scheduler."""
        payload: dict[str, Any] = {"token_spans": [list(s) for s in self.token_spans]}
        for key in OPTIONAL_KEYS:
            if getattr(self, key) is not None:
                payload[key] = getattr(self, key)
        return payload


def envelope(token_spans: Sequence[Sequence[int]] | None = None, *, char_spans: Sequence[Sequence[int]] | None = None,
             message_id: str = "chunkcache", **options: Any) -> dict:
    """A `kv_hints` envelope (JSON-ready) carrying one chunkcache action; `options` are the optional payload keys,
    None values left out."""
    if (token_spans is None) == (char_spans is None):
        raise ValueError("give exactly one of token_spans and char_spans")
    unknown = set(options) - set(OPTIONAL_KEYS)
    if unknown:
        raise ValueError(f"unknown chunkcache payload keys {sorted(unknown)}; allowed: {', '.join(OPTIONAL_KEYS)}")
    key, spans = ("token_spans", token_spans) if token_spans is not None else ("char_spans", char_spans)
    payload = {key: [list(s) for s in spans], **{k: v for k, v in options.items() if v is not None}}
    return {"protocol_version": "1", "message_id": message_id, "actions": [
        {"action_id": "chunks", "action_type": ACTION_TYPE, "action_version": ACTION_VERSION, "payload": payload}]}


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def find_payload(kv_hints: Any) -> dict | None:
    """The payload of the request's chunkcache action, or None when it has none (other actions are ignored)."""
    if not kv_hints:
        return None
    ours = [a for a in _get(kv_hints, "actions") or [] if _get(a, "action_type") == ACTION_TYPE]
    if not ours:
        return None
    if len(ours) > 1:
        ids = ", ".join(repr(_get(a, "action_id")) for a in ours)
        raise HintError(f"{len(ours)} {ACTION_TYPE} actions (action_id {ids}); send one per request")
    protocol = _get(kv_hints, "protocol_version")
    if protocol != PROTOCOL_VERSION:
        raise HintError(f"kv_hints protocol_version {protocol!r} is not supported with a {ACTION_TYPE} action "
                        f"(supported: {PROTOCOL_VERSION!r})")
    action = ours[0]
    version = _get(action, "action_version")
    if version != ACTION_VERSION:
        raise HintError(f"{ACTION_TYPE} action_version {version!r} is not supported (supported: {ACTION_VERSION!r})")
    payload = _get(action, "payload")
    if not isinstance(payload, dict):
        raise HintError(f"{ACTION_TYPE} payload must be an object, got {type(payload).__name__}")
    return payload


def parse(payload: dict, prompt_len: int, max_spans: int | None = None) -> ChunkHint:
    """Validate a token-span payload against a prompt of `prompt_len` tokens (and at most `max_spans` spans)."""
    _check_keys(payload, "token_spans")
    spans = _check_spans(payload["token_spans"], "token_spans", prompt_len, "prompt tokens", max_spans)
    last = prompt_len - 1
    for i, (start, end) in enumerate(spans):
        if end > last:
            raise HintError(f"token_spans[{i}] = [{start}, {end}] contains the last prompt token (index {last}), "
                            f"which is always recomputed; a span must end at {last} or earlier")
    return ChunkHint(tuple(spans), *parse_options(payload))


def parse_options(payload: dict) -> tuple[str | None, str | None, float | None]:
    """The optional payload keys, validated: (namespace, selector, ratio), None where absent."""
    namespace, selector, ratio = (payload.get(k) for k in OPTIONAL_KEYS)
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise HintError(f"namespace must be a non-empty string, got {namespace!r}")
    if namespace is not None and len(namespace) > MAX_NAMESPACE_CHARS:
        raise HintError(f"namespace is {len(namespace)} characters; at most {MAX_NAMESPACE_CHARS}")
    if selector is not None:
        if not isinstance(selector, str):
            raise HintError(f"selector must be a string, got {selector!r}")
        if selector not in REGISTRY:  # looked up now, so selectors registered later are accepted
            raise HintError(f"selector {selector!r} is not registered; known: {', '.join(REGISTRY.names())}")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
            raise HintError(f"ratio must be a number in [0, 1], got {ratio!r}")
        if not 0.0 <= ratio <= 1.0:
            raise HintError(f"ratio must be in [0, 1], got {ratio}")
        ratio = float(ratio)
    return namespace, selector, ratio


def char_spans_to_token_payload(payload: dict, offsets: Sequence[Sequence[int]], text_len: int,
                                max_spans: int | None = None) -> dict:
    """A `char_spans` payload (text request) rewritten with the `token_spans` it covers; other keys kept."""
    _check_keys(payload, "char_spans")
    rest = {k: v for k, v in payload.items() if k != "char_spans"}
    return {**rest, "token_spans": char_to_token_spans(payload["char_spans"], offsets, text_len, max_spans)}


def char_to_token_spans(char_spans: Any, offsets: Sequence[Sequence[int]], text_len: int,
                        max_spans: int | None = None) -> list[tuple[int, int]]:
    """Map character spans of a text to the token spans covering them.

    `offsets[i]` is token i's (start, end) character range (a fast tokenizer's offset mapping). A chunk's span must
    start and end on token boundaries. Zero-width tokens (BOS and other specials report (0, 0)) belong to no chunk.
    """
    spans = _check_spans(char_spans, "char_spans", text_len, "characters", max_spans)
    first: list[int | None] = [None] * len(spans)
    last: list[int] = [0] * len(spans)
    j = 0
    for i, (a, b) in enumerate(offsets):
        if a >= b:
            continue
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        if j == len(spans):
            break
        start, end = spans[j]
        if b <= start:
            continue
        # token i overlaps span j: it must lie entirely inside it
        if a < start:
            raise HintError(_cut(j, spans[j], "start", start, i, a, b))
        if b > end:
            raise HintError(_cut(j, spans[j], "end", end, i, a, b))
        if first[j] is None:
            first[j] = i
        last[j] = i
    for j, f in enumerate(first):
        if f is None:
            raise HintError(f"char_spans[{j}] = [{spans[j][0]}, {spans[j][1]}] covers no token")
    return [(f, last[j] + 1) for j, f in enumerate(first)]


def _cut(j: int, span: tuple[int, int], which: str, offset: int, token: int, a: int, b: int) -> str:
    return (f"char_spans[{j}] = [{span[0]}, {span[1]}]: {which} offset {offset} falls inside token {token} "
            f"(characters [{a}, {b})); a chunk must start and end on token boundaries, e.g. {a} or {b}")


def _check_keys(payload: dict, spans_key: str) -> None:
    other = "char_spans" if spans_key == "token_spans" else "token_spans"
    if other in payload:
        kind = "a text request" if other == "char_spans" else "an input_ids request"
        raise HintError(f"{other} is for {kind}; this request must mark its chunks with {spans_key}")
    unknown = sorted(set(payload) - {spans_key, *OPTIONAL_KEYS})
    if unknown:
        raise HintError(f"unknown payload key(s) {', '.join(map(repr, unknown))}; "
                        f"allowed: {', '.join(map(repr, (spans_key, *OPTIONAL_KEYS)))}")
    if spans_key not in payload:
        raise HintError(f"payload has no {spans_key!r}")


def _check_spans(spans: Any, name: str, limit: int, unit: str, max_spans: int | None = None) -> list[tuple[int, int]]:
    """Spans as int pairs, at most `max_spans` of them, sorted, disjoint, non-empty and within [0, limit]."""
    if not isinstance(spans, (list, tuple)) or not spans:
        raise HintError(f"{name} must be a non-empty list of [start, end] pairs, got {_short(spans)}")
    if max_spans is not None and len(spans) > max_spans:  # checked first: what it bounds is the work per span
        raise HintError(f"{name} has {len(spans)} spans; at most {max_spans} per request (server limits.max_spans): "
                        f"merge adjacent chunks or send fewer")
    out: list[tuple[int, int]] = []
    for i, span in enumerate(spans):
        if (not isinstance(span, (list, tuple)) or len(span) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) for x in span)):
            raise HintError(f"{name}[{i}] must be a pair of integers [start, end], got {_short(span)}")
        start, end = span
        where = f"{name}[{i}] = [{start}, {end}]"
        if start < 0:
            raise HintError(f"{where}: start {start} is negative")
        if end <= start:
            raise HintError(f"{where} is empty: end {end} must be greater than start {start}")
        if end > limit:
            raise HintError(f"{where}: end {end} is past the prompt ({limit} {unit})")
        if out and start < out[-1][1]:
            raise HintError(f"{where} starts at {start}, before the end {out[-1][1]} of {name}[{i - 1}]; "
                            f"spans must be sorted and must not overlap")
        out.append((start, end))
    return out


def _short(value: Any) -> str:
    """repr of a client's value for an error message, cut short: a message must not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
