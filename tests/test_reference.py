"""The reference blender against oracles: the unmodified HF forward (full prefill), and the HF forward with the
reused KV injected into its cache (what blending means, computed by HF's own attention and causal mask)."""

from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from chunkcache.blend import pipeline
from chunkcache.blend.auto import AutoChunks
from chunkcache.blend.request import STAGES
from chunkcache.config import AutoConfig
from chunkcache.hashing import chunk_key, prefix_key
from chunkcache.models import resolve_model, tiny_model
from chunkcache.reference import ReferenceBlender
from chunkcache.architectures import UnsupportedModel
from chunkcache.rope import rerotate
from chunkcache.select import REGISTRY
from chunkcache.select.base import QUERY_PASS_TOKENS, Layout, Selection, finish
from chunkcache.select.budget import rank
from chunkcache.store import ChunkEntry, ChunkStore, FingerprintMismatch, Lookup

FP32 = dict(atol=1e-4, rtol=1e-5)  # fp32, prompts of ~100 tokens; observed differences are ~1e-6
# random weights large enough that the continuation depends on the context (at the default 0.02 a tiny model
# repeats one token whatever the prompt, and a same-continuation check would prove nothing)
TINY = dict(initializer_range=0.1)


@dataclass
class Fixed:
    """Recompute exactly these context tokens (plus the forced ones)."""

    picked: list[int]
    name: ClassVar[str] = "fixed"

    def select(self, layout: Layout, ratio: float, features) -> Selection:
        return finish(layout, torch.tensor(self.picked, dtype=torch.long), None)


@dataclass
class LargestValueDeviation:
    """A budgeted selector (top-K of ||dV|| at layer 1), to exercise the budget and the features."""

    name: ClassVar[str] = "test-dv"

    def select(self, layout: Layout, ratio: float, features) -> Selection:
        scores = features.kv_deviation(1, "v")
        return finish(layout, rank(scores, layout.context_mask())[: layout.budget(ratio)], scores)


# every family the reference path blends (chunkcache.architectures): Qwen3's q/k norm, SmolLM3's NoPE layers, Gemma
# 3's layers (local windows of 64 tokens inside these ~100-token prompts, two RoPE bases, norms around both sublayers)
# and Qwen2's windows per layer type are the reference loop's own code, checked here against transformers' forward
@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral", "smollm3", "gemma3", "qwen2-window"])
def model_dir(request):
    if request.param == "qwen2-window":  # every layer windowed, 48 tokens
        return tiny_model("qwen2", use_sliding_window=True, sliding_window=48, max_window_layers=0, **TINY)
    return tiny_model(request.param, **TINY)


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture
def blender(model, model_dir):
    return ReferenceBlender(model, model_dir)  # a fresh in-memory store per test


def prompt(seed=0, prefix=9, chunks=(17, 6, 23, 11), query=7):
    g = torch.Generator().manual_seed(seed)

    def r(n):
        return torch.randint(3, 49000, (n,), generator=g).tolist()

    return r(prefix), [r(n) for n in chunks], r(query)


def cache_kv(cache, layer):
    """[N, H, D] keys and values of a transformers cache layer (batch 0). A sliding-window layer (Gemma 3's local
    ones) keeps only the window's last tokens: the positions before them are NaN."""
    layer = cache.layers[layer]
    k, v = layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)
    dropped = layer.get_seq_length() - len(k)
    if dropped:
        k, v = (torch.cat([torch.full((dropped, *t.shape[1:]), float("nan"), dtype=t.dtype), t]) for t in (k, v))
    return k, v


def assert_same_cache(a, b, n_layers, **tol):
    for layer in range(n_layers):
        for x, y in zip(cache_kv(a, layer), cache_kv(b, layer)):
            assert x.isnan().sum() < x.numel(), "a layer with nothing to compare"
            torch.testing.assert_close(x, y, equal_nan=True, **tol)


