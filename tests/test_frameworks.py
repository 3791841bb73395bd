"""The frameworks people use, for real: LangChain (`ChatOpenAI` and a stuff-documents chain), LlamaIndex
(`OpenAILike` and a `SummaryIndex` query engine; examples/langchain_rag.py and examples/llamaindex_rag.py are these
clients) and the `openai` package, each against one chunkcache server with automatic chunk detection. A second query
over the same documents in another order gets chunk hits, and `{"chunkcache": {"exact": true}}` passed through the
client's own extra-body mechanism gets stock's greedy answer. Each test uses documents of its own: what a request finds
depends on what the store already holds."""

import importlib.util
import json

import pytest
import requests
from conftest import ROOT, start_server
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow
DATA = ROOT.parent / "shared" / "data" / "musique_dev.json"
CLIENTS = ["langchain", "llamaindex", "openai"]


@pytest.fixture(scope="module")
def auto_server(tmp_path_factory, default_model):
    srv = start_server(tmp_path_factory.mktemp("frameworks") / "server.log", "--auto-chunks")
    yield srv
    srv.stop()


def documents(record: int, words: int = 100) -> list[str]:
    """The first four MuSiQue passages of `record` (records 47-53 share none) cut to `words` words: ~600-token
    prompts."""
    return [" ".join(c["text"].split()[:words]) for c in json.loads(DATA.read_text())[record]["ctxs"][:4]]


def ask_openai(url: str, docs: list[str], question: str, max_tokens: int = 32, exact: bool = False):
    """The openai package's answer and response (whose extra fields keep the server's `metadata`)."""
    from openai import OpenAI

    context = "\n\n".join(docs)
    response = OpenAI(base_url=url + "/v1", api_key="none").chat.completions.create(
        model="default", temperature=0, max_tokens=max_tokens,
        extra_body={"chunkcache": {"exact": True}} if exact else None,
        messages=[{"role": "user", "content": f"Answer from the context:\n\n{context}\n\nQuestion: {question}"}])
    return response.choices[0].message.content, response.model_dump()


def client(name: str):
    """`ask(url, docs, question, max_tokens, exact) -> (answer, the server's JSON response)` through that client,
    imported when a test runs (the fast tier collects this file without importing the frameworks)."""
    if name == "openai":
        return ask_openai
    spec = importlib.util.spec_from_file_location(f"{name}_rag", ROOT / "examples" / f"{name}_rag.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ask


@pytest.mark.parametrize("name, record", zip(CLIENTS, (47, 48, 49)))
def test_a_second_query_in_another_order_gets_chunk_hits(auto_server, default_model, name, record):
    ask, docs = client(name), documents(record)
    _, first = ask(auto_server.url, docs, "Which country is mentioned first?", max_tokens=4)
    report = first["metadata"]["chunkcache"]
    assert report["auto"] is True and report["chunk_hits"] == 0 and report["learned"]["segments"] > 0
    _, second = ask(auto_server.url, [docs[i] for i in (2, 0, 3, 1)], "Which year is mentioned?", max_tokens=4)
    report = second["metadata"]["chunkcache"]
    assert report["auto"] is True and "fallback" not in report and report["chunk_hits"] > 0
    # all of the documents' KV is stored but the first 128 tokens after the radix match (auto.exact_lead_tokens) and
    # the selector's 15 %: ~0.7 of their ~600 tokens at most
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    assert report["reused_tokens"] >= 0.6 * sum(len(tokenizer.encode(d, add_special_tokens=False)) for d in docs)


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
    answer, response = ask(flushed(auto_server).url, docs, question, max_tokens=16, exact=True)
    report = response["metadata"]["chunkcache"]
    assert report.get("exact") is True and report["chunk_hits"] == report["reused_tokens"] == 0, report
    assert report["recomputed_tokens"] == response["usage"]["prompt_tokens"]
    assert answer == ask(flushed(server).url, docs, question, max_tokens=16)[0]
