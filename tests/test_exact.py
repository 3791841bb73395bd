"""`exact: true` and `selector: full` are SGLang's own prefill: stock's greedy tokens bit for bit, in bfloat16 (where
the blend's own kernels round differently from SGLang's), on both real models; and `cached_tokens` counts only the
radix tree's exact prefix, never a blend's reused chunk tokens."""

import pytest
import transformers
from conftest import Rag, flush, gen, hints, sglang_engine

from chunkcache.models import resolve_model

pytestmark = pytest.mark.slow
LAYOUTS = ([0, 1, 2, 3], [3, 1, 0, 2])


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma-3-270m"])
def served(request, tmp_path_factory):
    model = resolve_model(request.param)
    rag = Rag(transformers.AutoTokenizer.from_pretrained(model), n_docs=4, words=120)
    with sglang_engine(model, tmp_path_factory.mktemp("cfg"), "select:\n  selector: mix\n", max_total_tokens=6000,
                       dtype="bfloat16") as engine:
        yield engine, rag


def fresh(engine, ids, kv_hints=None) -> dict:
    """The request computed from an empty radix tree: each side below computes the whole prompt itself."""
    flush(engine)
    return gen(engine, ids, kv_hints, n=12)


@pytest.mark.parametrize("options", [{"exact": True}, {"selector": "full"}])
def test_exact_requests_are_stocks_tokens_in_bfloat16(served, options):
    engine, rag = served
    for k, order in enumerate(LAYOUTS):
        ids, spans = rag.build(order, f"What is the code of document {order[k]}?")
        # the store holds every chunk of the prompt (a blend in another order put them there): not read
        warm_ids, warm_spans = rag.build(order[::-1], "Which documents are there?")
        warm = gen(engine, warm_ids, hints(warm_spans, namespace="exact"), n=1)
        assert warm["meta_info"]["chunkcache"]["selector"] == "mix"
        exact = fresh(engine, ids, hints(spans, namespace="exact", **options))
        stock = fresh(engine, ids)
        assert exact["output_ids"] == stock["output_ids"], (order, exact["text"], stock["text"])
        info = exact["meta_info"]["chunkcache"]
        assert info["exact"] is True and info["reason"] == ("exact" if "exact" in options else "selector_full")
        assert (info["chunk_hits"], info["reused_tokens"], info["radix_tokens"]) == (0, 0, 0), info
        assert info["recomputed_tokens"] == len(ids) == exact["meta_info"]["prompt_tokens"]


def test_cached_tokens_never_count_blended_tokens(served):
    engine, rag = served
    ids, spans = rag.build([1, 2, 3], "What is the code of document 2?")
    gen(engine, ids, hints(spans, namespace="cached"), n=1)
    ids, spans = rag.build([3, 2, 1], "What is the code of document 3?")
    meta = gen(engine, ids, hints(spans, namespace="cached"), n=1)["meta_info"]
    info = meta["chunkcache"]
    assert info["chunk_hits"] == 3 and info["reused_tokens"] > 0, info
    assert meta["cached_tokens"] == info["radix_tokens"] < spans[0][1]  # the shared prefix, at most into chunk 1