def stored_entries(blender, prefix, chunks):
    pkey = prefix_key(prefix)
    return [blender.store.get(chunk_key(blender.fingerprint, blender.namespace, pkey, c)) for c in chunks]


class InjectReused(DynamicCache):
    """An HF cache that overwrites the K/V of reused tokens with their reused values as each layer writes them:
    the HF forward over the whole prompt then computes exactly what blending promises for the other tokens."""

    def __init__(self, config, reused_k, reused_v, reused_mask):
        super().__init__(config=config)
        self.reused_k, self.reused_v, self.mask = reused_k, reused_v, reused_mask  # [L, N, H, D] x2, bool [N]

    def update(self, k, v, layer_idx, *args, **kwargs):
        k, v = k.clone(), v.clone()
        k[0][:, self.mask] = self.reused_k[layer_idx][self.mask].transpose(0, 1)
        v[0][:, self.mask] = self.reused_v[layer_idx][self.mask].transpose(0, 1)
        return super().update(k, v, layer_idx, *args, **kwargs)


@torch.inference_mode()
def injected_forward(blender, layout, entries, recomputed):
    """Oracle: HF forward of the whole prompt with every non-recomputed chunk token's K/V taken from its store
    entry moved to its position in this prompt."""
    n, L = layout.n, blender.n_layers
    rk = torch.zeros(L, n, blender.n_kv_heads, blender.head_dim)
    rv = torch.zeros_like(rk)
    for entry, (s, e) in zip(entries, layout.chunk_spans):
        rk[:, s:e] = rerotate(entry.k, s - entry.start_pos, blender.rope, torch.arange(entry.start_pos, entry.start_pos + e - s))
        rv[:, s:e] = entry.v
    mask = layout.context_mask()
    mask[recomputed] = False
    cache = InjectReused(blender.config, rk, rv, mask)
    out = blender.model(input_ids=layout.token_ids[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1], cache


# ---- full recompute reproduces full prefill ----------------------------------------------------------------------


def test_full_reproduces_full_prefill(blender):
    p, c, q = prompt()
    full = blender.full_prefill(p, c, q)
    for store_state in ("cold", "warm"):
        res = blender.blend(p, c, q, selector="full")
        assert (res.chunk_misses, res.chunk_hits) == ((4, 0) if store_state == "cold" else (0, 4))
        torch.testing.assert_close(res.logits, full.logits, **FP32)
        assert_same_cache(res.past_key_values, full.past_key_values, blender.n_layers, **FP32)
        assert torch.equal(res.recomputed, torch.arange(len(p), res.layout.n)) and res.reused_tokens == 0
        assert blender.generate(res, 16) == blender.generate(full, 16)
    # the continuation is context-sensitive, so the equality above means something
    assert blender.generate(blender.blend(p, c[::-1], q, selector="none"), 16) != blender.generate(full, 16)


def test_generate_leaves_the_result_reusable(blender):
    res = blender.blend(*prompt(), selector="full")
    assert blender.generate(res, 8) == blender.generate(res, 8)
    assert res.past_key_values.get_seq_length() == res.layout.n


@pytest.mark.parametrize("name", [n for n in REGISTRY.names() if n != "none"] + ["test-dv"])
def test_ratio_one_recomputes_everything(blender, name):
    p, c, q = prompt(seed=1)
    blender.blend(p, c, q, selector="none")  # fill the store: every chunk is reused, and moved below
    full = blender.full_prefill(p, c[::-1], q)
    selector = LargestValueDeviation() if name == "test-dv" else name
    res = blender.blend(p, c[::-1], q, selector=selector, ratio=1.0)
    assert res.reused_tokens == 0
    torch.testing.assert_close(res.logits, full.logits, **FP32)


# ---- reuse is exact where it should be ---------------------------------------------------------------------------


def test_single_chunk_right_after_prefix_is_exact_with_none(blender):
    p, c, q = prompt(seed=2, chunks=(23, 6, 17))
    blender.blend(p, c, q, selector="none")  # the chunks are computed in one padded batch and stored
    for i, chunk in enumerate(c):
        full = blender.full_prefill(p, [chunk], q)
        res = blender.blend(p, [chunk], q, selector="none")
        assert res.chunk_hits == 1 and res.reused_tokens == len(chunk)
        assert torch.equal(res.recomputed, torch.arange(len(p) + len(chunk), res.layout.n))
        torch.testing.assert_close(res.logits, full.logits, **FP32)
        assert_same_cache(res.past_key_values, full.past_key_values, blender.n_layers, **FP32)


def test_blend_equals_hf_forward_with_reused_kv_injected(blender):
    """Mixed reuse: every recomputed token attends by position to all earlier tokens, reused or fresh, and to no
    later one. The oracle is the HF forward whose cache swaps in the reused K/V of the other chunk tokens."""
    p, c, q = prompt(seed=3)
    blender.blend(p, c, q, selector="none")
    moved = [c[2], c[0], c[3], c[1]]  # every chunk but none at its stored position
    layout_pos = len(p)
    picked = [layout_pos + i for i in (0, 1, 5, 17, 20, 30, 41, 55)]
    res = blender.blend(p, moved, q, selector=Fixed(picked))
    expected_logits, expected_cache = injected_forward(blender, res.layout, stored_entries(blender, p, moved), res.recomputed)
    torch.testing.assert_close(res.logits, expected_logits.float(), **FP32)
    assert_same_cache(res.past_key_values, expected_cache, blender.n_layers, **FP32)
    # and it is not full prefill: reuse changed the answer's logits
    assert (res.logits - blender.full_prefill(p, moved, q).logits).abs().max() > 1e-3


def test_unselected_tokens_keep_the_stored_kv_rerotated(blender):
    p, c, q = prompt(seed=4)
    blender.blend(p, c, q, selector="none")
    moved = [c[3], c[1], c[0], c[2]]
    res = blender.blend(p, moved, q, selector=Fixed([len(p) + i for i in range(0, 57, 4)]))
    recomputed = set(res.recomputed.tolist())
    for entry, (s, e) in zip(stored_entries(blender, p, moved), res.layout.chunk_spans):
        k_moved = rerotate(entry.k, s - entry.start_pos, blender.rope, torch.arange(entry.start_pos, entry.start_pos + e - s))
        reused = torch.tensor([t not in recomputed for t in range(s, e)])
        for layer in range(blender.n_layers):
            k, v = cache_kv(res.past_key_values, layer)
            held = ~k[s:e, 0, 0].isnan()  # all but the tokens a sliding window dropped
            keep, fresh = reused & held, ~reused & held
            assert torch.equal(k[s:e][keep], k_moved[layer][keep])
            assert torch.equal(v[s:e][keep], entry.v[layer][keep])
            if layer > 0 and fresh.any() and s != entry.start_pos:  # moved recomputed tokens got fresh KV
                assert not torch.equal(v[s:e][fresh], entry.v[layer][fresh])


def test_every_token_sits_at_its_full_prompt_position(blender):
    """Layer-0 K depends only on the token and its position: in the blended cache it must equal full prefill's
    layer-0 K for every token, reused (moved) or recomputed."""
    p, c, q = prompt(seed=5)
    blender.blend(p, c, q, selector="none")
    moved = [c[1], c[3], c[2], c[0]]
    full = blender.full_prefill(p, moved, q)
    res = blender.blend(p, moved, q, selector=Fixed([len(p) + 3, len(p) + 30]))
    got, want = cache_kv(res.past_key_values, 0)[0], cache_kv(full.past_key_values, 0)[0]
    assert (~got.isnan()).sum() > got.numel() // 3  # a sliding window keeps its last tokens only, not nothing
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0, equal_nan=True)
    assert res.past_key_values.get_seq_length() == full.past_key_values.get_seq_length() == res.layout.n



