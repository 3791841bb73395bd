"""Documents on SGLang's OpenAI-compatible /v1/chat/completions (HTTP server process).

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "the question"}],
     "chunkcache": {"documents": ["...", "..."], "selector": "prophet", "ratio": 0.15}}

`"chunkcache": {"exact": true}` (documents optional) asks for stock's prefill, no reused KV; without documents the
messages are templated by SGLang as usual and only the options travel (`exact`, a tenant's `namespace`, `learn`).

The request schema drops unknown fields, so the `chunkcache` object is read from the raw JSON body (or from
`chat_template_kwargs.chunkcache`, which passes SGLang's router: see `routed`). Three hooks on
OpenAIServingChat (plugin.hooks):
  * around `handle_request`: validate, build the prompt with chunkcache.prompt.build off the event loop
    (prompt_worker; the model's chat template, system = the request's system message or prompt.DEFAULT_SYSTEM)
    and hand it to SGLang as the request's `input_ids` (SGLang then skips its own templating); a malformed body,
    or more documents than `limits.max_spans`, is a 400 with the reason;
  * after `_convert_to_internal_request` (run in a worker thread, so the hint travels on the request's state):
    put the chunk hint on the GenerateReqInput;
  * after `_build_chat_response`: the response's `metadata["chunkcache"]` is the request's chunk report (what
    /generate returns in `meta_info["chunkcache"]`). Every answer also carries it in `usage.chunkcache`
    (sglang_patch.http.usage), where the frameworks pass it on: a stream in its usage chunk when the client asked for
    usage, and always as `chunkcache` on the chunk that finishes the answer.
"""

from __future__ import annotations

from typing import Any

from chunkcache.documents import CHAT_KEYS, parse
from chunkcache.hints import envelope
from chunkcache.prompt import DEFAULT_SYSTEM
from chunkcache.select import REGISTRY

from ..serve.launcher import server_limits
from .prompt_worker import build_prompt

KEY = "chunkcache"


async def handle_request(original, serving, request, raw_request=None):
    body = routed(await raw_request.json()) if raw_request is not None else None
    if not isinstance(body, dict) or KEY not in body:
        return await original(serving, request, raw_request)
    try:
        # each document is one chunk: bounded like the spans of a hint
        docs = parse(body[KEY], where=KEY, allowed=CHAT_KEYS, max_documents=server_limits().max_spans,
                     limit="limits.max_spans", selectors=REGISTRY, options_only=True)
        if not docs.documents:  # options only (exact, a tenant, learn): nothing to build
            raw_request.state.chunkcache_hints = envelope(**docs.hint_options())
            return await original(serving, request, raw_request)
        system, question = conversation(request)
        prompt = await build_prompt(serving.tokenizer_manager.tokenizer, docs.documents, question,
                                    system or DEFAULT_SYSTEM)
    except ValueError as exc:
        return serving.create_error_response(str(exc))
    request.input_ids = prompt.input_ids
    raw_request.state.chunkcache_hints = prompt.kv_hints(**docs.hint_options())
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


def conversation(request) -> tuple[str | None, str]:
    """(system, question) of a documents request: an optional system message, then one user message."""
    if request.input_ids is not None:
        raise ValueError(f"{KEY}.documents builds the prompt from the messages; do not also send input_ids")
    if request.tools:
        raise ValueError(f"{KEY}.documents cannot be combined with tools (the RAG prompt does not render them)")
    roles = [m.role for m in request.messages]
    if roles not in (["user"], ["system", "user"]):
        raise ValueError(f"{KEY}.documents needs messages = [optional system message, one user message with the "
                         f"question]; got roles {roles}")
    texts = [_text(m.content, m.role) for m in request.messages]
    return (texts[0] if len(texts) == 2 else None), texts[-1]


def _text(content: Any, role: str) -> str:
    if isinstance(content, list) and all(getattr(p, "type", None) == "text" for p in content):
        content = "".join(p.text for p in content)
    if not isinstance(content, str) or not content.strip():
        raise ValueError(f"the {role} message must have non-empty text content when {KEY}.documents is used")
    return content


def attach_hint(result, serving, request, raw_request=None, *args, **kwargs):
    hints = getattr(raw_request.state, "chunkcache_hints", None) if raw_request is not None else None
    if hints is not None:
        adapted, _ = result
        adapted.kv_hints = hints
    return result


def add_report(response, serving, request, ret, *args, **kwargs):
    report = ret[0]["meta_info"].get(KEY) if ret else None
    if report is not None and hasattr(response, "metadata"):
        response.metadata = {**(response.metadata or {}), KEY: report}
    return response
