"""SpeCache decoding inside SGLang's engine (decode.specache, sglang_patch/decode/specache.py) against its two oracles:
the reference decode loop (chunkcache.specache.decode) on the same prompts, and stock SGLang's decoding when the top-k
covers the whole context (every low-bit pair replaced by its full-precision one), after a plain or a blended
prefill (chunk reuse alone being the oracle of the latter). float32 on both sides: in
bfloat16 the two-row step's matmuls round differently from stock's one-row ones, and a near tie can flip a token."""

import os

import pytest
import torch
from conftest import Rag, hints, sglang_engine

from chunkcache.config import SpeCacheConfig
from chunkcache.models import tiny_model

pytestmark = pytest.mark.slow
TINY = dict(initializer_range=0.1)  # random weights large enough that the continuation depends on the context
NEW = [16, 10]  # new tokens per prompt: the second request leaves the batch first


@pytest.fixture(autouse=True)
def own_config_env():
    """sglang_engine points CHUNKCACHE_CONFIG at this test's file; put it back afterwards, so that no later server in
    this session (one that reads the variable it inherits) starts with SpeCache on."""
    from sglang_patch.serve.launcher import CONFIG_ENV

    before = os.environ.get(CONFIG_ENV)
    yield
    if before is None:
        os.environ.pop(CONFIG_ENV, None)
    else:
        os.environ[CONFIG_ENV] = before


def generate(engine, prompts, new=NEW):
    params = [{"max_new_tokens": n, "temperature": 0} for n in new]
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


def specache(engine) -> dict:
    info = engine.get_server_info()["internal_states"][0]["specache"]
    assert info["errors"] == 0  # no step fell back to the attention backend
    return info


@pytest.mark.parametrize("arch, bits", [("llama", 1), ("qwen2", 2)])
def test_decode_is_the_reference_loop(arch, bits, tmp_path):
    from transformers import AutoModelForCausalLM

    from chunkcache.specache.decode import SpeCacheDecoder, prefill

    path = tiny_model(arch, **TINY)
    torch.manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,)).tolist() for n in (90, 61)]
    cfg = SpeCacheConfig(enabled=True, bits=bits, group=8, residual=16, topk=4)
    yaml = f"decode: {{specache: {{enabled: true, bits: {bits}, group: 8, residual: 16, topk: 4}}}}"
    with sglang_engine(path, tmp_path, yaml, dtype="float32", page_size=8, max_total_tokens=2048) as engine:
        served = generate(engine, prompts)
        info = specache(engine)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    decoder = SpeCacheDecoder(model, cfg)
    runs = [decoder.generate(prefill(model, ids), n) for ids, n in zip(prompts, NEW)]
    assert served == [run.tokens for run in runs]
    assert info["pre_decodes"] == 2 and info["tokens"] == sum(NEW) - 2  # the first token of each is the prefill's
    # the server compares a guess when its token comes back as input: every guess but each request's last
    assert info["spec_guesses"] == sum(NEW) - 4
    assert info["spec_matches"] == sum(g == t for run in runs for g, t in zip(run.guesses[:-1], run.tokens[1:-1]))
    assert 0 < info["fetch_bytes"] and 0 < info["read_bytes"] < info["stock_read_bytes"]


def test_topk_covering_the_context_is_stock_decoding(default_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for text in ("What is the capital of France? Answer, then name two other cities in France.",
                            "List three colours of the rainbow.")]
    settings = dict(dtype="float32", max_total_tokens=2048)
    new = [24, 12]
    for side in ("stock", "specache"):
        (tmp_path / side).mkdir()
    with sglang_engine(default_model, tmp_path / "stock", **settings) as engine:
        stock = generate(engine, prompts, new)
    yaml = "decode: {specache: {enabled: true, bits: 1, group: 32, residual: 8, topk: 1024}}"
    with sglang_engine(default_model, tmp_path / "specache", yaml, page_size=32, **settings) as engine:
        served = generate(engine, prompts, new)
        info = specache(engine)
    assert served == stock, [tok.decode(ids) for ids in served + stock]
    assert info["fetch_bytes"] > 0  # low-bit groups existed, and every one was replaced by its full-precision pair
    # SmolLM2: 30 layers, 3 KV heads of 64; 1 bit, g = 32: 96 B per token and layer against 768 B in float32
    assert info["lowbit_bytes_per_token"] == 96 * 30 and info["stock_bytes_per_token"] == 768 * 30 * 2


def test_blended_prefill_then_specache_decoding(default_model, tmp_path):
    """Chunk reuse writes approximate KV (EPIC's selection recomputed, the rest copied from the chunk store); SpeCache
    quantises whatever the pool holds, so with the top-k covering the context it decodes as chunk reuse alone does."""
    from transformers import AutoTokenizer

    rag = Rag(AutoTokenizer.from_pretrained(default_model), n_docs=3, words=60)
    prompts = [rag.build(order, f"What is the code of document {order[1]}?") for order in ([0, 1, 2], [2, 0, 1])]
    settings = dict(dtype="float32", max_total_tokens=2048, page_size=32)
    served = {}
    for side, yaml in (("reuse", ""),
                       ("specache", "decode: {specache: {enabled: true, group: 32, residual: 8, topk: 1024}}")):
        (tmp_path / side).mkdir()
        with sglang_engine(default_model, tmp_path / side, yaml, **settings) as engine:
            # one at a time: the second prompt finds every chunk in the store and blends
            served[side] = [engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 12, "temperature": 0},
                                            kv_hints=hints(spans, selector="epic", ratio=0.15))["output_ids"]
                            for ids, spans in prompts]
            state = engine.get_server_info()["internal_states"][0]
        assert state["chunkcache"]["store"]["hits"] >= 3, state["chunkcache"]  # the second prompt reused its chunks
    info = state["specache"]
    # low-bit groups existed and every one was read in full precision too: more bytes than stock's full-precision read
    assert info["errors"] == 0 and info["tokens"] > 0 and info["read_bytes"] > info["stock_read_bytes"]
    assert served["specache"] == served["reuse"]
