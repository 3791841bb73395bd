"""The blend-or-full choice in the server (select.full_when_slower, chunkcache/blend/cost.py): a request whose chunks
are all stored is priced both ways at this host's measured rates, scaled by what the server's own forwards took."""

import pytest
from conftest import WORDS, Rag, gen, hints, sglang_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(default_model, tmp_path_factory):
    with sglang_engine(default_model, tmp_path_factory.mktemp("cfg"), "select:\n  full_when_slower: true\n",
                       max_total_tokens=6000) as eng:
        yield eng


@pytest.fixture(scope="module")
def rag(default_model):
    from transformers import AutoTokenizer

    return Rag(AutoTokenizer.from_pretrained(default_model), n_docs=4, words=300)


def test_a_blend_predicted_slower_is_computed_in_full_and_says_so(engine, default_model):
    """Chunks of a few tokens before a question: prophet's query pass (the question's last tokens through every layer,
    chunkcache.select.base.QUERY_PASS_TOKENS) costs more than the chunk tokens the blend would not compute, so the
    server computes the prompt in full once its chunks are stored (a request with a missing chunk blends: it stores
    the chunk), with stock's output."""
    from transformers import AutoTokenizer

    rag = Rag(AutoTokenizer.from_pretrained(default_model), n_docs=2, words=4, seed=1)
    question = "Read this note first: " + " ".join(WORDS[i % len(WORDS)] for i in range(70)) + ". Code of doc 1?"
    ids, spans = rag.build([0, 1], question)
    first = gen(engine, ids, hints(spans, selector="prophet", namespace="slower"), n=4)["meta_info"]["chunkcache"]
    assert first["chunk_misses"] == 2 and "choice" not in first  # it stores the chunks: blended, no choice made
    ids, spans = rag.build([1, 0], question)  # no radix match past the system prefix
    out = gen(engine, ids, hints(spans, selector="prophet", namespace="slower"), n=4)
    info = out["meta_info"]["chunkcache"]
    assert info["fallback"] == "predicted_slower" and info["choice"] == "full", info
    assert info["predicted_blend_s"] > info["predicted_full_s"]
    assert out["output_ids"] == gen(engine, ids, n=4)["output_ids"]


def test_a_request_mostly_reused_blends_and_reports_both_predictions(engine, rag):
    ids, spans = rag.build([0, 3, 2], "Code of document 3?")
    gen(engine, ids, hints(spans, selector="epic", namespace="faster"), n=1)  # stores the chunks
    ids, spans = rag.build([3, 2, 0], "Code of document 3?")
    info = gen(engine, ids, hints(spans, selector="epic", namespace="faster"), n=1)["meta_info"]["chunkcache"]
    assert "fallback" not in info and info["choice"] == "blend", info
    assert info["predicted_blend_s"] < info["predicted_full_s"]
