"""Chunk hints checked where SGLang tokenizes a request (TokenizerManager, main process).

Every generate request from /generate or `Engine.generate` (the only entry points that carry `kv_hints`), single
or batched, becomes a `TokenizedGenerateReqInput` in `TokenizerManager._create_tokenized_object`, which is handed the
request, its text and the token ids SGLang computed. `check_request` runs after it (plugin.hooks): it validates the
chunkcache action and replaces it with its canonical token-span form, so the scheduler only ever sees validated
`token_spans`. A HintError is a ValueError, which /generate answers with HTTP 400 and the message; `Engine.generate`
raises it to the caller. The same hook refuses an `extra_key` in the radix partition reserved for hinted requests
(request_hint.radix_partition) on every request, hinted or not, OpenAI routes included (they build their requests
through the same method).
"""

from __future__ import annotations

import msgspec

from chunkcache.hints import ACTION_TYPE, HintError, char_spans_to_token_payload, find_payload, parse
from chunkcache.select import REGISTRY

from ..scheduler.request_hint import RESERVED_EXTRA_KEY
from ..serve.launcher import server_limits


def check_request(tokenized, manager, obj, input_text, input_ids, *args, **kwargs) -> None:
    """Validate `tokenized.kv_hints` against the prompt and rewrite its chunkcache payload to token spans."""
    extra_key = getattr(tokenized, "extra_key", None)
    if isinstance(extra_key, str) and extra_key.startswith(RESERVED_EXTRA_KEY):
        raise ValueError(f"extra_key: values starting with {RESERVED_EXTRA_KEY!r} are reserved for the radix "
                         "partition of chunk-reuse requests")
    envelope = getattr(tokenized, "kv_hints", None)  # embedding requests have no kv_hints
    payload = find_payload(envelope)
    if payload is None:
        return
    if input_ids is None:
        raise HintError("chunks need a prompt of token ids: send text or input_ids, not input_embeds")
    max_spans = server_limits().max_spans
    spans = {"char_spans", "token_spans"} & set(payload)  # none: options alone (a tenant, exact, learn)
    if obj.input_ids is None and obj.input_embeds is None and spans:  # SGLang tokenized `text` itself
        offsets = text_offsets(manager.tokenizer, input_text, input_ids)
        payload = char_spans_to_token_payload(payload, offsets, len(input_text), max_spans)
    hint = parse(payload, len(input_ids), max_spans, selectors=REGISTRY)
    tokenized.kv_hints = with_payload(envelope, hint.to_payload())


def text_offsets(tokenizer, text: str, input_ids) -> list[tuple[int, int]]:
    """Each token's character range in `text`, for the exact token ids SGLang produced from it."""
    if not getattr(tokenizer, "is_fast", False):
        raise HintError("char_spans need a fast tokenizer (offset mapping); send input_ids with token_spans instead")
    enc = tokenizer(text, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(input_ids):
        # e.g. a multimodal processor rewrote the ids: character offsets no longer describe them
        raise HintError("char_spans cannot be mapped: the prompt's token ids are not a plain tokenization of its "
                        "text; send input_ids with token_spans instead")
    return [tuple(o) for o in enc["offset_mapping"]]


def with_payload(envelope, payload: dict):
    """The envelope with our action's payload replaced. A new struct: envelopes are frozen and, in a batch,
    one envelope object may be shared by several requests with different prompts."""
    actions = [msgspec.structs.replace(a, payload=payload) if a.action_type == ACTION_TYPE else a
               for a in envelope.actions]
    return msgspec.structs.replace(envelope, actions=actions)
