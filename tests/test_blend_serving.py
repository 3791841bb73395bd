"""Chunk reuse inside SGLang's engine on this CPU, against stock SGLang on the same prompts (the oracle)."""

import random
import time

import pytest
import torch
from conftest import Rag, blended_context, flush, gen, hints, sglang_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def engine(default_model, tmp_path_factory, store_dir):
    config = f"select:\n  selector: epic\n  ratio: 0.15\nstore:\n  disk_dir: {store_dir}\n"
    # float32: the oracles are stock's greedy tokens and the reference blender's (float32), and in bfloat16 a correct
    # blend rounds differently enough from stock to flip a near-tie (seen: the last code digit of the full-selector
    # test's third prompt, whose top two logits tie exactly in bfloat16 and differ by 0.09 in float32)
    with sglang_engine(default_model, tmp_path_factory.mktemp("cfg"), config, max_total_tokens=6000,
                       dtype="float32") as eng:
        yield eng


@pytest.fixture(scope="module")
def rag(default_model):
    from transformers import AutoTokenizer

    return Rag(AutoTokenizer.from_pretrained(default_model))


def test_a_blend_recomputing_every_token_matches_stock_sglang(engine, rag):
    """Ratio 1: every chunk's stored KV copied in, then every token recomputed through the blend's own passes."""
    rng = random.Random(1)
    for k in range(5):
        order = rng.sample(range(len(rag.docs)), 4)
        ids, spans = rag.build(order, f"What is the code of document {order[k % 4]}?")
        stock = gen(engine, ids)
        blended = gen(engine, ids, hints(spans, selector="epic", ratio=1.0))
        info = blended["meta_info"]["chunkcache"]
        assert info["selector"] == "epic" and info["reused_tokens"] == 0, info
        assert blended["output_ids"] == stock["output_ids"], (order, blended["text"], stock["text"])


@pytest.mark.parametrize("selector,forwards", [("epic", 1), ("prophet", 2)])
def test_a_prefix_the_radix_tree_lost_is_computed_inside_the_blends_passes(engine, default_model, selector, forwards):
    """Every chunk stored, the shared prefix gone from the radix tree and its slots since written by another prompt:
    the prefix is computed exactly inside the blend's first pass (prophet's query pass, else the recompute), not in
    a forward of its own. At ratio 1 every other token is recomputed too, so the output is stock's; the answer is in
    the prefix, so a prefix left uncomputed would show."""
    from transformers import AutoTokenizer

    rag = Rag(AutoTokenizer.from_pretrained(default_model), n_docs=3, words=60, seed=2)
    rag.prefix = rag.tok.encode("<|im_start|>system\nAnswer from the documents. The code of document 9 is 4711."
                                "<|im_end|>\n<|im_start|>user\n", add_special_tokens=False)
    ids, spans = rag.build([2, 0, 1], "What is the code of document 9?")
    namespace = f"lead-{selector}"
    gen(engine, ids, hints(spans, selector=selector, ratio=1.0, namespace=namespace))  # stores the chunks
    stock = gen(engine, ids)
    assert "4711" in stock["text"], stock["text"]
    flush(engine)
    gen(engine, rag.tok.encode(" ".join(["An unrelated prompt that takes the pool's first slots."] * 8)))
    flush(engine)
    out = gen(engine, ids, hints(spans, selector=selector, ratio=1.0, namespace=namespace))
    info = out["meta_info"]["chunkcache"]
    assert info["radix_tokens"] == 0 and info["chunk_hits"] == 3, info
    assert info["batch"]["forwards"] == forwards, info
    assert out["output_ids"] == stock["output_ids"], (out["text"], stock["text"])


def test_one_batch_of_blended_and_plain_requests_matches_stock(engine, rag):
    """Several hinted requests and a plain one submitted together (one extend batch for the scheduler)."""
    prompts = [rag.build(order, f"What is the code of document {order[1]}?")
               for order in ([0, 2, 4], [4, 0, 2], [1, 3, 5], [5, 1])]
    params = {"max_new_tokens": 8, "temperature": 0}
    stock = [gen(engine, ids, n=8)["output_ids"] for ids, _ in prompts]
    kv = [hints(spans, selector="epic", ratio=1.0, namespace="batch") for _, spans in prompts[:-1]] + [None]
    outs = engine.generate(input_ids=[ids for ids, _ in prompts], sampling_params=params, kv_hints=kv)
    assert [o["output_ids"] for o in outs] == stock
    assert all(o["meta_info"]["chunkcache"]["selector"] == "epic" for o in outs[:-1])
    assert "chunkcache" not in outs[-1]["meta_info"]


