"""Documents over HTTP: the `chunkcache` extra body of /v1/chat/completions, POST /chunkcache/ingest and the
`chunkcache ingest` command, on the session's live server. Each test uses documents of its own: chunk accounting
depends on what the store and the radix tree already hold."""

import json

import pytest
import requests
from conftest import metric

from chunkcache.documents import CHAT_KEYS, DocumentsError, parse
from chunkcache.prompt import DEFAULT_INSTRUCTION, DEFAULT_SYSTEM, assemble
from chunkcache.select import REGISTRY
from sglang_patch.http.usage import counts
from sglang_patch.serve import cli

QUESTION = "Which day does the market open?"


def docs(tag: str) -> list[str]:
    return [f"The {tag} market opens every Tuesday at dawn.", f"The river of {tag} flows north.",
            f"The {tag} lighthouse was built in 1852."]


def chat(server, documents, question=QUESTION, **extra):
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 4, "temperature": 0,
            "chunkcache": {"documents": documents, "selector": "epic"}, **extra}
    return requests.post(server.url + "/v1/chat/completions", json=body, timeout=600)


def ingest(server, documents, **extra):
    return requests.post(server.url + "/chunkcache/ingest", json={"documents": documents, **extra}, timeout=600)


@pytest.mark.parametrize("body, message", [
    ({"documents": "one string"}, "chunkcache.documents must be a non-empty list of strings, got a string"),
    ({"documents": []}, "chunkcache.documents must be a non-empty list of strings, got an empty list"),
    ({"documents": ["ok", ""]}, "chunkcache.documents[1] must be a non-empty string, got an empty string"),
    ({"documents": ["ok"], "ratio": 2}, "chunkcache: ratio must be in [0, 1], got 2"),
    ({"documents": ["ok"], "selector": "nope"}, "chunkcache: selector 'nope' is not registered"),
    ({"documents": ["ok"], "top_k": 3}, "unknown key(s) 'top_k' in chunkcache"),
    (["ok"], 'chunkcache must be an object like {"documents": ["..."]}, got a list of 1'),
])
def test_documents_body_is_validated(body, message):
    with pytest.raises(DocumentsError) as info:
        parse(body, where="chunkcache", allowed=CHAT_KEYS, selectors=REGISTRY)
    assert message in str(info.value)


def test_a_first_token_bound_reaches_the_hint():
    docs = parse({"documents": ["ok"], "max_kl": 0.02, "kl_over": "first_token"}, where="chunkcache",
                 allowed=CHAT_KEYS, selectors=REGISTRY)
    assert docs.hint_options() == {"max_kl": 0.02, "kl_over": "first_token"}
    with pytest.raises(DocumentsError, match="chunkcache: kl_over must be one of"):
        parse({"documents": ["ok"], "max_kl": 0.02, "kl_over": "first"}, where="chunkcache", allowed=CHAT_KEYS)


slow = pytest.mark.slow


@slow
def test_chat_with_documents_answers_and_reuses_them_in_another_order(server):
    first = chat(server, docs("Amber"))
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["message"]["content"]
    report = first.json()["metadata"]["chunkcache"]
    assert report["chunk_hits"] + report["chunk_misses"] == 3 and report["selector"] == "epic"
    assert first.json()["chunkcache"] == report and first.json()["usage"]["chunkcache"] == counts(report)
    second = chat(server, docs("Amber")[::-1])
    assert second.status_code == 200, second.text
    report = second.json()["metadata"]["chunkcache"]
    assert (report["chunk_hits"], report["chunk_misses"]) == (3, 0)


