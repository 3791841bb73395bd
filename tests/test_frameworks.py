"""The frameworks people use, for real: LangChain (`ChatOpenAI` and a stuff-documents chain), LlamaIndex
(`OpenAILike` and a `SummaryIndex` query engine; examples/langchain_rag.py and examples/llamaindex_rag.py are these
clients) and the `openai` package, each against one chunkcache server with automatic chunk detection. A second query
over the same documents in another order gets chunk hits, and `{"chunkcache": {"exact": true}}` passed through the
client's own extra-body mechanism gets stock's greedy answer. Each client reads the report's counts where it keeps an
answer's usage (`usage.chunkcache`), the `openai` package the whole report as the answer's `chunkcache` too, and
LangChain's `generate()` over several message lists sums the counts without a warning. Each test uses documents of its
own: what a request finds depends on what the store already holds."""

import ast
import importlib.util
import json
import sys
import warnings

import pytest
import requests
from chunkbench.workloads import DEFAULT_MUSIQUE
from conftest import ROOT, start_server
from transformers import AutoTokenizer

from sglang_patch.http.usage import COUNTS, counts

pytestmark = pytest.mark.slow
DATA = DEFAULT_MUSIQUE
CLIENTS = ["langchain", "llamaindex", "openai"]


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory, default_model):
    # the answers' usage then says SGLang's cached tokens (`prompt_tokens_details.cached_tokens`)
    srv = start_server(tmp_path_factory.mktemp("frameworks") / "server.log", "--auto-chunks", "--enable-cache-report")
    yield srv
    srv.stop()


def documents(record: int, words: int = 100) -> list[str]:
    """The first four MuSiQue passages of `record` (records 47-53 share none) cut to `words` words: ~600-token
    prompts."""
    return [" ".join(c["text"].split()[:words]) for c in json.loads(DATA.read_text())[record]["ctxs"][:4]]


def prompt(docs: list[str], question: str) -> str:
    context = "\n\n".join(docs)
    return f"Answer from the context:\n\n{context}\n\nQuestion: {question}"


def ask_openai(url: str, docs: list[str], question: str, max_tokens: int = 32, exact: bool = False):
    """The openai package's answer and usage (whose extra fields keep the report's counts, `chunkcache`); the whole
    report, the answer's own extra field, is checked to have those counts."""
    from openai import OpenAI

    response = OpenAI(base_url=url + "/v1", api_key="none").chat.completions.create(
        model="default", temperature=0, max_tokens=max_tokens,
        extra_body={"chunkcache": {"exact": True}} if exact else None,
        messages=[{"role": "user", "content": prompt(docs, question)}])
    report = (response.model_extra or {}).get("chunkcache")  # none for an answer without chunks (stock's)
    assert (counts(report) if report else None) == (response.usage.model_extra or {}).get("chunkcache"), response
    return response.choices[0].message.content, response.usage.model_dump()


def example(name: str):
    """examples/NAME_rag.py, imported when a test runs (the fast tier collects this file without importing the
    frameworks), with the examples' folder on the path as when a script there runs (examples/server_state.py)."""
    if str(ROOT / "examples") not in sys.path:
        sys.path.append(str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location(f"{name}_rag", ROOT / "examples" / f"{name}_rag.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # pydantic resolves its annotations there
    spec.loader.exec_module(module)
    return module


def client(name: str):
    """`ask(url, docs, question, max_tokens, exact) -> (answer, its usage as the client keeps it)` through that
    client."""
    return ask_openai if name == "openai" else example(name).ask


@pytest.mark.parametrize("name, record", zip(CLIENTS, (47, 48, 49)))
def test_a_second_query_in_another_order_gets_chunk_hits(auto_server, default_model, name, record):
    ask, docs = client(name), documents(record)
    _, first = ask(auto_server.url, docs, "Which country is mentioned first?", max_tokens=4)
    assert first["chunkcache"]["chunk_hits"] == first["chunkcache"]["reused_tokens"] == 0, first
    idle(auto_server)
    _, second = ask(auto_server.url, [docs[i] for i in (2, 0, 3, 1)], "Which year is mentioned?", max_tokens=4)
    report = second["chunkcache"]
    assert set(report) == set(COUNTS) and report["chunk_hits"] > 0, report
    # all of the documents' KV is stored but the selector's 15 %
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    assert report["reused_tokens"] >= 0.6 * sum(len(tokenizer.encode(d, add_special_tokens=False)) for d in docs)


def idle(server) -> None:
    """Wait until the server has encoded the paragraphs its requests taught it (it learns when idle)."""
    from chunkbench.serving.http_client import wait_measured

    wait_measured(lambda: requests.get(server.url + "/server_info", timeout=30).json(), 300)


def flushed(server):
    """The server with an empty radix tree (the chunk store is kept): a request then computes its whole prompt. The
    scheduler may still be busy with the last request after its answer was sent (storing what it learned): SGLang
    waits up to `timeout` seconds for it to go idle."""
    requests.post(server.url + "/flush_cache", params={"timeout": 60}, timeout=120).raise_for_status()
    return server


@pytest.mark.parametrize("name, record", zip(CLIENTS, (51, 52, 53)))
def test_exact_gets_stocks_answer(auto_server, server, name, record):
    """`exact` on a prompt whose documents are all stored (a query in another order put them there): computed with
    SGLang's own prefill, it answers what stock answers, the session's server without detection. Both sides compute
    the whole prompt in one forward from an empty radix tree: a prompt split differently between a cached prefix and
    the forward may round differently in bfloat16."""
    ask, docs, question = client(name), documents(record), "Which year is mentioned?"
    ask(auto_server.url, docs[::-1], "Which country is mentioned first?", max_tokens=1)
    answer, usage = ask(flushed(auto_server).url, docs, question, max_tokens=16, exact=True)
    report = usage["chunkcache"]
    assert report["chunk_hits"] == report["reused_tokens"] == 0, report
    assert report["recomputed_tokens"] == usage["prompt_tokens"]
    assert answer == ask(flushed(server).url, docs, question, max_tokens=16)[0]


@pytest.mark.parametrize("name", ["langchain", "llamaindex"])
def test_the_example_prints_each_answer_with_its_report(auto_server, name, capsys):
    """The example's second query, its documents in reverse order, prints a report with chunk hits: the report the
    framework's own response object carries (the examples hook no HTTP client)."""
    reports = example(name).main([auto_server.url, "--max-tokens", "4"])
    printed = [ast.literal_eval(line.removeprefix("chunks: ")) for line in capsys.readouterr().out.splitlines()
               if line.startswith("chunks: ")]
    assert printed == reports and len(reports) == 2
    assert reports[1]["chunk_hits"] > 0 and reports[1]["reused_tokens"] > 0


def complete(url: str, endpoint: str, docs: list[str], stream: bool) -> tuple[dict, dict]:
    """The usage and the report of a chat or text completion through the openai package: the answer's; streamed
    (asking for usage), the usage of the stream's last chunk, which must be the only one with usage and have no
    choices, and the report of the chunk that finishes the answer."""
    from openai import OpenAI

    client, question = OpenAI(base_url=url + "/v1", api_key="none"), "Which year is mentioned?"
    asked = {"stream_options": {"include_usage": True}} if stream else {}
    if endpoint == "chat":
        answer = client.chat.completions.create(model="default", temperature=0, max_tokens=4, stream=stream,
                                                messages=[{"role": "user", "content": prompt(docs, question)}],
                                                **asked)
    else:
        answer = client.completions.create(model="default", temperature=0, max_tokens=4, stream=stream,
                                           prompt=prompt(docs, question), **asked)
    if not stream:
        return answer.usage.model_dump(), answer.chunkcache
    chunks = list(answer)
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1]), chunks
    return chunks[-1].usage.model_dump(), chunks[-2].model_extra["chunkcache"]


