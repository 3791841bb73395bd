"""The in-process draft: zero-copy self truncation, Eq. 1 against output_hidden_states, query attention against an
eager forward, KV continuation."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from chunkcache.draft import load
from chunkcache.models import tiny_model


@pytest.fixture(scope="module")
def target():
    path = tiny_model("llama", num_hidden_layers=6)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(5, 2000, (40,), generator=torch.Generator().manual_seed(0))


def test_self_draft_shares_the_target_weights(target):
    draft = load("self", layers=2, target=target)
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert {p.data_ptr() for p in draft.model.parameters()} <= target_ptrs
    assert draft.n_layers == 2 and len(draft.model.layers) == 2
    assert target.config.num_hidden_layers == 6 and len(target.model.layers) == 6
    assert load("self", target=target).n_layers == 2  # default: a third of the target


@pytest.mark.parametrize("layers", [6, 3])
def test_importance_is_eq1_from_output_hidden_states(target, ids, layers):
    draft = load("self", layers=layers, target=target)
    with torch.no_grad():
        hs = target(ids[None], output_hidden_states=True).hidden_states  # embeddings, layer 1..6 (6 normed)
    # deep layers = the last third of the draft's S layers: D..S
    s = layers
    d = s - max(1, round(s / 3)) + 1
    states = [hs[l][0] for l in range(d, s + 1)]
    if s < 6:  # the truncated model's last hidden state goes through the final norm, as HF's last one does
        states[-1] = target.model.norm(states[-1])
    by_hand = torch.stack([h.norm(dim=-1) for h in states]).mean(0)
    torch.testing.assert_close(draft.importance(ids), by_hand, rtol=1e-5, atol=1e-5)


def test_query_attention_matches_an_eager_forward(target, ids):
    draft = load("self", layers=3, target=target)
    past = draft.prefill(ids[:30])
    past = torch.cat([past, draft.prefill(ids[30:34], past=past)], dim=2)
    got = draft.query_attention(past, ids[34:])
    eager = AutoModelForCausalLM.from_pretrained(tiny_model("llama", num_hidden_layers=6), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    eager.config.num_hidden_layers = 3
    with torch.no_grad():
        attn = eager(ids[None], output_attentions=True).attentions[-1][0]  # [heads, 40, 40] of layer 3
    torch.testing.assert_close(got, attn[:, 34:, :34].mean(dim=(0, 1)), rtol=1e-4, atol=1e-6)
    assert target.config._attn_implementation == "sdpa"  # the target's own attention is untouched


def test_prefill_continues_positions(target, ids):
    draft = load("self", layers=2, target=target)
    whole = draft.prefill(ids)
    parts = torch.cat([draft.prefill(ids[:25]), draft.prefill(ids[25:], past=draft.prefill(ids[:25]))], dim=2)
    assert whole.shape == (2, 2, 40, 2, 16)
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


def test_separate_draft_from_a_directory():
    draft = load(str(tiny_model("qwen2")), layers=2)
    assert draft.n_layers == 2 and draft.tokenizer is not None
    assert draft.importance(torch.arange(5, 25)).shape == (20,)