def test_reordered_chunks_hit_and_reuse(engine, rag):
    ids, spans = rag.build([0, 1, 2], "What is the code of document 1?")
    gen(engine, ids, hints(spans, selector="none", namespace="reorder"))
    ids, spans = rag.build([2, 0, 1], "What is the code of document 0?")
    meta = gen(engine, ids, hints(spans, selector="none", namespace="reorder"))["meta_info"]
    info = meta["chunkcache"]
    assert info["chunk_hits"] == 3 and info["chunk_misses"] == 0
    # `none` recomputes no chunk token: every chunk token is reused, except the few the radix tree already matched
    # exactly (documents start alike, so the tree can reach a couple of tokens into the first chunk)
    assert info["reused_tokens"] == blended_context(spans, meta)
    assert info["recomputed_tokens"] == len(ids) - spans[-1][1]  # the question, its last token included
    assert info["attended_pairs"] == sum(p + 1 for p in range(spans[-1][1], len(ids)))  # each sees keys 0..p


@pytest.mark.parametrize("selector", ["none", "epic"])
def test_blend_matches_the_reference_blender(engine, rag, default_model, selector):
    """The same blend computed by the torch reference on HF transformers (chunkcache.reference, itself checked
    against full prefill): reused chunk KV copied and re-rotated into the pool, the same tokens recomputed."""
    from chunkcache.reference import ReferenceBlender

    ids, spans = rag.build([5, 2, 3], "What is the code of document 2?")
    served = gen(engine, ids, hints(spans, selector=selector, namespace=f"reference-{selector}"), n=8)
    assert served["meta_info"]["chunkcache"]["radix_tokens"] == 0
    ref = ReferenceBlender.from_pretrained(default_model)
    result = ref.blend(ids[: spans[0][0]], [ids[s:e] for s, e in spans], ids[spans[-1][1]:], selector=selector)
    assert len(result.recomputed) == served["meta_info"]["chunkcache"]["recomputed_tokens"]
    assert ref.generate(result, 8) == served["output_ids"]


def _top(engine, ids, kv_hints=None, **logprobs):
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0}, kv_hints=kv_hints,
                          return_logprob=True, top_logprobs_num=5, **logprobs)
    top = out["meta_info"]["output_top_logprobs"][0]  # (logprob, token id, text) of the first output token
    return out, [token for _, token, _ in top], torch.tensor([lp for lp, _, _ in top])


def test_output_logprobs_of_a_blended_request_are_the_blends_own(engine, rag, default_model):
    """A client asking for the first output token's top-5 logprobs still gets a blend (SGLang sets return_logprob for
    output logprobs too): the values are the reference blender's for the same blend; `exact: true` gives stock's;
    input logprobs over the prompt are computed in full, said in the report."""
    from chunkcache.reference import ReferenceBlender

    first, first_spans = rag.build([4, 1, 3], "What is the code of document 3?")
    gen(engine, first, hints(first_spans, selector="epic", namespace="lp"), n=1)  # stores the three chunks
    ids, spans = rag.build([3, 4, 1], "What is the code of document 1?")
    served, tokens, logprobs = _top(engine, ids, hints(spans, selector="epic", namespace="lp"))
    info = served["meta_info"]["chunkcache"]
    assert "fallback" not in info and info["chunk_hits"] == 3 and info["reused_tokens"] > 0, info
    ref = ReferenceBlender.from_pretrained(default_model)
    result = ref.blend(ids[: spans[0][0]], [ids[s:e] for s, e in spans], ids[spans[-1][1]:], selector="epic")
    assert len(result.recomputed) == info["recomputed_tokens"]
    want = torch.log_softmax(result.logits, -1).topk(5)
    assert tokens == want.indices.tolist()
    assert torch.allclose(logprobs, want.values, atol=2e-3), (logprobs, want.values)

    _, stock_tokens, stock = _top(engine, ids)
    exact, exact_tokens, exact_logprobs = _top(engine, ids, hints(spans, exact=True, namespace="lp-exact"))
    assert exact["meta_info"]["chunkcache"]["reason"] == "exact"
    assert exact_tokens == stock_tokens and torch.allclose(exact_logprobs, stock, atol=1e-5)

    scored, _, _ = _top(engine, ids, hints(spans, selector="epic", namespace="lp"), logprob_start_len=0)
    assert scored["meta_info"]["chunkcache"]["fallback"] == "input_logprobs"
    assert len(scored["meta_info"]["input_token_logprobs"]) == len(ids)