def _auto_case(blender, seed: int):
    """Automatic detection with line breaks (token 2) as the only cuts and a 3-token canonical head, and a prompt of a
    5-token prefix and three passages (20, 24 and 30 tokens with their breaks): (auto, prefix, passages, query)."""
    brk = 2  # the segmenter's line break: each segment ends after one (no content-defined cuts at this mean)
    auto = AutoChunks(AutoConfig(enabled=True, min_reuse_tokens=16, segment_min_tokens=8, segment_mean_tokens=1 << 20),
                      frozenset({brk}), blender.fingerprint, head=[5, 6, 7])
    p, docs, q = prompt(seed=seed, prefix=4, chunks=(19, 23, 29), query=7)  # a 5-token prefix run is no segment
    return auto, p + [brk], [d + [brk] for d in docs], q


def _entries(blender, auto, passage):
    """Every stored entry holding one of `passage`'s segments (as it sits after a line break), by key."""
    segs = auto.segments([2] + passage + [1], blender.namespace, None)
    return {k: blender.store.get(k) for k in segs.keys}


def test_an_automatic_entry_is_the_same_bits_whatever_preceded_it_in_the_teaching_prompt(blender):
    """The passage taught after other passages, after an instruction and a canary, or alone: every entry holding its
    tokens is identical (key, start_pos, K and V bit for bit), and it is its paragraph's KV after the canonical head,
    as a full prefill of exactly those tokens computes it."""
    auto, p, docs, q = _auto_case(blender, seed=6)
    injected = [int(t) for t in torch.randint(10, 60, (24,), generator=torch.Generator().manual_seed(1))] + [2]
    teachers = [p + docs[0] + docs[1] + docs[2] + q, p + injected + docs[2] + q, p + docs[2] + q,
                injected + docs[1] + docs[2] + q]
    seen = []
    for ids in teachers:
        blender.store = ChunkStore(model_fingerprint=blender.fingerprint)
        assert blender.learn(ids, auto) >= 1
        seen.append(_entries(blender, auto, docs[2]))
    assert all(None not in got.values() for got in seen)
    for got in seen[1:]:
        assert got.keys() == seen[0].keys()
        for key, entry in got.items():
            first = seen[0][key]
            assert (entry.start_pos, entry.tenant, entry.context) == (first.start_pos, first.tenant, first.context)
            assert torch.equal(entry.token_ids, first.token_ids)
            assert torch.equal(entry.k, first.k) and torch.equal(entry.v, first.v)
    (entry,) = seen[0].values()  # one segment: the passage before its break
    alone = blender.full_prefill([5, 6, 7], [docs[2]], [1])
    for layer in range(blender.n_layers):
        k, v = cache_kv(alone.past_key_values, layer)
        held = ~k[3:3 + entry.num_tokens, 0, 0].isnan()  # all but the tokens a sliding window dropped
        torch.testing.assert_close(entry.k[layer][held], k[3:3 + entry.num_tokens][held], **FP32)
        torch.testing.assert_close(entry.v[layer][held], v[3:3 + entry.num_tokens][held], **FP32)