@pytest.mark.parametrize("endpoint, record", [("chat", 54), ("completions", 55)])
def test_the_report_is_in_usage_streamed_and_not(auto_server, endpoint, record):
    """The report as the answer's `chunkcache` and its counts as `usage.chunkcache`, on /v1/chat/completions and
    /v1/completions, in the answer and in a stream's finishing and last chunks: a query over documents a first one
    stored gets chunk hits, and `cached_tokens` stays SGLang's exact prefix, which from an empty radix tree is
    nothing, however many tokens the blend reused."""
    docs = documents(record)
    _, first = complete(auto_server.url, endpoint, docs, stream=False)
    assert first["auto"] is True and first["chunk_hits"] == 0 and first["learned"]["segments"] > 0
    idle(auto_server)
    answers = [complete(flushed(auto_server).url, endpoint, [docs[i] for i in (2, 0, 3, 1)], stream)
               for stream in (False, True)]
    for usage, report in answers:
        assert report["auto"] is True and report["chunk_hits"] > 0 and report["reused_tokens"] > 0, report
        assert usage["chunkcache"] == counts(report), usage
        assert usage["prompt_tokens_details"]["cached_tokens"] == report["radix_tokens"] == 0, usage
    assert answers[0][0]["prompt_tokens"] == answers[1][0]["prompt_tokens"]


def test_langchain_generate_and_batch_over_several_conversations_with_documents(server):
    """LangChain's `generate()` over several message lists sums their answers' `usage` (`_combine_llm_outputs`):
    with the report's counts there it neither warns nor raises, the sum of the counts is its `llm_output`'s, and
    each generation keeps its own counts in `response_metadata["token_usage"]`, as every reply of `batch()` does.
    The documents API, through ChatOpenAI's `extra_body`, with a question and with a conversation. The session's
    server (no `--enable-cache-report`: SGLang's `prompt_tokens_details`, read by the openai package with an
    `audio_tokens: null`, would warn in that sum whatever chunkcache sends)."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    docs = documents(56)
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="default", temperature=0, max_tokens=4,
                     extra_body={"chunkcache": {"documents": docs}})
    conversations = [[HumanMessage("Which country is mentioned first?")],
                     [SystemMessage("Answer in one word."), HumanMessage("Which country is mentioned first?"),
                      AIMessage("France."), HumanMessage("Which year is mentioned?")]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = llm.generate(conversations)
        replies = llm.batch(conversations)
    assert not [w for w in caught if "token usage" in str(w.message)], [str(w.message) for w in caught]
    reports = [generation[0].message.response_metadata["token_usage"]["chunkcache"]
               for generation in result.generations]
    assert reports[0]["chunk_misses"] == 4 and all(set(r) == set(COUNTS) for r in reports), reports
    assert result.llm_output["token_usage"]["chunkcache"] == {k: sum(r[k] for r in reports) for k in COUNTS}
    # the second conversation's system message is another prefix: its chunks are computed after it
    assert reports[1]["chunk_misses"] == 4, reports
    for reply in replies:
        report = reply.response_metadata["token_usage"]["chunkcache"]
        assert report["chunk_hits"] + report["radix_tokens"] > 0 and report["chunk_misses"] == 0, report
