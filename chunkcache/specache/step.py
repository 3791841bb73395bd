"""The attention of SpeCache's decode step (Alg. 2 and 3), for one layer.

Decode step t feeds two rows: the real token x_t at position p and the speculative token s_t (the model's guess of
x_{t+1}) at p + 1; s_t sees x_t, x_t does not see s_t. Both attend to the cache as SpeCache holds it (low-bit,
with the prefetched pairs and the residual in full precision) plus the new rows. Row 0 yields x_{t+1}, exact with
respect to that cache; row 1 sits where x_{t+1} will sit and usually holds the same token, so its attention,
averaged over the query heads of each GQA group, picks the per-KV-head top-k whose full-precision pairs step t+1
reads. The pre-decode step (Alg. 2) is the same attention with one row, x_1, picking for step 1.

The paper takes ArgTopK over the whole row; here only tokens that will be low-bit at the next step are
candidates, since a pick in the full-precision residual (or the new token) would spend a slot on nothing.
"""

from __future__ import annotations

import torch


def speculative_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_ctx: torch.Tensor,
                          v_ctx: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [M, Hq, D]: rows at consecutive positions right after a context of n tokens, k_ctx, v_ctx [n, Hkv, D];
    k_new, v_new [M, Hkv, D] the rows' own K/V. Row i sees the context and new rows 0..i.

    Returns the output [M, Hq, D] (q's dtype) and each row's attention probabilities averaged over the query
    heads of each GQA group, [M, Hkv, n + M] float32 (query head h reads KV head h // group, as HF's repeat_kv).
    """
    M, Hq, D = q.shape
    n, Hkv = k_ctx.shape[0], k_ctx.shape[1]
    G = Hq // Hkv
    qg = q.float().reshape(M, Hkv, G, D)
    # context and new rows scored apart, so the context (the whole cache) is never copied
    scores = torch.cat([torch.einsum("mhgd,nhd->hgmn", qg, k_ctx.float()),
                        torch.einsum("mhgd,nhd->hgmn", qg, k_new.float())], dim=-1) * scale
    later = torch.ones(M, M, dtype=torch.bool, device=q.device).triu(1)
    scores[..., n:] = scores[..., n:].masked_fill(later, float("-inf"))
    probs = scores.softmax(dim=-1)  # [Hkv, G, M, n + M]
    out = (torch.einsum("hgmn,nhd->mhgd", probs[..., :n], v_ctx.float())
           + torch.einsum("hgmn,nhd->mhgd", probs[..., n:], v_new.float()))
    return out.reshape(M, Hq, D).to(q.dtype), probs.mean(dim=1).transpose(0, 1)


def select_topk(probs: torch.Tensor, candidates: int, k: int) -> torch.Tensor:
    """The k tokens among [0, candidates) with the largest probs [Hkv, N], per KV head: [Hkv, min(k, candidates)]
    int64, ascending."""
    k = min(k, candidates)
    return probs[:, :candidates].topk(k, dim=-1).indices.sort(dim=-1).values