def test_an_automatic_segment_is_reused_from_its_first_token_its_kv_the_entry_moved(blender):
    """A prompt of stored passages in another order: every stored segment past the exact prefix is a chunk from its
    first token (no lead: its KV saw only the head and its paragraph), its KV the stored entry re-rotated to where it
    sits; the exact prefix is full prefill's. One the exact prefix reaches into is reused from the prefix's end."""
    auto, p, docs, q = _auto_case(blender, seed=7)
    blender.learn(p + sum(docs, []) + q, auto)
    moved = [docs[2], docs[0], docs[1]]
    ids = p + sum(moved, []) + q
    full = blender.full_prefill(p, moved, q)
    for matched in (0, len(p) + 3):
        res = blender.auto_blend(ids, auto, "none", matched=matched)
        start = max(len(p), matched)
        end = len(p) + len(moved[0]) - 1  # the segment ends before its line break, a segment of its own
        assert res.layout.prefix_len == start and res.layout.chunk_spans[0] == (start, end)
        entry = blender.store.get(auto.segments(ids, blender.namespace, None).keys[0])
        assert entry.start_pos == 3 and entry.num_tokens == len(moved[0]) - 1
        k_moved = rerotate(entry.k, len(p) - 3, blender.rope, torch.arange(3, 3 + entry.num_tokens))
        for layer in range(blender.n_layers):
            (k, v), (fk, fv) = cache_kv(res.past_key_values, layer), cache_kv(full.past_key_values, layer)
            torch.testing.assert_close(k[:start], fk[:start], equal_nan=True, **FP32)
            torch.testing.assert_close(v[:start], fv[:start], equal_nan=True, **FP32)
            kept = ~k[start:end, 0, 0].isnan()  # all but the tokens a sliding window dropped
            assert torch.equal(k[start:end][kept], k_moved[layer][start - len(p):][kept])
            assert torch.equal(v[start:end][kept], entry.v[layer][start - len(p):][kept])