def streamed(server, body) -> list[dict]:
    """The chunks of a streamed chat completion, in order, up to `[DONE]`."""
    with requests.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                       timeout=600) as r:
        assert r.status_code == 200, r.text
        lines = [line.removeprefix("data: ") for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "[DONE]", lines
    return [json.loads(line) for line in lines[:-1]]


@slow
def test_a_streamed_chat_carries_the_report_on_its_finishing_chunk(server):
    """Documents stored by a first request, streamed in another order without asking for usage: every chunk has a
    choice (clients read `choices[0]` of each) and none has usage; the last, the one that finishes the answer, carries
    the report as `chunkcache`. Asked for usage, the stream ends with the usage chunk (no choices), whose `usage`
    carries the report's counts."""
    documents = docs("Wren")
    assert chat(server, documents).status_code == 200
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "temperature": 0,
            "chunkcache": {"documents": documents[::-1], "selector": "epic"}}
    *answer, finishing = streamed(server, body)
    assert finishing["choices"][0]["finish_reason"] is not None
    assert all(c["choices"] and not c.get("usage") and "chunkcache" not in c for c in answer), answer
    report = finishing["chunkcache"]
    assert (report["chunk_hits"], report["chunk_misses"]) == (3, 0) and report["selector"] == "epic", report
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in answer)
    *answer, finishing, closing = streamed(server, {**body, "stream_options": {"include_usage": True}})
    assert closing["choices"] == [] and finishing["choices"][0]["finish_reason"] is not None
    assert closing["usage"]["chunkcache"] == counts(finishing["chunkcache"])
    assert 0 < closing["usage"]["completion_tokens"] <= 4


def flushed(server):
    """The server with an empty radix tree (the chunk store is kept): a request with stored documents then blends
    them as the same request did before the flush."""
    requests.post(server.url + "/flush_cache", params={"timeout": 60}, timeout=120).raise_for_status()
    return server


