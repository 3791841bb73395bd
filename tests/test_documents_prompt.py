"""The prompt of a documents request with a whole conversation (sglang_patch.http.chat, chunkcache.prompt): the
documents in the first user message as chunks, everything else as the chat template renders it.

In-process, no server: `chat.handle_request` puts the documents' slot in the messages, a stand-in for SGLang's
templating renders them as its Jinja path does (`tokenizer.apply_chat_template` with the tools, then one
tokenization of the whole text), and `chat.attach_hint` splices the chunks in. The oracle is the template rendered
directly with the tokenizer for the same messages with the documents written into the first user message: the same
text, tokenized with each document on its own (prompt.assemble at the documents' characters), and, after the
documents, the very tokens of the whole text's tokenization. tests/test_rag_http.py checks the same against the live
server's own templating."""

import asyncio
import copy
from types import SimpleNamespace

import pytest

from chunkcache.prompt import DEFAULT_INSTRUCTION, DEFAULT_SYSTEM, assemble, build, chunks_of, slot_token, splice
from sglang_patch.http import chat

DOCS = ["The Amber market opens every Tuesday at dawn.", "The river Vell flows north past the mill.",
        "The lighthouse of Sorn was built in 1852."]
HISTORY = [{"role": "user", "content": "Which day does the market open?"},
           {"role": "assistant", "content": "It opens on Tuesday."},
           {"role": "user", "content": "And when was the lighthouse built?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
TOOL_TURNS = [{"role": "user", "content": "Is it raining at the market?"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                  "name": "get_weather", "arguments": "{\"city\": \"Amber\"}"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "light rain"},
              {"role": "user", "content": "Should I bring an umbrella?"}]
# a ChatML template that renders tools in the system turn, assistant tool calls and tool results (as Qwen2.5's does):
# the default model's renders none of them
TOOLS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'system' and tools %}{{ message.content }}\n\n# Tools"
    "{% for tool in tools %}\n{{ tool.function | tojson }}{% endfor %}"
    "{% elif message.tool_calls %}{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}"
    "</tool_call>{% endfor %}"
    "{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from chunkcache.models import DEFAULT_MODEL, resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def rendered(tokenizer, request) -> str:
    """The text SGLang's Jinja templating renders for a request (OpenAIServingChat._apply_jinja_template): its
    messages and tools as dicts, a missing content as ""."""
    messages = [m.model_dump() for m in request.messages]
    for message in messages:
        message["content"] = message["content"] or ""
    tools = [t.model_dump() for t in request.tools] if request.tools else None
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def sglang_renders(tokenizer):
    """A stand-in for SGLang's handle_request from the templating on: the text `rendered` makes, tokenized whole,
    then chunkcache's hook after `_convert_to_internal_request`; returns the GenerateReqInput-like result."""
    async def original(serving, request, raw_request):
        adapted = SimpleNamespace(input_ids=tokenizer.encode(rendered(tokenizer, request)), text=None, kv_hints=None)
        return chat.attach_hint((adapted, request), serving, request, raw_request)[0]

    return original


def request_of(body: dict):
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    return ChatCompletionRequest(**{k: v for k, v in body.items() if k != "chunkcache"})


def through_documents_api(tokenizer, messages, documents, tools=None):
    """What the documents API hands the scheduler for these messages: (input_ids, the hint's token spans)."""
    body = {"messages": messages, "max_tokens": 4, "chunkcache": {"documents": documents},
            **({"tools": tools} if tools else {})}
    raw = SimpleNamespace(json=lambda: asyncio.sleep(0, body), state=SimpleNamespace())
    serving = SimpleNamespace(create_error_response=lambda message: pytest.fail(message),
                              tokenizer_manager=SimpleNamespace(tokenizer=tokenizer))
    adapted = asyncio.run(chat.handle_request(sglang_renders(tokenizer), serving, request_of(body), raw))
    spans = adapted.kv_hints["actions"][0]["payload"]["token_spans"]
    return adapted.input_ids, [tuple(s) for s in spans]


def oracle(tokenizer, messages, documents, tools=None):
    """The same messages with the documents written into the first user message (docs/rag-http.md), rendered and
    tokenized whole: (the text, the documents' character spans in it, its ids)."""
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
    written = DEFAULT_INSTRUCTION + "".join(doc + "\n\n" for doc in documents)
    inlined = [{**m, "content": written + m["content"]} if i == 1 else m for i, m in enumerate(messages)]
    text = rendered(tokenizer, request_of({"messages": inlined, **({"tools": tools} if tools else {})}))
    start = text.index(written) + len(DEFAULT_INSTRUCTION)
    spans = []
    for doc in documents:
        spans.append((start, start + len(doc) + 2))
        start += len(doc) + 2
    return text, spans, tokenizer.encode(text)


@pytest.mark.parametrize("case", ["three turns", "tools and a tool call"])
def test_a_conversation_is_the_templates_with_the_documents_as_chunks(tokenizer, tools_tokenizer, case):
    tok, messages, tools, rendered_parts = {
        "three turns": (tokenizer, HISTORY, None, ["It opens on Tuesday.", "lighthouse built?"]),
        "tools and a tool call": (tools_tokenizer, TOOL_TURNS, [TOOL],
                                  ["# Tools", '"get_weather"', "<tool_call>", "light rain", "umbrella"])}[case]
    ids, spans = through_documents_api(tok, messages, DOCS, tools)
    text, doc_chars, whole = oracle(tok, messages, DOCS, tools)
    assert all(part in text for part in rendered_parts), text
    expected = assemble(text, doc_chars, lambda pieces: [tok.encode(p, add_special_tokens=False) for p in pieces])
    assert ids == expected.input_ids and spans == expected.token_spans
    # every document is its own chunk: the ids ingest stores it under
    assert [ids[s:e] for s, e in spans] == chunks_of(tok, DOCS)
    assert tok.decode(ids) == text
    # after the documents (the question, the later turns, the tool call and its result, the assistant header): the
    # whole text's own tokens
    tail = ids[spans[-1][1]:]
    assert len(tail) > 20 and whole[-len(tail):] == tail


def test_a_question_alone_is_builds_prompt(tokenizer):
    """A system message and one user message: the prompt prompt.build makes, the one /chunkcache/ingest stores its
    chunks in; a system message of the client's own replaces the default in both."""
    question = [{"role": "user", "content": "Which day does the market open?"}]
    for system in (None, "Answer in French."):
        messages = ([{"role": "system", "content": system}] if system else []) + question
        ids, spans = through_documents_api(tokenizer, messages, DOCS)
        built = build(tokenizer, DOCS, question[0]["content"], system=system or DEFAULT_SYSTEM)
        assert (ids, spans) == (built.input_ids, built.token_spans)


def test_the_documents_place_is_a_special_token_found_nowhere_else(tokenizer):
    slot = slot_token(tokenizer, "")
    assert slot == "<empty_output>"  # SmolLM2's last added special token; its template uses <|im_start|>, <|im_end|>
    assert slot_token(tokenizer, f"a message quoting {slot}") == "<jupyter_script>"
    ids = tokenizer.encode(f"Documents:\n\n{slot}Which day?", add_special_tokens=False)
    slot_id = tokenizer.convert_tokens_to_ids(slot)
    assert ids.count(slot_id) == 1
    prompt = splice(ids, slot_id, [[7, 8], [9]])
    at = ids.index(slot_id)
    assert prompt.input_ids == ids[:at] + [7, 8, 9] + ids[at + 1:] and prompt.token_spans == [(at, at + 2),
                                                                                               (at + 2, at + 3)]
    with pytest.raises(ValueError, match="holds the documents' place 2 times"):
        splice(ids + [slot_id], slot_id, [[7]])


def test_a_model_without_a_chat_template_gets_builds_plain_prompt_for_one_question(tokenizer, monkeypatch):
    """No chat template (a base model: gemma-3-270m): a system message and one user message are laid out as
    prompt.build's plain text, the layout ingest stores; a conversation or tools are a 400 naming why."""
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None

    async def build_prompt(tok, documents, question, system):  # prompt_worker's, without its thread
        return build(tok, documents, question, system=system)

    monkeypatch.setattr(chat, "build_prompt", build_prompt)

    async def sglang(serving, request, raw_request):
        adapted = SimpleNamespace(input_ids=request.input_ids, text=None, kv_hints=None)
        return chat.attach_hint((adapted, request), serving, request, raw_request)[0]

    def send(messages, **extra):
        body = {"messages": messages, "max_tokens": 4, "chunkcache": {"documents": DOCS}, **extra}
        raw = SimpleNamespace(json=lambda: asyncio.sleep(0, body), state=SimpleNamespace())
        serving = SimpleNamespace(create_error_response=lambda message: message,
                                  tokenizer_manager=SimpleNamespace(tokenizer=plain))
        return asyncio.run(chat.handle_request(sglang, serving, request_of(body), raw))

    adapted = send(HISTORY[:1])
    built = build(plain, DOCS, HISTORY[0]["content"], system=DEFAULT_SYSTEM)
    assert adapted.input_ids == built.input_ids
    layout = f"{plain.bos_token}{DEFAULT_SYSTEM}\n\n{DEFAULT_INSTRUCTION}{DOCS[0]}"
    assert plain.decode(built.input_ids).startswith(layout)
    refused = "chunkcache.documents on a model without a chat template needs messages = [optional system message, "
    assert send(HISTORY).startswith(refused) and "got roles ['user', 'assistant', 'user']" in send(HISTORY)
    assert send(HISTORY[:1], tools=[TOOL]).endswith("got roles ['user'] and tools")
