"""ProphetKV through the reference blender equals a naive explicit-attention reimplementation (HF eager forward of
the query over hand-assembled reused KV)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from chunkcache.models import tiny_model
from chunkcache.reference import ReferenceBlender
from chunkcache.select.budget import rank


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _naive_query_attention(path, prefix, chunks, query) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    inner = model.model
    P = len(prefix)
    ks, vs = None, None
    pos = P
    with torch.no_grad():
        for c in chunks:
            # the chunk alone right after the prefix, as the store computes it
            out = model(torch.tensor([prefix + c]), use_cache=True)
            k = torch.stack([l.keys[0, :, P:] for l in out.past_key_values.layers])  # [L, H, T, D]
            v = torch.stack([l.values[0, :, P:] for l in out.past_key_values.layers])
            if ks is None:  # the prefix part of any of these runs is the exact prefix KV
                ks = [torch.stack([l.keys[0, :, :P] for l in out.past_key_values.layers])]
                vs = [torch.stack([l.values[0, :, :P] for l in out.past_key_values.layers])]
            # move K from positions P.. to pos..: rotate by the position delta
            cos, sin = inner.rotary_emb(k, torch.tensor([[pos - P]]))
            ks.append(k * cos[0, 0] + _rotate_half(k) * sin[0, 0])
            vs.append(v)
            pos += len(c)
        k_all, v_all = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        cache = DynamicCache([(k_all[l][None], v_all[l][None]) for l in range(k_all.shape[0])])
        out = model(torch.tensor([query]), position_ids=torch.arange(pos, pos + len(query))[None],
                    past_key_values=cache, output_attentions=True)
    # per layer: mean over heads and query tokens; fused by summing over layers (Alg. 1)
    return sum(a[0].mean(dim=(0, 1)) for a in out.attentions)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prophet_matches_naive_attention(arch):
    path = tiny_model(arch)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(5, 1000, (5,), generator=g).tolist()
    chunks = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (12, 9, 15)]
    query = torch.randint(5, 1000, (6,), generator=g).tolist()
    naive = _naive_query_attention(path, prefix, chunks, query)

    blender = ReferenceBlender.from_pretrained(path)
    res = blender.blend(prefix, chunks, query, selector="prophet", ratio=0.25)
    ctx = res.layout.context_mask()
    torch.testing.assert_close(res.scores[ctx], naive[: ctx.numel()][ctx].float(), rtol=1e-4, atol=1e-5)
    picked = rank(naive[: ctx.numel()], ctx)[: res.layout.budget(0.25)]
    expected = (res.layout.forced_mask() | torch.zeros_like(ctx).index_fill(0, picked, True)).nonzero().flatten()
    assert torch.equal(res.recomputed, expected)
