"""Documents on SGLang's OpenAI-compatible /v1/chat/completions (HTTP server process).

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "the question"}, ...],
     "tools": [...], "chunkcache": {"documents": ["...", "..."], "selector": "prophet", "ratio": 0.15}}

The documents are the retrieved passages of the conversation: they go in its first user message, after the system
message (the request's, or prompt.DEFAULT_SYSTEM) and the instruction `Documents:\n\n`, before that message's text,
so their chunks follow the prefix /chunkcache/ingest stores them after. The rest of the conversation (later turns,
tool calls and results, `tools`, `chat_template_kwargs`) is rendered by SGLang's own chat templating, exactly as for
the same messages without chunkcache. `"chunkcache": {"exact": true}` (documents optional) asks for stock's prefill,
no reused KV; without documents the messages are templated by SGLang as usual and only the options travel (`exact`, a
tenant's `namespace`, `learn`).

The request schema drops unknown fields, so the `chunkcache` object is read from the raw JSON body (or from
`chat_template_kwargs.chunkcache`, which passes SGLang's router: see `routed`). Three hooks on
OpenAIServingChat (plugin.hooks):
  * around `handle_request`: validate (a malformed body, or more documents than `limits.max_spans`, is a 400 with
    the reason), then put a special token in the documents' place (prompt.slot_token, prompt.user_turn) and let SGLang
    render the conversation. A model without a chat template gets prompt.build's plain layout instead (built off the
    event loop, prompt_worker), for an optional system message and one user message;
  * after `_convert_to_internal_request` (run by SGLang in a worker thread, where it rendered and tokenized the
    conversation): the documents' chunks spliced in the special token's place (prompt.splice; tokenized there with
    the server's tokenizer, as SGLang tokenized the rest), and the chunk hint put on the GenerateReqInput;
  * after `_build_chat_response`: the response's `metadata["chunkcache"]` is the request's chunk report (what
    /generate returns in `meta_info["chunkcache"]`); sglang_patch.http.usage puts it in the answer's other places.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.entrypoints.openai.protocol import ChatCompletionMessageGenericParam

from chunkcache.documents import CHAT_KEYS, parse
from chunkcache.hints import envelope
from chunkcache.prompt import DEFAULT_SYSTEM, chunks_of, slot_token, splice, user_turn
from chunkcache.select import REGISTRY

from ..serve.launcher import server_limits
from .prompt_worker import build_prompt

KEY = "chunkcache"


async def handle_request(original, serving, request, raw_request=None):
    body = routed(await raw_request.json()) if raw_request is not None else None
    if not isinstance(body, dict) or KEY not in body:
        return await original(serving, request, raw_request)
    if isinstance(request.chat_template_kwargs, dict):  # the router's copy of the object is not for the template
        request.chat_template_kwargs.pop(KEY, None)
    try:
        # each document is one chunk: bounded like the spans of a hint
        docs = parse(body[KEY], where=KEY, allowed=CHAT_KEYS, max_documents=server_limits().max_spans,
                     limit="limits.max_spans", selectors=REGISTRY, options_only=True)
        if not docs.documents:  # options only (exact, a tenant, learn): nothing to build
            raw_request.state.chunkcache_hints = envelope(**docs.hint_options())
            return await original(serving, request, raw_request)
        if request.input_ids is not None:
            raise ValueError(f"{KEY}.documents builds the prompt from the messages; do not also send input_ids")
        tokenizer = serving.tokenizer_manager.tokenizer
        if getattr(tokenizer, "chat_template", None):
            slot = slot_token(tokenizer, request.model_dump_json())
            request.messages = with_documents_slot(request.messages, slot)
            raw_request.state.chunkcache_documents = (docs, tokenizer.convert_tokens_to_ids(slot))
        else:
            system, question = conversation(request)
            prompt = await build_prompt(tokenizer, docs.documents, question, system or DEFAULT_SYSTEM)
            request.input_ids = prompt.input_ids
            raw_request.state.chunkcache_hints = prompt.kv_hints(**docs.hint_options())
    except ValueError as exc:
        return serving.create_error_response(str(exc))
    return await original(serving, request, raw_request)


def routed(body: Any) -> Any:
    """The body with a `chunkcache` object sent inside `chat_template_kwargs` moved to the top level. SGLang's router
    (sglang-router 0.3.2) re-serialises requests into its own schema, dropping unknown fields (`chunkcache` here,
    `kv_hints` on /generate); `chat_template_kwargs` is the one field it forwards as arbitrary JSON."""
    if isinstance(body, dict) and KEY not in body and isinstance(body.get("chat_template_kwargs"), dict) \
            and KEY in body["chat_template_kwargs"]:
        kwargs = dict(body["chat_template_kwargs"])
        return {**body, KEY: kwargs.pop(KEY), "chat_template_kwargs": kwargs}
    return body


def with_documents_slot(messages: list, slot: str) -> list:
    """The messages the documents API renders: a system message first (the request's, or DEFAULT_SYSTEM), then the
    first user message with the instruction and the documents' `slot` before its text; the rest unchanged."""
    roles = [m.role for m in messages]
    messages = list(messages) if roles[:1] == ["system"] else [
        ChatCompletionMessageGenericParam(role="system", content=DEFAULT_SYSTEM), *messages]
    if len(messages) < 2 or messages[1].role != "user":
        raise ValueError(f"{KEY}.documents needs messages that start with an optional system message and a user "
                         f"message, whose text the documents go before; got roles {roles}")
    messages[1] = messages[1].model_copy(update={"content": user_turn(_text(messages[1].content, "user"), slot)})
    return messages


def conversation(request) -> tuple[str | None, str]:
    """(system, question) of a documents request to a model without a chat template: an optional system message,
    then one user message, no tools (prompt.build's plain layout renders nothing else)."""
    roles = [m.role for m in request.messages]
    if request.tools or roles not in (["user"], ["system", "user"]):
        raise ValueError(f"{KEY}.documents on a model without a chat template needs messages = [optional system "
                         f"message, one user message with the question] and no tools; got roles {roles}"
                         f"{' and tools' if request.tools else ''}")
    texts = [_text(m.content, m.role) for m in request.messages]
    return (texts[0] if len(texts) == 2 else None), texts[-1]


def _text(content: Any, role: str) -> str:
    if isinstance(content, list) and all(getattr(p, "type", None) == "text" for p in content):
        content = "".join(p.text for p in content)
    if not isinstance(content, str) or not content.strip():
        raise ValueError(f"the {role} message must have non-empty text content when {KEY}.documents is used")
    return content


def attach_hint(result, serving, request, raw_request=None, *args, **kwargs):
    state = raw_request.state if raw_request is not None else None
    adapted, _ = result
    if getattr(state, "chunkcache_documents", None) is not None:
        docs, slot_id = state.chunkcache_documents
        tokenizer = serving.tokenizer_manager.tokenizer
        # SGLang's ids, or its text (a conversation template: --chat-template NAME) tokenized as its tokenizer manager
        # would
        ids = adapted.input_ids if adapted.input_ids is not None else tokenizer(adapted.text)["input_ids"]
        prompt = splice(ids, slot_id, chunks_of(tokenizer, docs.documents))
        adapted.input_ids, adapted.text = prompt.input_ids, None
        state.chunkcache_hints = prompt.kv_hints(**docs.hint_options())
    hints = getattr(state, "chunkcache_hints", None)
    if hints is not None:
        adapted.kv_hints = hints
    return result


def add_report(response, serving, request, ret, *args, **kwargs):
    report = ret[0]["meta_info"].get(KEY) if ret else None
    if report is not None and hasattr(response, "metadata"):
        response.metadata = {**(response.metadata or {}), KEY: report}
    return response
