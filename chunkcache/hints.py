"""The request contract: how a request marks its chunks, inside SGLang's own `kv_hints` envelope.

    {"protocol_version": "1", "message_id": "...",
     "actions": [{"action_id": "...", "action_type": "chunkcache.chunks", "action_version": "1",
                  "payload": {"token_spans": [[start, end], ...]}}]}

`token_spans` (end exclusive) index the prompt's tokens and go with `input_ids` requests; a `text` request sends
`char_spans` instead, which the server maps to token spans with the tokenizer's offsets before the scheduler sees
them. Optional payload keys: `namespace` (str of at most MAX_NAMESPACE_CHARS), `selector` (a registered selector
name), `ratio` (float in [0, 1]), `exact` (bool), `max_kl` (float > 0: the quality floor, a bound on the blend's
estimated KL against full recompute over the answer tokens its estimator covers, chunkcache.blend.fidelity),
`kl_over` ("answer", the default: max_kl bounds the answer's first tokens, as many as the estimator covers; or
"first_token": the first token only, a looser promise that costs less rho, from the estimator's `first_token` one),
`learn` (bool: false, the request teaches the store nothing). The server bounds the number of spans (config
`limits.max_spans`).
A payload may carry no spans: it then only says who the request is and how to serve it (`namespace`, `learn`,
`selector`, `ratio`, `max_kl`), and a server with automatic detection finds its chunks in that namespace.
A request without a chunkcache action is not ours: it must be served exactly like stock SGLang.

`exact: true` asks for no approximate KV at all: the request is computed by SGLang's own prefill, reusing only the
radix tree's exact prefix, so its output is stock's bit for bit. Its spans may be left out (a client that pastes
passages to a server with automatic detection opts out with `{"exact": true}` alone); `selector` and `ratio` have no
meaning with it and are refused. `selector: full` is served the same way.

Pure Python, never importing sglang or torch: the envelope may be a plain dict (JSON) or SGLang's typed struct (read
by attribute), and the selector names are judged by the registry a caller passes in (`SelectorNames`), so the
request contract, the prompt builder and frontend programs load without the model stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Protocol, Sequence

ACTION_TYPE = "chunkcache.chunks"
ACTION_VERSION = "1"
PROTOCOL_VERSION = "1"  # of SGLang's kv_hints envelope: the only one whose semantics this contract knows
# A namespace is hashed into chunk keys and names the request's radix partition: it identifies a tenant, it is not
# a place for data, so it is bounded (a megabyte namespace would be copied into every radix key of the request).
MAX_NAMESPACE_CHARS = 256
OPTIONAL_KEYS = ("namespace", "selector", "ratio", "exact", "max_kl", "learn", "kl_over")
KL_OVER = ("answer", "first_token")  # what a quality floor bounds: the answer's tokens (the default), or the first
EXACT_SELECTOR = "full"  # the selector that recomputes every token: served as `exact` is


class SelectorNames(Protocol):
    """The selector registry (chunkcache.select.REGISTRY) as a payload's `selector` is judged against it."""

    def __contains__(self, name: object) -> bool: ...

    def names(self) -> list[str]: ...


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
    exact: bool | None = None  # True: SGLang's own prefill, no reused KV (token_spans may then be empty)
    max_kl: float | None = None  # the quality floor: the smallest rho whose estimated KL is at most this
    learn: bool | None = None  # False: the request teaches the store nothing
    kl_over: str | None = None  # what the quality floor bounds (KL_OVER; None: the answer)

    def to_payload(self) -> dict:
        """The canonical payload (token spans only), as the server forwards it to the scheduler."""
        payload: dict[str, Any] = {"token_spans": [list(s) for s in self.token_spans]} if self.token_spans else {}
        for key in OPTIONAL_KEYS:
            if getattr(self, key) is not None:
                payload[key] = getattr(self, key)
        return payload


def envelope(token_spans: Sequence[Sequence[int]] | None = None, *, char_spans: Sequence[Sequence[int]] | None = None,
             message_id: str = "chunkcache", **options: Any) -> dict:
    """A `kv_hints` envelope (JSON-ready) carrying one chunkcache action; `options` are the optional payload keys,
    None values left out. An envelope may carry no spans (options only: hints.parse)."""
    if token_spans is not None and char_spans is not None:
        raise ValueError("give one of token_spans and char_spans, not both")
    unknown = set(options) - set(OPTIONAL_KEYS)
    if unknown:
        raise ValueError(f"unknown chunkcache payload keys {sorted(unknown)}; allowed: {', '.join(OPTIONAL_KEYS)}")
    payload = {k: v for k, v in options.items() if v is not None}
    for key, spans in (("token_spans", token_spans), ("char_spans", char_spans)):
        if spans is not None:
            payload[key] = [list(s) for s in spans]
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


