"""Chunk reuse under tensor parallelism: SGLang's CPU engine with --tp-size 2 over gloo, on a tiny random-weight
model whose heads split evenly, against the same model on one rank (the oracle: every decision that fixes a forward's
rows agreed over the ranks, the selection features reduced over all heads, so two ranks blend as one does)."""

import json
import random

import pytest
import transformers
from conftest import Rag, gen, hints, sglang_engine

from chunkcache.models import tiny_model

pytestmark = pytest.mark.slow
SELECTORS = ["epic", "prophet", "cacheblend", "mix"]
CONFIG = "select:\n  ratio: 0.15\n"


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.1, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def rag(default_model):
    return Rag(transformers.AutoTokenizer.from_pretrained(default_model), n_docs=5, words=60)


def _serve(model, tmp_path_factory, tp_size, prompts):
    """Every prompt's greedy answer and report: plain (stock's forward), then with each selector, then ratio 1."""
    out = {}
    with sglang_engine(model, tmp_path_factory.mktemp(f"tp{tp_size}"), CONFIG, max_total_tokens=4000,
                       dtype="float32", tp_size=tp_size) as engine:
        for k, (ids, spans) in enumerate(prompts):
            out["stock", k] = gen(engine, ids)
            for selector in SELECTORS:
                out[selector, k] = gen(engine, ids, hints(spans, selector=selector, namespace=f"{selector}-{k}"))
            out["full", k] = gen(engine, ids, hints(spans, selector="epic", ratio=1.0, namespace=f"full-{k}"))
    return out


@pytest.fixture(scope="module")
def prompts(rag):
    rng = random.Random(3)
    return [rag.build(order, f"What is the code of document {order[1]}?")
            for order in (rng.sample(range(5), 4) for _ in range(3))]


@pytest.fixture(scope="module")
def served(model, tmp_path_factory, prompts):
    return {tp: _serve(model, tmp_path_factory, tp, prompts) for tp in (2, 1)}


def test_a_blend_recomputing_every_token_on_two_ranks_equals_stock_on_two_ranks(served, prompts):
    two = served[2]
    for k in range(len(prompts)):
        info = two["full", k]["meta_info"]["chunkcache"]
        assert "fallback" not in info and info["reused_tokens"] == 0, info
        assert two["full", k]["output_ids"] == two["stock", k]["output_ids"], k
    assert len({json.dumps(two["stock", k]["output_ids"]) for k in range(len(prompts))}) > 1  # answers differ


@pytest.mark.parametrize("selector", SELECTORS)
def test_two_ranks_blend_as_one_rank_does(served, prompts, selector):
    """The same count of tokens recomputed and reused, and the same greedy answer as the one-rank server: a rank that
    picked other tokens than its peer would all-reduce rows of different tokens and answer otherwise."""
    for k in range(len(prompts)):
        one, two = served[1][selector, k], served[2][selector, k]
        info1, info2 = one["meta_info"]["chunkcache"], two["meta_info"]["chunkcache"]
        assert "fallback" not in info2 and info2["selector"] == selector, info2
        assert 0 < info2["recomputed_tokens"] < len(prompts[k][0]), info2
        for field in ("recomputed_tokens", "reused_tokens", "chunk_hits", "ratio"):
            assert info2[field] == info1[field], (field, info1, info2)
        assert two["output_ids"] == one["output_ids"], (selector, k)