@slow
def test_the_openai_package_streams_a_chat_and_finds_its_report(server):
    """The `openai` package's everyday loop over a stream that did not ask for usage,
    `"".join(c.choices[0].delta.content or "" for c in stream)`, gets the answer the same request gets not streamed
    (greedy, each blended from the store after a flush), and the report is the last chunk's `chunkcache`, an extra
    field the package keeps, as the answer's is; asked for usage, the usage chunk's `usage.chunkcache` has its
    counts."""
    from openai import OpenAI

    documents = docs("Heron")
    assert chat(server, documents).status_code == 200
    completions = OpenAI(base_url=server.url + "/v1", api_key="none").chat.completions
    request = {"model": "default", "temperature": 0, "max_tokens": 4,
               "messages": [{"role": "user", "content": QUESTION}],
               "extra_body": {"chunkcache": {"documents": documents[::-1], "selector": "epic"}}}
    flushed(server)
    answer = completions.create(**request)
    flushed(server)
    chunks = list(completions.create(**request, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
    report = chunks[-1].chunkcache
    assert chunks[-1].choices[0].finish_reason is not None and chunks[-1].model_extra["chunkcache"] == report
    assert (report["chunk_hits"], report["chunk_misses"]) == (3, 0), report
    assert report["reused_tokens"] == answer.chunkcache["reused_tokens"] > 0, (report, answer)
    assert answer.usage.chunkcache == counts(answer.chunkcache)
    *answer_chunks, closing = completions.create(**request, stream=True, stream_options={"include_usage": True})
    assert closing.choices == [] and closing.usage.chunkcache == counts(answer_chunks[-1].chunkcache), closing


@slow
def test_a_streamed_chat_without_a_report_is_stocks(server):
    """A request without chunks has no report: its stream ends as stock's, with a usage chunk only when asked, and
    that one is the usage of the same request not streamed."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "temperature": 0}
    chunks = streamed(server, body)
    assert chunks[-1]["choices"][0]["finish_reason"] is not None and not any(c.get("usage") for c in chunks)
    chunks = streamed(server, {**body, "stream_options": {"include_usage": True}})
    plain = requests.post(server.url + "/v1/chat/completions", json=body, timeout=600).json()["usage"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain and "chunkcache" not in plain


@slow
def test_chat_without_documents_is_stock(server):
    r = requests.post(server.url + "/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert "chunkcache" not in (r.json().get("metadata") or {}) and "chunkcache" not in r.json()["usage"]


@slow
def test_exact_chat_is_stocks_answer_and_says_so(server):
    """`exact` without documents: SGLang's own templating and prefill, reported and counted; the plain request goes
    second, so the radix tree serves it only KV that `exact` computed exactly."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "temperature": 0}
    before = metric(server, "chunkcache_exact_requests_total", '{reason="exact"}')
    exact = requests.post(server.url + "/v1/chat/completions", timeout=600, json={**body, "chunkcache": {"exact": True}})
    assert exact.status_code == 200, exact.text
    report = exact.json()["metadata"]["chunkcache"]
    assert report["exact"] is True and report["reused_tokens"] == 0, report
    assert metric(server, "chunkcache_exact_requests_total", '{reason="exact"}') == before + 1
    plain = requests.post(server.url + "/v1/chat/completions", timeout=600, json=body)
    assert exact.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]


@slow
def test_exact_chat_with_documents_is_the_plain_prompts_answer(server, default_model):
    """With documents, the prompt is chunkcache's RAG prompt; the oracle is that prompt sent without chunks."""
    from transformers import AutoTokenizer

    from chunkcache.prompt import build

    documents = docs("Quill")
    exact = chat(server, documents, max_tokens=8, chunkcache={"documents": documents, "exact": True})
    assert exact.status_code == 200, exact.text
    assert exact.json()["metadata"]["chunkcache"]["exact"] is True
    prompt = build(AutoTokenizer.from_pretrained(default_model), documents, QUESTION, system=DEFAULT_SYSTEM)
    plain = requests.post(server.url + "/generate", timeout=600, json={
        "input_ids": prompt.input_ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert exact.json()["choices"][0]["message"]["content"] == plain.json()["text"]


HISTORY = [{"role": "user", "content": "Which day does the market open?"},
           {"role": "assistant", "content": "It opens on Tuesday."},
           {"role": "user", "content": "When was the lighthouse built?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a place.", "parameters": {
    "type": "object", "properties": {"place": {"enum": ["market", "lighthouse"]}}, "required": ["place"]}}}
TOOL_TURNS = [{"role": "user", "content": "Is it raining at the market?"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                  "name": "get_weather", "arguments": "{\"place\": \"market\"}"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "light rain"},
              {"role": "user", "content": "And at the lighthouse?"}]


def prompt_ids(response) -> list[int]:
    """The prompt SGLang prefilled for a chat request sent with `return_input_ids_in_sglext`."""
    assert response.status_code == 200, response.text
    return response.json()["sglext"]["input_ids"]


def as_stock_renders(server, tokenizer, messages, documents, max_tokens=1, **extra):
    """The documents API's oracle: the same request without `chunkcache`, the documents written into the first user
    message as docs/rag-http.md says (after the default system message), rendered and tokenized by SGLang's own
    /v1/chat/completions. Returns its prompt retokenized with each document on its own, as a chunk must be (the
    text and every token outside the documents unchanged), and SGLang's answer."""
    written = DEFAULT_INSTRUCTION + "".join(doc + "\n\n" for doc in documents)
    inlined = [{"role": "system", "content": DEFAULT_SYSTEM}, {**messages[0], "content": written +
                                                                 messages[0]["content"]}, *messages[1:]]
    stock = requests.post(server.url + "/v1/chat/completions", timeout=600, json={
        "messages": inlined, "max_tokens": max_tokens, "temperature": 0, "return_input_ids_in_sglext": True, **extra})
    text = tokenizer.decode(prompt_ids(stock))
    start, spans = text.index(written) + len(DEFAULT_INSTRUCTION), []
    for doc in documents:
        spans.append((start, start + len(doc) + 2))
        start += len(doc) + 2
    encode = lambda pieces: [tokenizer.encode(p, add_special_tokens=False) for p in pieces]  # noqa: E731
    return assemble(text, spans, encode), stock.json()


@slow
def test_a_conversation_with_documents_is_stocks_prompt_and_reuses_them_in_another_order(server, default_model):
    """Three turns with documents: the prompt is SGLang's own for the same messages with the documents written into
    the first user message (each document tokenized on its own); the same conversation with the documents in
    another order reads every one from the store; with `exact` it answers what SGLang's prefill of that prompt
    answers."""
    from transformers import AutoTokenizer

    tokenizer, documents = AutoTokenizer.from_pretrained(default_model), docs("Kestrel")
    first = chat(server, documents, messages=HISTORY, return_input_ids_in_sglext=True)
    expected, _ = as_stock_renders(server, tokenizer, HISTORY, documents)
    assert prompt_ids(first) == expected.input_ids, tokenizer.decode(prompt_ids(first))
    assert first.json()["choices"][0]["message"]["content"]
    assert first.json()["chunkcache"]["chunk_misses"] == 3
    again = chat(server, documents[::-1], messages=HISTORY)
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"]
    report = again.json()["chunkcache"]
    assert (report["chunk_hits"], report["chunk_misses"]) == (3, 0) and report["reused_tokens"] > 0, report
    exact = chat(server, documents, messages=HISTORY, max_tokens=8, return_input_ids_in_sglext=True,
                 chunkcache={"documents": documents, "exact": True})
    assert exact.json()["chunkcache"]["exact"] is True and prompt_ids(exact) == expected.input_ids
    plain = requests.post(server.url + "/generate", timeout=600, json={
        "input_ids": expected.input_ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert exact.json()["choices"][0]["message"]["content"] == plain.json()["text"]


@slow
def test_documents_with_tools_and_a_tool_call_history_answer_as_stock(server, default_model):
    """`tools`, an assistant tool call and its result beside documents: the prompt is SGLang's own for those
    messages (documents written in, as above), and with `tool_choice: required` the answer is a call of the tool, as
    SGLang's answer to the same request without chunkcache is: its JSON-schema constraint holds for the documents
    API's prompt as for any. (This server has no `--tool-call-parser`, so SGLang leaves the call as the message's
    content, a JSON list, on both; with one it parses both into `tool_calls`, from the request's `tools`.)"""
    from transformers import AutoTokenizer

    tokenizer, documents = AutoTokenizer.from_pretrained(default_model), docs("Plover")
    tools = {"tools": [TOOL], "tool_choice": "required"}
    ours = chat(server, documents, messages=TOOL_TURNS, max_tokens=96, return_input_ids_in_sglext=True, **tools)
    expected, stock = as_stock_renders(server, tokenizer, TOOL_TURNS, documents, max_tokens=96, **tools)
    assert prompt_ids(ours) == expected.input_ids and ours.json()["chunkcache"]["chunk_misses"] == 3
    for answer in (ours.json(), stock):
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls"), answer
        calls = json.loads(choice["message"]["content"])
        assert [call["name"] for call in calls] == ["get_weather"], answer
        assert calls[0]["parameters"]["place"] in ("market", "lighthouse"), answer


@slow
@pytest.mark.parametrize("chunkcache, message", [
    ({"exact": "yes"}, "chunkcache: exact must be true or false, got 'yes'"),
    ({"exact": True, "selector": "mix"}, "chunkcache: selector 'mix' cannot apply with exact: true"),
    ({"exact": False, "documents": []}, "chunkcache.documents must be a non-empty list of strings, got an empty list"),
    ({"learn": 0}, "chunkcache: learn must be true or false, got 0"),
])
def test_bad_exact_is_a_400_naming_the_field(server, chunkcache, message):
    r = requests.post(server.url + "/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2, "chunkcache": chunkcache})
    assert r.status_code == 400, r.text
    assert message in r.json()["message"]


@slow
@pytest.mark.parametrize("documents, extra, message", [
    ([" "], {}, "chunkcache.documents[0] must be a non-empty string"),
    ({"a": 1}, {}, "chunkcache.documents must be a non-empty list of strings, got dict"),
    (["ok"], {"messages": [{"role": "system", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": "c"}]},
     "chunkcache.documents needs messages that start with an optional system message and a user message, whose text "
     "the documents go before; got roles ['system', 'assistant', 'user']"),
    (["ok"], {"input_ids": [1, 2, 3]}, "do not also send input_ids"),
])
def test_malformed_documents_are_a_400(server, documents, extra, message):
    r = chat(server, documents, **extra)
    assert r.status_code == 400, r.text
    assert message in r.json()["message"]


@slow
def test_ingest_then_query_hits_every_chunk_and_ingest_is_idempotent(server):
    documents = docs("Sorn")
    r = ingest(server, documents + documents[:1])
    assert r.status_code == 200, r.text
    assert r.json() == {"documents": 4, "new": 3, "existing": 1}
    query = chat(server, documents[1:] + documents[:1])
    assert query.status_code == 200, query.text
    report = query.json()["metadata"]["chunkcache"]
    assert (report["chunk_hits"], report["chunk_misses"]) == (3, 0)
    again = ingest(server, documents)
    assert again.json() == {"documents": 3, "new": 0, "existing": 3}


@slow
def test_ingest_of_a_document_over_the_prefill_budget_and_of_many_documents(server):
    """The blend's fill runs in forwards of at most the chunked-prefill size (4096 here), so no pass holds more tokens
    than SGLang planned: one document longer than that, and a burst of 300 small ones. Both are stored, and a
    query over them hits every chunk."""
    entries = " ".join(f"entry {i} holds the record of item {7 * i}." for i in range(300))
    long = "Ledger of the Varn archive. " + entries  # ~4.5K tokens
    r = ingest(server, [long])
    assert r.status_code == 200, r.text
    assert r.json() == {"documents": 1, "new": 1, "existing": 0}
    many = [f"Note {i} of the Quell register: the shelf code is {1000 + 13 * i}." for i in range(300)]
    r = ingest(server, many)
    assert r.status_code == 200, r.text
    assert r.json() == {"documents": 300, "new": 300, "existing": 0}
    query = chat(server, [many[250], many[3], many[120]])
    report = query.json()["metadata"]["chunkcache"]
    assert (report["chunk_hits"], report["chunk_misses"]) == (3, 0), report


@slow
def test_ingest_uses_the_system_message_as_the_shared_prefix(server):
    documents, system = docs("Quill"), "Answer in French."
    assert ingest(server, documents, system=system).json()["new"] == 3
    r = chat(server, documents, messages=[{"role": "system", "content": system}, {"role": "user", "content": QUESTION}])
    assert r.status_code == 200, r.text
    assert r.json()["metadata"]["chunkcache"]["chunk_hits"] == 3
    assert ingest(server, documents).json()["new"] == 3  # the default system prompt is another prefix


@slow
@pytest.mark.parametrize("body, message", [
    ({"documents": []}, "ingest.documents must be a non-empty list of strings"),
    ({"documents": ["ok"], "selector": "epic"}, "unknown key(s) 'selector' in ingest; allowed: 'documents', 'system', 'namespace'"),
    ({"documents": ["ok"], "system": 3}, "ingest.system must be a non-empty string, got int 3"),
])
def test_malformed_ingest_is_a_400(server, body, message):
    r = requests.post(server.url + "/chunkcache/ingest", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


@slow
def test_ingest_command(server, tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    documents = docs("Vell")
    path.write_text(json.dumps(documents[0]) + "\n\n" + "".join(json.dumps({"text": d}) + "\n" for d in documents[1:]))
    assert cli.main(["ingest", str(path), "--url", server.url, "--batch-size", "2"]) == 0
    assert "3 documents: 3 new, 0 already stored" in capsys.readouterr().out
    assert cli.main(["ingest", str(path), "--url", server.url]) == 0
    assert "3 documents: 0 new, 3 already stored" in capsys.readouterr().out
    path.write_text('{"title": "no text"}\n')
    assert cli.main(["ingest", str(path), "--url", server.url]) == 2
    assert f'{path}:1: expected a JSON string or an object with a non-empty "text"' in capsys.readouterr().err
