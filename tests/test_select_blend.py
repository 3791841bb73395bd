"""Every selector through the reference blender on a tiny model: exact budgets, determinism, whole numbers,
CacheClip's auxiliary KV kept in the chunk store, per-chunk features charged to the host budget and written through
to the disk tier, and a draft with another tokenizer (Gemma-3's)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaModel

from chunkcache.align import decode_with_offsets, unit_ids
from chunkcache.draft import Draft
from chunkcache.hashing import chunk_key, prefix_key
from chunkcache.models import tiny_model
from chunkcache.reference import ReferenceBlender
from chunkcache.store import ChunkStore

SELECTORS = ["epic", "cacheblend", "prophet", "spec", "clip"]


@pytest.fixture(scope="module")
def blender():
    return ReferenceBlender.from_pretrained(tiny_model("llama"))


@pytest.fixture(scope="module")
def prompt(blender):
    enc = lambda s: blender.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    chunks = [f"Note {i}: the code of box {i} is {5663623 + 7 * i} and its tag is 9f1c2e7a-0b3d-{4000 + i}. "
              + "Nothing else happened that day. " * 4 for i in range(3)]
    return enc("<|im_start|>system\nAnswer briefly.\n"), [enc(c) for c in chunks], enc("Which code has box 1?")


def _whole_numbers(blender, res) -> bool:
    text, offsets = decode_with_offsets(blender.tokenizer, res.layout.token_ids.tolist())
    units = unit_ids(text, offsets)
    picked = torch.zeros(res.layout.n, dtype=torch.bool)
    picked[res.recomputed] = True
    ctx = res.layout.context_mask()
    for g in units[ctx].unique():
        members = picked[(units == g) & ctx]
        if members.any() and not members.all():
            return False
    return True


@pytest.mark.parametrize("name", SELECTORS)
@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_budget_exact_and_deterministic(blender, prompt, name, ratio):
    a = blender.blend(*prompt, selector=name, ratio=ratio)
    b = blender.blend(*prompt, selector=name, ratio=ratio)
    assert torch.equal(a.recomputed, b.recomputed)
    layout = a.layout
    assert int(layout.context_mask()[a.recomputed].sum()) == layout.budget(ratio)
    assert layout.forced_mask()[~torch.isin(torch.arange(layout.n), a.recomputed)].sum() == 0
    if name in ("spec", "clip"):
        assert _whole_numbers(blender, a)


def test_clip_keeps_auxiliary_kv_in_the_chunk_store(blender, prompt, monkeypatch):
    blender.blend(*prompt, selector="clip", ratio=0.2)
    draft = blender.draft()
    calls = []
    real = type(draft).prefill
    monkeypatch.setattr(type(draft), "prefill",
                        lambda self, ids, past=None: calls.append(ids.numel()) or real(self, ids, past))
    blender.blend(*prompt, selector="clip", ratio=0.2)
    assert calls == [len(prompt[0])]  # only the request's prefix: every chunk's auxiliary KV came from the store
    key = chunk_key(blender.fingerprint, blender.namespace, prefix_key(torch.tensor(prompt[0])),
                    torch.tensor(prompt[1][0]))
    feats = blender.store.get(key).features
    assert [k for k in feats if k.startswith("clip:")]


def test_per_chunk_features_are_charged_and_reach_the_disk_tier(blender, prompt, tmp_path, monkeypatch):
    store = ChunkStore(disk_dir=str(tmp_path), model_fingerprint=blender.fingerprint)
    monkeypatch.setattr(blender, "store", store)
    blender.blend(*prompt, selector="none")  # the chunks, stored without features
    before = store.stats().memory_bytes
    blender.blend(*prompt, selector="spec", ratio=0.2, per_chunk=True)
    assert store.stats().memory_bytes > before
    assert store.stats().memory_bytes == sum(e.nbytes for e in store.memory.entries.values())
    reopened = ChunkStore(disk_dir=str(tmp_path), model_fingerprint=blender.fingerprint)
    pkey = prefix_key(torch.tensor(prompt[0]))
    for chunk in prompt[1]:
        entry = reopened.get(chunk_key(blender.fingerprint, blender.namespace, pkey, torch.tensor(chunk)))
        assert [name for name in entry.features if name.startswith("spec:")]


@pytest.fixture(scope="module")
def gemma_draft(gemma_tokenizer):
    tok = gemma_tokenizer
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    return Draft(LlamaModel(config).eval(), tok, "tiny-gemma-vocab")


@pytest.mark.parametrize("name", ["spec", "clip"])
def test_draft_with_another_tokenizer(blender, prompt, gemma_draft, name):
    res = blender.blend(*prompt, selector=name, ratio=0.2, draft=gemma_draft)
    assert int(res.layout.context_mask()[res.recomputed].sum()) == res.layout.budget(0.2)
    assert _whole_numbers(blender, res)
    again = blender.blend(*prompt, selector=name, ratio=0.2, draft=gemma_draft)
    assert torch.equal(res.recomputed, again.recomputed)


def test_spec_per_chunk_scores_each_chunk_once(blender, prompt, monkeypatch):
    first = blender.blend(*prompt, selector="spec", ratio=0.2, per_chunk=True)
    assert int(first.layout.context_mask()[first.recomputed].sum()) == first.layout.budget(0.2)
    draft = blender.draft()
    monkeypatch.setattr(type(draft), "importance", lambda *a, **k: pytest.fail("draft ran again"))
    again = blender.blend(*prompt, selector="spec", ratio=0.2, per_chunk=True)
    assert torch.equal(first.recomputed, again.recomputed)


def test_selectors_from_yaml_config(blender, prompt, tmp_path):
    from chunkcache.config import Config
    from chunkcache.select import create

    path = tmp_path / "c.yaml"
    path.write_text("select:\n  selector: spec\n  ratio: 0.2\n  options:\n    spec: {draft: self, layers: 2, max_span: 8}\n")
    cfg = Config.load(path).select
    selector = create(cfg.selector, **cfg.options[cfg.selector])
    assert selector.layers == 2 and selector.max_span == 8
    res = blender.blend(*prompt, selector=selector, ratio=cfg.ratio)
    assert int(res.layout.context_mask()[res.recomputed].sum()) == res.layout.budget(0.2)
    assert blender.draft("self", 2).n_layers == 2


@pytest.mark.parametrize("name", ["prophet", "cacheblend"])
def test_whole_units_option_of_target_scored_selectors(blender, prompt, name):
    res = blender.blend(*prompt, selector=name, ratio=0.2, whole_units=True)
    assert int(res.layout.context_mask()[res.recomputed].sum()) == res.layout.budget(0.2)
    assert _whole_numbers(blender, res)


def test_spec_per_chunk_reuses_a_stored_score_only_for_the_same_draft_tokens(blender):
    """A chunk's stored draft importance serves a request only when the draft sees the same tokens of it: on a server
    an exact prefix reaching into a chunk leaves only its tail to blend, which a score of the whole chunk does not
    fit."""
    from chunkcache.select.base import Layout
    from chunkcache.select.draft_norm import DraftNormSelector

    draft, slot = blender.draft(), {}

    class OneChunk:  # the Features a per-chunk spec selector reads; both requests share the chunk's store slot
        def draft(self, *args):
            return draft

        def chunk_features(self, i):
            return slot

    ids = torch.arange(100, 140)
    whole = Layout(token_ids=ids, prefix_len=0, chunk_spans=((0, 30),), query_span=(30, 40))
    tail = Layout(token_ids=ids[4:], prefix_len=0, chunk_spans=((0, 26),), query_span=(26, 36))
    selector = DraftNormSelector(per_chunk=True, whole_units=False)
    selector.select(whole, 0.2, OneChunk())
    picked = selector.select(tail, 0.2, OneChunk())
    assert int(tail.context_mask()[picked.indices].sum()) == tail.budget(0.2)
    assert len(slot) == 2  # the tail was scored on its own tokens, the whole chunk's score kept
