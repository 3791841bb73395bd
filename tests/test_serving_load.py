"""Chunk reuse under serving conditions: prompts longer than the prefill budget, hinted requests that together
exceed it, blended prefills in one batch with running decodes. Oracle: stock SGLang's output on the same engine
(requests without hints take SGLang's own path, untouched)."""

import asyncio
import random

import pytest
from conftest import Rag, gen, hints, sglang_engine

pytestmark = pytest.mark.slow
CONTEXT = 8192  # the default model's context length


@pytest.fixture(scope="module")
def engine(default_model, tmp_path_factory):
    # SGLang's own chunked-prefill size (not overridden), and mixed chunks: running decodes join prefill batches.
    # float32: the oracle is equality with stock's greedy tokens, and in bfloat16 two correct attention kernels
    # (SGLang's decode, the blend's pass over a mixed batch) round differently enough to flip a near-tie (seen: a
    # plain decode row of a mixed batch diverged from stock at its 21st token)
    with sglang_engine(default_model, tmp_path_factory.mktemp("cfg"), "select:\n  selector: prophet\n  ratio: 0.15\n",
                       max_total_tokens=40000, enable_mixed_chunk=True, dtype="float32") as eng:
        yield eng


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


def budget(engine) -> int:
    return engine.get_server_info()["chunked_prefill_size"]


def report(out) -> dict:
    info = out["meta_info"]["chunkcache"]
    assert "fallback" not in info, info
    return info


def test_a_prompt_longer_than_the_prefill_budget_is_blended(engine, tokenizer):
    long = Rag(tokenizer, n_docs=16, words=445, seed=7)
    order = list(range(16))
    ids, spans = long.build(order, "What is the code of document 11?")
    assert budget(engine) < 7000 < len(ids) < CONTEXT - 16
    stock = gen(engine, ids, n=8)
    # every chunk misses: the fill computes them standalone in forwards of at most the budget, then all is recomputed
    full = gen(engine, ids, hints(spans, selector="epic", ratio=1.0, namespace="long"), n=8)
    info = report(full)
    assert info["chunk_misses"] == 16 and info["batch"]["forwards"] >= 3  # >= 2 fill forwards + the recompute
    assert full["output_ids"] == stock["output_ids"], (full["text"], stock["text"])
    # the same documents in another order: every chunk a hit, a sixth of the prompt recomputed, one batch
    random.Random(0).shuffle(order)
    ids, spans = long.build(order, "What is the code of document 11?")
    info = report(gen(engine, ids, hints(spans, selector="prophet", ratio=0.15, namespace="long"), n=8))
    assert info["chunk_hits"] == 16 and info["chunk_misses"] == 0
    assert info["recomputed_tokens"] < len(ids) / 5


def test_hinted_requests_over_the_budget_together_are_admitted_in_one_batch(engine, tokenizer):
    rag = Rag(tokenizer, n_docs=12, words=160, seed=3)
    rng = random.Random(5)
    orders = [rng.sample(range(12), 6) for _ in range(5)]
    for start in (0, 6):  # warm-up: every document into the chunk store
        ids, spans = rag.build(list(range(start, start + 6)), "Which documents are these?")
        report(gen(engine, ids, hints(spans, selector="none", namespace="batch"), n=1))
    prompts = [rag.build(order, f"What is the code of document {order[2]}?") for order in orders]
    assert sum(len(ids) for ids, _ in prompts) > budget(engine)  # charged their length, SGLang would split them
    outs = engine.generate(input_ids=[ids for ids, _ in prompts], sampling_params={"max_new_tokens": 4, "temperature": 0},
                           kv_hints=[hints(spans, selector="prophet", namespace="batch") for _, spans in prompts])
    for out, (ids, spans) in zip(outs, prompts):
        info = report(out)
        # chunks the radix tree matched whole (a prompt opening like the warm-up's) are not blended
        blended = sum(e > info["radix_tokens"] for _, e in spans)
        assert (info["chunk_hits"], info["chunk_misses"]) == (blended, 0) and blended >= 5
        assert info["batch"]["requests"] == len(prompts)
        # charged what it computed: the recomputed tokens, the query a second time (ProphetKV's feature pass) and
        # any shared-prefix token the radix tree did not hold
        query = len(ids) - spans[-1][1]
        assert info["admitted_compute"] == info["recomputed_tokens"] + query + max(0, spans[0][0] - info["radix_tokens"])


def test_blended_prefills_mixed_with_decodes_match_stock(engine, tokenizer):
    rag = Rag(tokenizer, n_docs=6, words=120, seed=11)
    decoder = rag.build([0, 1], "Write a long story about the documents.")[0]
    prompts = [rag.build(order, f"What is the code of document {order[0]}?") for order in ([2, 3, 4], [5, 2], [4, 5, 3])]
    # the first request decodes past its end of turn, so it is still decoding when the hinted prefills arrive; past
    # that token the text is out of the model's distribution (near-ties), so it is compared up to there
    long = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    params = {"max_new_tokens": 24, "temperature": 0}
    stock = [engine.generate(input_ids=decoder, sampling_params=long)["output_ids"]]
    stock += [engine.generate(input_ids=ids, sampling_params=params)["output_ids"] for ids, _ in prompts]

    async def together():
        # the first request streams: its first token out means its prefill is done and it is decoding, whatever the
        # host's load; the hinted requests are sent then, with 63 of its tokens still to decode
        stream = await engine.async_generate(input_ids=decoder, sampling_params=long, stream=True)
        first = await stream.__anext__()
        assert not first["meta_info"]["finish_reason"], first["meta_info"]
        rest = asyncio.gather(*[engine.async_generate(
            input_ids=ids, sampling_params=params, kv_hints=hints(spans, selector="epic", ratio=1.0, namespace="mixed"))
            for ids, spans in prompts])
        async for last in stream:  # chunks are cumulative (SGLang's default): the last is the whole output
            first = last
        return [first, *await rest]

    outs = engine.loop.run_until_complete(together())
    got = [o["output_ids"] for o in outs]
    assert until_end_of_turn(got[0], tokenizer) == until_end_of_turn(stock[0], tokenizer)
    assert got[1:] == stock[1:]
    infos = [report(o) for o in outs[1:]]
    assert any(info["batch"]["decodes"] > 0 for info in infos), [info["batch"] for info in infos]


def until_end_of_turn(ids, tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return ids[: ids.index(end) + 1] if end in ids else ids