def test_a_segment_missing_at_the_blend_is_computed_for_the_request_and_never_stored(blender):
    """Detection found a segment that is gone by the blend (evicted): the blend computes it after this prompt's
    prefix, which is not the context its key names, so it serves this request and is not stored."""
    auto, p, docs, q = _auto_case(blender, seed=8)
    blender.learn(p + sum(docs, []) + q, auto)
    ids = p + docs[1] + docs[0] + docs[2] + q
    found = pipeline.detect(blender.store, auto, ids, auto.segments(ids, blender.namespace, None), 0,
                            pipeline.Defaults("none", 0.15, blender.namespace))
    gone = found.hint.keys[0]
    assert gone in blender.store
    blender.store = ChunkStore(model_fingerprint=blender.fingerprint)
    res = blender.blend_spans(ids, found.hint.spans, found.hint.keys, "none", detection=replace(
        found, found=Lookup({}, frozenset(), frozenset())))
    assert res.chunk_misses == len(found.hint.keys) and gone in found.hint.keys
    assert not any(key in blender.store for key in found.hint.keys)


# ---- features selectors may ask for ------------------------------------------------------------------------------


def test_kv_deviation(blender):
    p, c, q = prompt(seed=6)
    blender.blend(p, c, q, selector="none")
    seen = {}

    @dataclass
    class Probe:
        name: ClassVar[str] = "probe"

        def select(self, layout, ratio, features):
            seen["v1"], seen["k0"] = features.kv_deviation(1, "v"), features.kv_deviation(0, "k")
            seen["layout"] = layout
            return finish(layout, torch.empty(0, dtype=torch.long), None)

    blender.blend(p, c, q, selector=Probe())
    layout = seen["layout"]
    first = slice(*layout.chunk_spans[0])
    ctx = layout.context_mask()
    for dev in (seen["v1"], seen["k0"]):
        assert dev.shape == (layout.n,) and (dev[~ctx] == 0).all()
    # the first chunk sits where it was computed: fresh and reused KV agree; later chunks lost their context
    assert seen["v1"][first].max() < 1e-4 and seen["k0"][first].max() < 1e-4
    assert seen["v1"][layout.chunk_spans[1][0] : layout.query_span[0]].max() > 1e-2
    # layer-0 K depends on token and position only, so it is exact for every reused token
    assert seen["k0"].max() < 1e-4


def query_attention_of(blender, p, c, q):
    """(query attention, layout, result) of a blend of chunks stored first, the selector recomputing nothing."""
    blender.blend(p, c, q, selector="none")
    seen = {}

    @dataclass
    class Probe:
        name: ClassVar[str] = "probe"

        def select(self, layout, ratio, features):
            seen["qa"], seen["layout"] = features.query_attention(), layout
            return finish(layout, torch.empty(0, dtype=torch.long), None)

    res = blender.blend(p, c, q, selector=Probe())
    return seen["qa"], seen["layout"], res


