"""SpeCache's SGLang side (sglang_patch/decode/specache*.py) on real SGLang pools, without a server: the slot-indexed
low-bit pool reads what the reference's per-sequence LayerCache holds, one pass's attention writes x_t only, attends as
the reference step and picks row 1's top-k; the start-up refusals; the launcher's page size."""

import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402

from chunkcache.config import Config, SpeCacheConfig  # noqa: E402
from chunkcache.specache.layer_cache import LayerCache, lowbit_bytes  # noqa: E402
from chunkcache.specache.step import select_topk, speculative_attention  # noqa: E402
from sglang_patch.decode.specache import Plan, ReqState, SpeCacheDecode, StepAttention, problems  # noqa: E402
from sglang_patch.decode.specache_pool import LowBitPool  # noqa: E402
from sglang_patch.serve import launcher  # noqa: E402

HQ, HK, D, G, LAYERS = 6, 2, 16, 8, 2
CFG = SpeCacheConfig(enabled=True, bits=1, group=G, residual=12, topk=5)
LENS = [50, 23]  # one request with low-bit groups, one whose context is all residual


def build(cfg=CFG):
    """Two requests on scattered pages of a float32 pool (as after many allocations), random K/V in every layer."""
    torch.manual_seed(0)
    kv = MHATokenToKVPool(size=1024, page_size=G, dtype=torch.float32, head_num=HK, head_dim=D, layer_num=LAYERS,
                          device="cpu", enable_memory_saver=False)
    for layer in range(LAYERS):
        kv.k_buffer[layer].copy_(torch.randn_like(kv.k_buffer[layer]))
        kv.v_buffer[layer].copy_(torch.randn_like(kv.v_buffer[layer]))
    reqs = ReqToTokenPool(size=4, max_context_len=256, device="cpu", enable_memory_saver=False)
    pages = torch.randperm(1024 // G - 1)[:16] + 1
    slots = (pages[:, None] * G + torch.arange(G)).flatten()
    start = 0
    for row, n in zip((2, 1), LENS):
        need = -(-(n + 1) // G) * G  # whole pages, room for x_t
        reqs.req_to_token[row, : n + 1] = slots[start: start + n + 1].int()
        start += need
    runner = SimpleNamespace(token_to_kv_pool=kv, req_to_token_pool=reqs, is_draft_worker=False,
                             model_config=SimpleNamespace(hf_config=SimpleNamespace(max_position_embeddings=8192)))
    return runner, SpeCacheDecode(cfg, runner)


def layer_cache(kv, slots, layer, cfg=CFG):
    cache = LayerCache(cfg, HK, D, capacity=len(slots) + 2)
    cache.append(kv.get_key_buffer(layer)[slots], kv.get_value_buffer(layer)[slots])
    return cache


@pytest.mark.parametrize("bits", [1, 2])
def test_context_is_the_reference_view(bits):
    cfg = SpeCacheConfig(enabled=True, bits=bits, group=G, residual=12, topk=5)
    runner, dec = build(cfg)
    slots = runner.req_to_token_pool.req_to_token[2, :50].long()
    Q = dec.quantised_len(50)
    dec.pool.quantise(slots[:Q])
    picked = torch.tensor([[0, 3, 9, 17, 31], [1, 2, 8, 20, 30]])
    for layer in range(LAYERS):
        ref = layer_cache(runner.token_to_kv_pool, slots, layer, cfg)
        assert ref.quantised == Q == 32
        ref.prefetch(picked)
        keys, values = dec.pool.context(layer, slots, Q, picked)
        assert torch.equal(keys, ref.view()[0]) and torch.equal(values, ref.view()[1])
    short = slots[:10]  # nothing low-bit yet: the context is the pool's own values
    keys, values = dec.pool.context(0, short, 0, torch.empty(HK, 0, dtype=torch.long))
    assert torch.equal(keys, runner.token_to_kv_pool.get_key_buffer(0)[short])
    assert torch.equal(values, runner.token_to_kv_pool.get_value_buffer(0)[short])
    assert dec.pool.lowbit_bytes_per_token() == lowbit_bytes(cfg, HK, D, G) // G * LAYERS
    assert dec.pool.full_bytes_per_token() == 2 * HK * D * 4 * LAYERS  # a float32 pool


def test_a_group_must_be_one_page_run():
    runner, dec = build()
    slots = runner.req_to_token_pool.req_to_token[2, :16].long()
    with pytest.raises(RuntimeError, match="page size must be a multiple"):
        dec.pool.quantise(slots.flip(0))


def test_step_attention_writes_x_t_attends_as_the_reference_and_picks_row_1s_topk():
    runner, dec = build()
    kv, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    plans, refs = [], []
    for row, n in zip((2, 1), LENS):
        slots = table[row, :n].long()
        st = ReqState(row, n, prefetched=[torch.tensor([[0, 5, 9, 12, 30], [1, 2, 3, 4, 31]])[:, : 5 if n > 40 else 0]]
                      * LAYERS)
        st.quantised = dec.quantised_len(n)
        dec.pool.quantise(slots[: st.quantised])
        plans.append(Plan(st, slots, dec.quantised_len(n + 1)))
        refs.append([layer_cache(kv, slots, layer) for layer in range(LAYERS)])
    for ref, p in zip(refs, plans):
        for layer, cache in enumerate(ref):
            cache.prefetch(p.state.prefetched[layer])
    x_loc = torch.stack([table[row, n] for row, n in zip((2, 1), LENS)]).long()
    attn = StepAttention(dec, plans, rows=2, write_loc=x_loc)
    q = torch.randn(4, HQ * D)
    k, v = torch.randn(4, HK, D), torch.randn(4, HK, D)
    for layer in range(LAYERS):
        radix = RadixAttention(HQ, D, D ** -0.5, HK, layer_id=layer)
        out = attn.forward(q, k, v, radix, None).view(4, HQ, D)
        for i, (p, ref) in enumerate(zip(plans, refs)):
            r = slice(2 * i, 2 * i + 2)
            want, probs = speculative_attention(q[r].view(2, HQ, D), k[r], v[r], *ref[layer].view(), D ** -0.5)
            torch.testing.assert_close(out[r], want)
            assert torch.equal(p.state.prefetched[layer], select_topk(probs[1], p.candidates, CFG.topk))
        # x_t's K/V are in the pool at its slot, s_t's nowhere
        assert torch.equal(kv.get_key_buffer(layer)[x_loc], k[0::2]) and torch.equal(kv.get_value_buffer(layer)[x_loc], v[0::2])
    assert dec.counts["fetch_bytes"] > 0 and dec.counts["read_bytes"] < dec.counts["stock_read_bytes"]


FACTS = {"device": "cpu", "model_type": "llama", "sliding_window": False, "kv_pool": "MHATokenToKVPool",
         "kv_dtype": torch.bfloat16, "page_size": 32, "decode_graph": False, "mixed_chunk": False,
         "overlap": False, "speculative": False, "workers": (1, 1, 1), "pdmux": False}


@pytest.mark.parametrize("fact, value, reason", [
    ("device", "cuda", "runs on CPU"), ("model_type", "gemma3", "model types"),
    ("sliding_window", True, "sliding-window"), ("kv_dtype", torch.float8_e4m3fn, "16 or 32 bits"),
    ("page_size", 1, "page size to be a multiple of decode.specache.group"), ("decode_graph", True, "eager"),
    ("mixed_chunk", True, "enable-mixed-chunk"), ("overlap", True, "disable-overlap-schedule"), ("speculative", True, "speculative decoding"),
    ("workers", (2, 1, 1), "one worker"), ("pdmux", True, "pdmux"),
])
def test_refusals_name_the_setting(fact, value, reason):
    cfg = SpeCacheConfig(enabled=True, group=32)
    assert problems(cfg, FACTS) == [] and problems(cfg, {**FACTS, "page_size": 64}) == []
    found = problems(cfg, {**FACTS, fact: value})
    assert len(found) == 1 and reason in found[0], found


def test_launcher_sets_the_page_size_to_the_group(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "has_gpu", lambda: False)
    assert "page_size" not in launcher.server_settings("/models/m", Config())
    path = tmp_path / "c.yaml"
    path.write_text("decode: {specache: {enabled: true, group: 16}}")
    assert launcher.server_settings("/models/m", Config.load(path))["page_size"] == 16
