"""Frontend RAG primitives (sglang_patch.lang): chunk tracking in SGLang's interpreter, token assembly, and the
example program against the session's live server."""

import importlib.util
import re
from pathlib import Path

import pytest
import requests
import sglang as sgl
from sglang.lang.backend.base_backend import BaseBackend
from sglang.srt.plugins.hook_registry import HookRegistry
from transformers import AutoTokenizer

from chunkcache.hints import find_payload, parse
from chunkcache.prompt import assemble
from sglang_patch import lang

ROOT = Path(__file__).resolve().parents[1]

DOCS = ["Paris is the capital of France.", "Bern is the capital of Switzerland.", "Rome is in Italy; 2,000 years."]


class Recorder(BaseBackend):
    """A backend that answers "ok" and records each generate's text and chunk spans."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def generate(self, s, sampling_params):
        self.calls.append((s.text_, list(lang.chunk_spans(s))))
        return "ok", {}


@sgl.function
def forked_qa(s, docs, questions):
    s += sgl.system("Be brief.")
    s += sgl.user("Documents:\n\n" + lang.documents(docs) + "Answer from the documents.")
    s += sgl.assistant("Sure.")
    forks = s.fork(len(questions))
    for f, q in zip(forks, questions):
        f += sgl.user(q)
        f += sgl.assistant(sgl.gen("answer", max_tokens=4, temperature=0))
    forks.join()
    s += "Done. " + lang.chunk("A chunk of its own.") + " Summary:" + sgl.gen("tail", max_tokens=4, temperature=0)


def test_chunks_are_tracked_through_roles_and_forks():
    backend = Recorder()
    state = forked_qa.run(docs=DOCS, questions=["Q1?", "Q2?"], backend=backend)
    assert state["answer"] == ["ok", "ok"] and state["tail"] == "ok"
    *forks, (tail, spans3) = backend.calls  # the forks run in threads of their own, in either order
    (fork1, spans1), (fork2, spans2) = sorted(forks, key=lambda call: call[0].endswith("Q2?\nASSISTANT:"))
    assert [fork1[s:e] for s, e in spans1] == [d + "\n\n" for d in DOCS]
    assert spans1 == spans2 and fork1.endswith("Q1?\nASSISTANT:") and fork2.endswith("Q2?\nASSISTANT:")
    assert [tail[s:e] for s, e in spans3] == [d + "\n\n" for d in DOCS] + ["A chunk of its own."]


def test_hooks_installed_by_the_plugin_loader_and_by_the_first_chunk_record_each_chunk_once():
    """A process that runs SGLang's plugin loader (an in-process Engine) installs the interpreter's hooks from
    plugin.hooks(), and its first chunk installs them too: either way round, one wrapper."""
    for target, hook, kind in lang.hooks():  # what load_plugins() does with the plugin's table
        HookRegistry.register(target, hook, kind)
    HookRegistry.apply_hooks()
    test_chunks_are_tracked_through_roles_and_forks()


@pytest.mark.parametrize("docs, message", [
    ([], "documents() needs a non-empty list of strings"),
    ("one string", "documents() needs a non-empty list of strings"),
    (["ok", "  "], "documents[1] must be a non-empty string"),
    (["ok", 3], "documents[1] must be a non-empty string"),
])
def test_documents_rejects_what_is_not_a_list_of_texts(docs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        lang.documents(docs)


@pytest.fixture(scope="module")
def tok(default_model):
    return AutoTokenizer.from_pretrained(default_model)


def test_assemble_tokenizes_each_chunk_on_its_own(tok):
    encode = lambda pieces: [tok.encode(p, add_special_tokens=False) for p in pieces]  # noqa: E731
    texts = []
    for order in (DOCS, DOCS[::-1]):
        head = "<|im_start|>user\nDocuments:"  # no separator: a joint tokenization would merge across the seam
        text, spans = head, []
        for doc in order:
            spans.append((len(text), len(text) + len(doc)))
            text += doc
        texts.append((text + "Where is Bern?", spans))
    prompts = [assemble(text, spans, encode, head=[7]) for text, spans in texts]
    for (text, spans), p in zip(texts, prompts):
        assert p.input_ids[0] == 7 and tok.decode(p.input_ids[1:]) == text
        assert [p.input_ids[s:e] for s, e in p.token_spans] == encode([text[s:e] for s, e in spans])
        assert parse(find_payload(p.kv_hints()), len(p.input_ids)).token_spans == tuple(p.token_spans)
    a, b = ([p.input_ids[s:e] for s, e in p.token_spans] for p in prompts)
    assert a == b[::-1]


def test_assemble_leaves_a_chunk_that_ends_the_prompt_as_text(tok):
    encode = lambda pieces: [tok.encode(p, add_special_tokens=False) for p in pieces]  # noqa: E731
    text = "Q: " + DOCS[0] + DOCS[1]
    p = assemble(text, [(3, 3 + len(DOCS[0])), (3 + len(DOCS[0]), len(text))], encode)
    assert len(p.token_spans) == 1 and tok.decode(p.input_ids[slice(*p.token_spans[0])]) == DOCS[0]
    with pytest.raises(ValueError, match="sorted, disjoint"):
        assemble(text, [(5, 9), (7, 12)], encode)


# Live server tests (the session's shared `server` fixture).


def load_example():
    spec = importlib.util.spec_from_file_location("rag_qa", ROOT / "examples" / "rag_qa.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_example_reuses_documents_in_another_order(server):
    _, second = load_example().main(["--url", server.url, "--max-tokens", "6", "--selector", "epic",
                                     "Who built the Amber lighthouse?"])
    assert second["chunk_hits"] == 3 and second["chunk_misses"] == 0 and second["selector"] == "epic"


@pytest.mark.slow
def test_forked_program_and_plain_program_on_the_server(server):
    backend = lang.ChunkcacheEndpoint(server.url, selector="epic", chat_template_name="chatml")
    state = forked_qa.run(docs=DOCS, questions=["Where is Bern?", "Where is Rome?"], backend=backend)
    assert state.error() is None and all(state["answer"]) and state["tail"]
    # fork() prefilled the shared part (documents included) under the chunk hint, so the radix tree serves the
    # documents of the last request exactly: only its new chunk is blended and reported
    report = state.get_meta_info("tail")["chunkcache"]
    assert report["chunk_hits"] + report["chunk_misses"] == 1

    @sgl.function
    def plain(s):
        s += "The capital of France is" + sgl.gen("x", max_tokens=4, temperature=0)

    state = plain.run(backend=backend)
    stock = requests.post(server.url + "/generate", timeout=300, json={
        "text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert state["x"] == stock["text"] and "chunkcache" not in state.get_meta_info("x")


@pytest.mark.slow
def test_select_and_streamed_gen_with_chunks(server):
    @sgl.function
    def ask(s, docs):
        s += sgl.user("Documents:\n\n" + lang.documents(docs) + "Does the market open on Tuesday? Answer yes or no.")
        s += sgl.assistant(sgl.select("yn", choices=["yes", "no"]) + " " + sgl.gen("why", max_tokens=4, temperature=0))

    backend = lang.ChunkcacheEndpoint(server.url, selector="epic", chat_template_name="chatml")
    docs = ["The Amber market opens every Tuesday at dawn.", "The river Vell flows north through Amber."]
    state = ask.run(docs=docs, backend=backend, stream=True)
    assert "".join(state.text_iter("why")) and state["yn"] in ("yes", "no")
    report = state.get_meta_info("why")["chunkcache"]  # sent with the first streamed chunk, kept to the end
    assert report["chunk_hits"] + report["chunk_misses"] == 2