def test_per_chunk_features_are_charged_and_written_to_disk(engine, rag, store_dir):
    """CacheClip keeps each chunk's auxiliary KV in the chunk's store entry: the server charges it to the host budget
    and writes it through to the disk tier, as the reference blender does."""
    from chunkcache.store import ChunkStore

    ids, spans = rag.build([2, 0, 5], "What is the code of document 0?")
    gen(engine, ids, hints(spans, selector="clip", namespace="features"), n=2)
    on_disk = ChunkStore(host_bytes=0, disk_dir=str(store_dir))
    entries = [on_disk.get(key) for key in list(on_disk.disk.sizes)]
    assert sum(any(name.startswith("clip:") for name in e.features) for e in entries) >= len(spans)
    # every entry is in both tiers (nothing evicted): memory is charged what the disk holds, features included
    charged = engine.get_server_info()["internal_states"][0]["chunkcache"]["store"]["memory_bytes"]
    assert charged == sum(e.nbytes for e in entries)


def test_exact_repeat_is_served_by_the_radix_tree_and_reported(engine, rag):
    ids, spans = rag.build([1, 4], "What is the code of document 4?")
    first = gen(engine, ids, hints(spans, selector="epic", namespace="repeat"), n=4)
    again = gen(engine, ids, hints(spans, selector="epic", namespace="repeat"), n=4)
    assert again["output_ids"] == first["output_ids"]
    info = again["meta_info"]["chunkcache"]
    assert info["radix_tokens"] == len(ids) - 1 == again["meta_info"]["cached_tokens"]
    assert (info["chunk_hits"], info["chunk_misses"], info["reused_tokens"], info["recomputed_tokens"]) == (0, 0, 0, 1)


