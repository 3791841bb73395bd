"""The blend-or-full choice in the server (select.full_when_slower, chunkcache/blend/cost.py): a request whose chunks
are all stored is priced both ways at this host's measured rates, scaled by what the server's own forwards took."""

import pytest
from conftest import WORDS, Rag, flush, gen, hints, sglang_engine

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


def test_a_short_prompts_blend_pays_a_forwards_fixed_time_and_is_computed_in_full(default_model, tmp_path):
    """Two ~40-token passages and a short question: at the rates alone blending looks faster (it skips most of the
    passages' tokens), but every forward also takes a fixed time (SGLang's Python per layer, the scheduler) and the
    blend runs two (its query pass and its recompute) where a full prefill runs one. The server reads that time off
    its blends' query passes (chunkcache.blend.cost.Calibration); once it has, such a request is computed in full,
    with stock's output."""
    from transformers import AutoTokenizer

    from chunkcache.blend.cost import Calibration

    rag = Rag(AutoTokenizer.from_pretrained(default_model), n_docs=2, words=30, seed=3)
    ids, spans = rag.build([0, 1], "Code of document 1?")
    # a server of its own: one that has seen no forward yet; a wide margin, so that a noisy host's timings of the
    # blend's few forwards cannot make the fitted blend look enough faster (the blend is ~0.8x stock's speed here)
    margin = 0.3
    with sglang_engine(default_model, tmp_path, f"select:\n  full_when_slower: true\n  blend_margin: {margin}\n",
                       max_total_tokens=6000) as eng:
        gen(eng, ids, hints(spans), n=4)  # stores the chunks
        reports = []
        for _ in range(6):
            flush(eng)  # no radix match: the chunks come from the store each time
            reports.append(gen(eng, ids, hints(spans), n=4)["meta_info"]["chunkcache"])
        first = reports[0]  # before the server had seen any of its blends' forwards: the rates alone
        assert first["chunk_hits"] == 2 and first["choice"] == "blend", first
        assert first["predicted_blend_s"] < first["predicted_full_s"], first
        state = eng.get_server_info()["internal_states"][0]["chunkcache"]["calibration"]
        assert state["fixed_s"] > 0 and state["observed"]["probe"] >= Calibration.MIN_OBSERVED, state
        flush(eng)
        out = gen(eng, ids, hints(spans), n=4)
        info = out["meta_info"]["chunkcache"]
        assert info["fallback"] == "predicted_slower", info  # predicted slower, or faster by less than the margin
        assert info["predicted_blend_s"] >= (1 - margin) * info["predicted_full_s"], info
        assert out["output_ids"] == gen(eng, ids, n=4)["output_ids"]