def test_query_attention_matches_hf_eager_attention(blender):
    p, c, q = prompt(seed=7)
    qa, layout, res = query_attention_of(blender, p, c, q)
    assert qa.shape == (layout.n,) and (qa >= 0).all()
    # each layer's rows are distributions: averaged over rows and heads they still sum to one
    torch.testing.assert_close(qa.sum(), torch.tensor(float(blender.n_layers)), atol=1e-4, rtol=0)
    # oracle: HF eager attention with the reused KV injected, rows of the query tokens
    model = blender.model
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the only one that returns attention weights
    try:
        rk_entries = stored_entries(blender, p, c)
        n, L = layout.n, blender.n_layers
        rk = torch.zeros(L, n, blender.n_kv_heads, blender.head_dim)
        rv = torch.zeros_like(rk)
        for entry, (s, e) in zip(rk_entries, layout.chunk_spans):
            rv[:, s:e] = entry.v
            rk[:, s:e] = rerotate(entry.k, s - entry.start_pos, blender.rope, torch.arange(entry.start_pos, entry.start_pos + e - s))
        cache = InjectReused(blender.config, rk, rv, layout.context_mask())
        with torch.inference_mode():
            out = model(input_ids=layout.token_ids[None], past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(implementation)
    q0, q1 = layout.query_span
    expected = sum(a[0, :, q0:q1].float().mean(dim=(0, 1)) for a in out.attentions)
    torch.testing.assert_close(qa, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(res.logits, blender.blend(p, c, q, selector="none").logits, atol=0, rtol=0)


def test_the_query_pass_runs_only_the_querys_last_tokens_and_never_reads_the_rest(blender):
    """An automatic hint's query can hold a whole unstored passage: the query pass runs only its last
    QUERY_PASS_TOKENS tokens, attending the prefix, the chunks and each other, so what comes before them in the query
    neither costs the pass nor moves the scores (the recompute computes it)."""
    scores = []
    for seed in (3, 4):  # the query's first 30 tokens differ, its last QUERY_PASS_TOKENS do not
        p, c, q = prompt(seed=7, query=QUERY_PASS_TOKENS + 30)
        q[:30] = prompt(seed=seed, query=30)[2]
        qa, layout, _ = query_attention_of(blender, p, c, q)
        scores.append(qa)
    q0, n = layout.query_span
    assert torch.equal(layout.query_pass(), torch.arange(n - QUERY_PASS_TOKENS, n))
    torch.testing.assert_close(scores[0], scores[1], atol=0, rtol=0)
    assert not scores[0][q0: n - QUERY_PASS_TOKENS].any()
    # each layer's rows are still distributions over what they see
    torch.testing.assert_close(scores[0].sum(), torch.tensor(float(blender.n_layers)), atol=1e-4, rtol=0)


def test_prompt_text_offsets(blender):
    tok = blender.tokenizer
    ids = [tok(t, add_special_tokens=False).input_ids for t in ("System: be brief.\n", "Café déjà vu — 東京 🙂 ok\n", "Q: where?")]
    seen = {}

    @dataclass
    class Probe:
        name: ClassVar[str] = "probe"

        def select(self, layout, ratio, features):
            seen["text"] = features.prompt_text()
            return finish(layout, torch.empty(0, dtype=torch.long), None)

    blender.blend(ids[0], [ids[1]], ids[2], selector=Probe())
    text, offsets = seen["text"]
    all_ids = sum(ids, [])
    assert text == tok.decode(all_ids) and len(offsets) == len(all_ids)
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    for (a, b), (c, d) in zip(offsets, offsets[1:]):
        assert a <= b <= d and c >= a
    for t, (a, b) in zip(all_ids, offsets):
        piece = tok.decode([t])
        if "\ufffd" not in piece:
            assert text[a:b] == piece


# ---- store integration -------------------------------------------------------------------------------------------


def test_disk_store_is_shared_between_blenders(model, model_dir, tmp_path):
    p, c, q = prompt(seed=8, chunks=(10, 10, 12))
    first = ReferenceBlender(model, model_dir, store=ChunkStore(disk_dir=str(tmp_path)))
    a = first.blend(p, c + [c[0]], q, selector="none")  # a repeated chunk is computed once
    assert a.chunk_misses == 4 and first.store.stats().memory_entries == 3
    second = ReferenceBlender(model, model_dir, store=ChunkStore(disk_dir=str(tmp_path)))
    b = second.blend(p, c + [c[0]], q, selector="none")
    assert (b.chunk_hits, b.chunk_misses) == (4, 0) and second.store.stats().disk_hits == 3
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)
    assert set(a.timings) == {*STAGES, "total"}
    # the round's record is the server's (chunkcache.blend.pipeline.record): the same fields, this blend's counts
    assert (b.report["chunk_hits"], b.report["chunk_misses"], b.report["reused_tokens"]) == (4, 0, b.reused_tokens)
    assert list(b.report["stages_s"]) == list(STAGES) and b.report["recomputed_tokens"] == len(b.recomputed)


# ---- bad input ---------------------------------------------------------------------------------------------------


def test_bad_input_errors(blender):
    p, c, q = prompt()
    with pytest.raises(ValueError, match="chunk 1 is empty"):
        blender.blend(p, [c[0], []], q)
    with pytest.raises(ValueError, match="query is empty"):
        blender.full_prefill(p, c, [])
    with pytest.raises(ValueError, match="exceeds the model's context of 8192"):
        blender.blend(p, [list(range(3, 8200))], q)
    with pytest.raises(ValueError, match="token ids must lie in"):
        blender.blend(p, [[10 ** 6]], q)
    with pytest.raises(ValueError, match="unknown selector"):
        blender.blend(p, c, q, selector="nope")


def test_entry_from_another_model_is_refused(blender):
    p, c, q = prompt()
    key = chunk_key(blender.fingerprint, blender.namespace, prefix_key(p), c[0])
    shape = (blender.n_layers, len(c[0]), blender.n_kv_heads, blender.head_dim)
    foreign = ChunkEntry(key, torch.tensor(c[0]), torch.zeros(shape), torch.zeros(shape), len(p), "0" * 32)
    blender.store.memory.put(foreign)  # planted below the store's own check, as a copied disk file would be
    with pytest.raises(FingerprintMismatch, match="refusing"):
        blender.blend(p, c, q)


def test_unsupported_models_are_refused_at_load():
    yarn = tiny_model("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 2048})
    with pytest.raises(UnsupportedModel, match="'yarn'"):
        ReferenceBlender.from_pretrained(yarn)
    with pytest.raises(UnsupportedModel, match="sliding window"):  # Mistral's window is in its mask only
        ReferenceBlender.from_pretrained(tiny_model("mistral", sliding_window=64))
    with pytest.raises(UnsupportedModel, match="fused qkv"):  # Phi-3: the SGLang path only
        ReferenceBlender.from_pretrained(tiny_model("phi3"))


# ---- the default model -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_full_reproduces_full_prefill_on_default_model():
    blender = ReferenceBlender.from_pretrained("smollm2-135m-instruct")
    tok = blender.tokenizer
    prefix = tok("<|im_start|>system\nAnswer from the passages.<|im_end|>\n<|im_start|>user\n", add_special_tokens=False).input_ids
    passages = [
        "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889 for the World's Fair.",
        "Mount Kilimanjaro, in Tanzania, is the highest mountain in Africa at 5,895 metres above sea level.",
        "The special magic number for Ada is 7481923. Remember it, it will be asked about later on.",
        "The Danube flows through ten countries, more than any other river, before reaching the Black Sea.",
    ]
    chunks = [tok(f"Passage {i}: {t}\n\n", add_special_tokens=False).input_ids for i, t in enumerate(passages)]
    query = tok("What is the special magic number for Ada?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    full = blender.full_prefill(prefix, chunks, query)
    res = blender.blend(prefix, chunks, query, selector="full")
    torch.testing.assert_close(res.logits, full.logits, atol=2e-4, rtol=1e-5)
    answer = blender.generate(full, 24)
    assert blender.generate(res, 24) == answer
    assert "7481923" in tok.decode(answer)