@pytest.mark.parametrize("selector", ["none", "epic", "cacheblend", "prophet", "spec", "clip"])
def test_selectors_respect_the_budget(engine, rag, selector):
    ids, spans = rag.build([3, 4, 5, 0], "What is the code of document 4?")
    out = gen(engine, ids, hints(spans, selector=selector, ratio=0.15, namespace=f"budget-{selector}"))
    info = out["meta_info"]["chunkcache"]
    assert out["meta_info"]["completion_tokens"] > 0
    n_ctx = blended_context(spans, out["meta_info"])
    forced = len(ids) - spans[-1][1]
    budget = 0 if selector == "none" else -(-15 * n_ctx // 100)
    assert info["recomputed_tokens"] == forced + budget
    assert info["reused_tokens"] + info["recomputed_tokens"] == n_ctx + forced


def kv_pool(engine):
    return engine.get_server_info()["internal_states"][0]["chunkcache"]["kv_pool"]


def test_many_requests_over_a_small_pool_evict_and_do_not_leak_slots(engine, rag):
    before = kv_pool(engine)
    total = before["available"] + before["evictable"]
    assert before["protected"] == 0
    rng = random.Random(2)
    big = Rag(rag.tok, n_docs=30, words=100, seed=3)
    served = 0
    for k in range(50):
        order = rng.sample(range(30), 4)
        ids, spans = big.build(order, f"Code of document {order[0]}?")
        out = gen(engine, ids, hints(spans, selector="epic", ratio=0.15, namespace="evict"), n=2)
        served += len(ids)
        assert out["meta_info"]["completion_tokens"] > 0
    after = kv_pool(engine)
    assert served > 3 * total, "the workload must not fit in the pool, so eviction has to happen"
    assert after["protected"] == 0 and after["available"] + after["evictable"] == total
    flush(engine)
    assert kv_pool(engine)["available"] == total


def test_mix_measures_each_chunks_deviation_off_the_requests_path(engine, rag, store_dir):
    """The default mix (stored_deviation, first_reuse "estimate") runs no deviation pass in any request: a chunk's
    first blend away from home reads an estimate, and the idle scheduler measures it afterwards and writes it
    through to the disk tier (1 and 2 are away in the first request, 0 in the second)."""
    from chunkcache.blend.features import deviation_feature
    from chunkcache.store import ChunkStore

    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        ids, spans = rag.build(order, "What is the code of document 0?")
        info = gen(engine, ids, hints(spans, selector="mix", namespace="remembered"), n=1)["meta_info"]["chunkcache"]
        assert "fallback" not in info and info["chunk_hits"] + info["chunk_misses"] == 3, info
        assert info["feature_passes"] == ["query_attention"], info
    name, deadline = deviation_feature(3, "k"), time.monotonic() + 120
    while True:  # the scheduler measures one request's chunks per idle turn
        on_disk = ChunkStore(host_bytes=0, disk_dir=str(store_dir))
        remembered = [e for e in (on_disk.get(key) for key in list(on_disk.disk.sizes)) if name in e.features]
        if len(remembered) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(remembered) == 3 and all(e.features[name].abs().sum() > 0 for e in remembered)


def test_a_quality_floor_picks_rho_by_the_estimate_and_every_blend_reports_one(engine, rag):
    """A loose bound takes the fidelity grid's smallest rho, one no rho up to the cap meets recomputes every context
    token and says so; a request without a bound keeps its ratio and still gets an estimate."""
    from chunkcache.blend import fidelity
    from chunkcache.blend.fidelity import RATIOS

    ids, spans = rag.build([0, 3, 5], "What is the code of document 3?")
    gen(engine, ids, hints(spans, selector="mix", namespace="floor"), n=1)  # stores the chunks
    reports = {}
    # each its own first document: the radix tree holds no other request's chunks of it (document 1 is stored by the
    # last, a miss beside two hits)
    for name, order, options in (("plain", [5, 0, 3], {}), ("loose", [3, 5, 0], {"max_kl": 1e6}),
                                 ("tight", [0, 5, 3], {"max_kl": 1e-12}),
                                 ("first", [1, 5, 3], {"max_kl": 1e6, "kl_over": "first_token"})):
        ids, spans = rag.build(order, "What is the code of document 5?")
        out = gen(engine, ids, hints(spans, selector="mix", namespace="floor", **options), n=1)
        reports[name] = out["meta_info"]["chunkcache"]
        assert reports[name]["chunk_hits"] >= 2, reports[name]
    plain, loose, tight, first = reports["plain"], reports["loose"], reports["tight"], reports["first"]
    assert plain["ratio"] == 0.15 and "max_kl" not in plain and plain["fidelity"]["kl"] > 0, plain
    # the default model has an estimator of its own (a model without one reports fitted_for null: test_architectures)
    assert plain["fidelity"]["fitted_for"] == fidelity.load().default, plain
    # the shipped estimator bounds the answer a client reads, not its first token alone
    assert loose["fidelity"]["covers"] == plain["fidelity"]["covers"] == 16, loose
    assert loose["kl_over"] == "answer" and "kl_over" not in plain, loose
    # a client asking for a first-token bound says so, and its report says what its estimate covers
    assert first["kl_over"] == "first_token" and first["fidelity"]["covers"] == 1 and first["ratio"] == min(RATIOS)
    shown = engine.get_server_info()["internal_states"][0]["chunkcache"]["fidelity"]  # what /server_info says
    assert shown == {"fitted_for": plain["fidelity"]["fitted_for"], "covers": 16, "ratios": list(RATIOS),
                     "first_token": True, "margin": 1.0}, shown
    assert loose["ratio"] == min(RATIOS) and loose["max_kl"] == 1e6 and "fallback" not in loose, loose
    assert tight["ratio"] == 1.0 and tight["fallback"] == "quality_floor" and tight["reused_tokens"] == 0, tight
    assert loose["recomputed_tokens"] < plain["recomputed_tokens"] < tight["recomputed_tokens"]