def parse(payload: dict, prompt_len: int, max_spans: int | None = None,
          selectors: SelectorNames | None = None) -> ChunkHint:
    """Validate a token-span payload against a prompt of `prompt_len` tokens (and at most `max_spans` spans);
    `selectors`: the registry a `selector` must be registered in (None: not judged here)."""
    spanless = ChunkHint((), *parse_options(payload, selectors))
    if not _check_keys(payload, "token_spans"):
        return spanless
    spans = _check_spans(payload["token_spans"], "token_spans", prompt_len, "prompt tokens", max_spans)
    last = prompt_len - 1
    for i, (start, end) in enumerate(spans):
        if end > last:
            raise HintError(f"token_spans[{i}] = [{start}, {end}] contains the last prompt token (index {last}), "
                            f"which is always recomputed; a span must end at {last} or earlier")
    return replace(spanless, token_spans=tuple(spans))


def parse_options(payload: dict, selectors: SelectorNames | None = None
                  ) -> tuple[str | None, str | None, float | None, bool | None, float | None, bool | None,
                             str | None]:
    """The optional payload keys, validated: (namespace, selector, ratio, exact, max_kl, learn, kl_over), None where
    absent;
    `selectors`: the registry a `selector` must be registered in (None: not judged here)."""
    namespace, selector, ratio, exact, max_kl, learn, kl_over = (payload.get(k) for k in OPTIONAL_KEYS)
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise HintError(f"namespace must be a non-empty string, got {namespace!r}")
    if namespace is not None and len(namespace) > MAX_NAMESPACE_CHARS:
        raise HintError(f"namespace is {len(namespace)} characters; at most {MAX_NAMESPACE_CHARS}")
    if selector is not None:
        if not isinstance(selector, str):
            raise HintError(f"selector must be a string, got {selector!r}")
        if selectors is not None and selector not in selectors:  # looked up now: later registrations count
            raise HintError(f"selector {selector!r} is not registered; known: {', '.join(selectors.names())}")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
            raise HintError(f"ratio must be a number in [0, 1], got {ratio!r}")
        if not 0.0 <= ratio <= 1.0:
            raise HintError(f"ratio must be in [0, 1], got {ratio}")
        ratio = float(ratio)
    if exact is not None and not isinstance(exact, bool):
        raise HintError(f"exact must be true or false, got {exact!r}")
    if learn is not None and not isinstance(learn, bool):
        raise HintError(f"learn must be true or false, got {learn!r}")
    if max_kl is not None:
        if isinstance(max_kl, bool) or not isinstance(max_kl, (int, float)) or not math.isfinite(max_kl) \
                or max_kl <= 0:
            raise HintError(f"max_kl must be a number > 0 (nats of KL over what kl_over names), got {max_kl!r}")
        if ratio is not None:
            raise HintError("max_kl and ratio both set the recompute budget: send one of them")
        max_kl = float(max_kl)
    if kl_over is not None:
        if kl_over not in KL_OVER:
            raise HintError(f"kl_over must be one of {', '.join(map(repr, KL_OVER))}, got {kl_over!r}")
        if ratio is not None or exact:
            raise HintError("kl_over says what a quality floor (max_kl) bounds: it cannot apply with "
                            f"{'ratio' if ratio is not None else 'exact: true'}; leave it out")
    if exact:
        if max_kl is not None:
            raise HintError("max_kl cannot apply with exact: true (no approximate KV at all); leave max_kl out")
        if selector not in (None, EXACT_SELECTOR):
            raise HintError(f"selector {selector!r} cannot apply with exact: true (every token is computed by the "
                            f"model's own prefill); leave selector out")
        if ratio is not None:
            raise HintError("ratio cannot apply with exact: true (every token is computed); leave ratio out")
    return namespace, selector, ratio, exact, max_kl, learn, kl_over


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


def _check_keys(payload: dict, spans_key: str) -> bool:
    """Whether the payload has `spans_key`; any other key is an error."""
    other = "char_spans" if spans_key == "token_spans" else "token_spans"
    if other in payload:
        kind = "a text request" if other == "char_spans" else "an input_ids request"
        raise HintError(f"{other} is for {kind}; this request must mark its chunks with {spans_key}")
    unknown = sorted(set(payload) - {spans_key, *OPTIONAL_KEYS})
    if unknown:
        raise HintError(f"unknown payload key(s) {', '.join(map(repr, unknown))}; "
                        f"allowed: {', '.join(map(repr, (spans_key, *OPTIONAL_KEYS)))}")
    return spans_key in payload


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
