"""The oracle selector: its scores are the reused KV's deviation from full recompute, computed here by hand from two HF
caches (full prefill and naive reuse), its picks the top of that, and no other selector leaves less of that deviation
in the prompt at the same budget. Engines that cannot serve full recompute's KV refuse it with a clear error."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from chunkcache.blend.features import RequestFeatures
from chunkcache.models import tiny_model
from chunkcache.reference import ReferenceBlender
from chunkcache.select import create
from chunkcache.select.base import Layout
from chunkcache.select.budget import rank

RATIO = 0.25


@pytest.fixture(scope="module")
def blender():
    return ReferenceBlender.from_pretrained(tiny_model("llama"))


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(5, 1000, (6,), generator=g).tolist()
    chunks = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (14, 11, 17)]
    return prefix, chunks, torch.randint(5, 1000, (5,), generator=g).tolist()


def _per_token(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, N, H*D] K and V of an HF cache of one sequence."""
    ks, vs = zip(*[(k[0].transpose(0, 1).flatten(1), v[0].transpose(0, 1).flatten(1)) for k, v, *_ in cache])
    return torch.stack(ks).float(), torch.stack(vs).float()


def _deviation(a, b) -> torch.Tensor:
    """[N]: summed over layers, ||K_a - K_b|| + ||V_a - V_b|| per token."""
    (ka, va), (kb, vb) = _per_token(a), _per_token(b)
    return (ka - kb).norm(dim=2).sum(0) + (va - vb).norm(dim=2).sum(0)


@pytest.fixture(scope="module")
def truth(blender, prompt):
    """By hand: the context slots of naive reuse hold the stored KV; full prefill is the unmodified HF forward."""
    full = blender.full_prefill(*prompt)
    reused = blender.blend(*prompt, selector="none")
    return full, _deviation(reused.past_key_values, full.past_key_values) * reused.layout.context_mask()


def test_oracle_scores_are_the_true_deviation_and_it_picks_their_top(blender, prompt, truth):
    _, expected = truth
    res = blender.blend(*prompt, selector="oracle", ratio=RATIO)
    ctx = res.layout.context_mask()
    assert float(expected[ctx].min()) >= 0 and float(expected[ctx].max()) > 0
    torch.testing.assert_close(res.scores, expected, rtol=1e-4, atol=1e-5)
    picked = torch.zeros_like(ctx)
    picked[rank(expected, ctx)[: res.layout.budget(RATIO)]] = True
    assert torch.equal(res.recomputed, (picked | res.layout.forced_mask()).nonzero().flatten())


def test_attended_oracle_weighs_each_layer_by_full_recomputes_query_attention(blender, prompt):
    """By hand: HF's eager forward over the whole prompt gives each layer's attention; the query rows' mean over rows
    and heads weighs that layer's ||dK|| + ||dV||."""
    model = AutoModelForCausalLM.from_pretrained(blender.model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    reused = blender.blend(*prompt, selector="none")
    layout = reused.layout
    with torch.no_grad():
        full = model(layout.token_ids[None], use_cache=True, output_attentions=True)
    (kr, vr), (kf, vf) = _per_token(reused.past_key_values), _per_token(full.past_key_values)
    per_layer = (kr - kf).norm(dim=2) + (vr - vf).norm(dim=2)  # [L, N]
    q0, q1 = layout.query_span
    attn = torch.stack([a[0, :, q0:q1].mean(dim=(0, 1)) for a in full.attentions])  # [L, N]
    expected = (per_layer * attn).sum(0) * layout.context_mask()
    res = blender.blend(*prompt, selector="oracle", ratio=RATIO, attended=True)
    torch.testing.assert_close(res.scores, expected, rtol=1e-4, atol=1e-6)
    picked = torch.zeros(layout.n, dtype=torch.bool)
    picked[rank(expected, layout.context_mask())[: layout.budget(RATIO)]] = True
    assert torch.equal(res.recomputed, (picked | layout.forced_mask()).nonzero().flatten())
    # not the unweighted sum rescaled: the query reads some deviating tokens more than others
    plain = blender.blend(*prompt, selector="oracle", ratio=RATIO)
    ctx = layout.context_mask()
    assert not torch.equal(rank(res.scores, ctx), rank(plain.scores, ctx))


def test_no_selector_leaves_less_reused_deviation_than_the_oracle(blender, prompt, truth):
    _, expected = truth
    left = {}
    for name in ("oracle", "epic", "cacheblend", "prophet", "mix"):
        res = blender.blend(*prompt, selector=name, ratio=RATIO)
        ctx = res.layout.context_mask()
        assert int(ctx[res.recomputed].sum()) == res.layout.budget(RATIO)
        unselected = ctx.clone()
        unselected[res.recomputed] = False
        left[name] = float(expected[unselected].sum())
    assert all(left["oracle"] <= v + 1e-6 for v in left.values()), left


def test_oracle_blend_is_closer_to_full_recompute_than_naive_reuse(blender, prompt, truth):
    full, _ = truth
    after = {}
    for name in ("none", "oracle"):
        res = blender.blend(*prompt, selector=name, ratio=RATIO)
        after[name] = float((_deviation(res.past_key_values, full.past_key_values) * res.layout.context_mask()).sum())
    assert after["oracle"] < 0.9 * after["none"], after


class _NoFullKV:
    """Features of an engine that serves the cheap signals only (the server's today)."""

    def query_attention(self):
        return torch.ones(8)


def test_an_engine_without_full_kv_refuses_the_oracle_clearly():
    layout = Layout(torch.arange(8), 1, ((1, 5),), (5, 8))
    with pytest.raises(NotImplementedError, match="oracle selector needs full recompute's KV.*reference blender"):
        create("oracle").select(layout, 0.5, _NoFullKV())

    class Passes:  # a pipeline engine without the optional true_deviation pass
        n_layers = 2

    features = RequestFeatures(Passes(), models=None, index=0, layout=layout, entries=[])
    with pytest.raises(NotImplementedError, match="Passes does not serve true_deviation"):
        create("oracle").select(layout, 0.5, features)
