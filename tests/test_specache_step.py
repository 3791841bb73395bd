"""SpeCache's per-layer cache view and the two-token decode step, against a reference written from the paper
(Alg. 3): K = [K' with the kappa_t pairs replaced by their 16-bit values, K_t], masked softmax where x_t does not
see s_t, O = AV, kappa_{t+1} = ArgTopK of the speculative row averaged over each GQA group."""

import pytest
import torch

from chunkcache.config import SpeCacheConfig
from chunkcache.specache.layer_cache import LayerCache, full_bytes, lowbit_bytes
from chunkcache.specache.step import select_topk, speculative_attention

H_KV, GROUPS, D = 2, 3, 16
CFG = dict(group=8, residual=12, topk=5)


def naive_lowbit(x: torch.Tensor, bits: int, group: int, per: str) -> torch.Tensor:
    """Quantise-dequantise with explicit loops: keys per channel over `group` tokens, values per token over
    `group` channels; levels as the paper states them."""
    out = torch.empty_like(x)
    T, H, Dh = x.shape
    for h in range(H):
        if per == "channel":
            blocks = [(slice(t, t + group), c) for t in range(0, T, group) for c in range(Dh)]
        else:
            blocks = [(t, slice(c, c + group)) for t in range(T) for c in range(0, Dh, group)]
        for rows, cols in blocks:
            g = x[rows, h, cols]
            lo, hi = float(g.min()), float(g.max())
            if bits == 1:
                zero, scale = (3 * lo + hi) / 4, (hi - lo) / 2
            else:
                zero, scale = lo, (hi - lo) / (2**bits - 1)
            zero, scale = float(torch.tensor(zero).half()), float(torch.tensor(scale).half())
            codes = ((g - zero) / scale).round().clamp(0, 2**bits - 1) if scale else torch.zeros_like(g)
            out[rows, h, cols] = codes * scale + zero
    return out


def filled(bits: int, n: int, seed: int = 0) -> tuple[LayerCache, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    k, v = torch.randn(n, H_KV, D), torch.randn(n, H_KV, D)
    cache = LayerCache(SpeCacheConfig(bits=bits, **CFG), H_KV, D, capacity=n + 8)
    cache.append(k, v)
    return cache, k, v


@pytest.mark.parametrize("bits", [1, 2])
def test_view_is_lowbit_residual_and_prefetched(bits):
    cache, k, v = filled(bits, 50)
    Q = (50 - 12) // 8 * 8
    assert cache.quantised == Q == 32
    vk, vv = cache.view()
    assert torch.allclose(vk[:Q], naive_lowbit(k[:Q], bits, 8, "channel"), atol=1e-5)
    assert torch.allclose(vv[:Q], naive_lowbit(v[:Q], bits, 8, "token"), atol=1e-5)
    assert torch.equal(vk[Q:], k[Q:]) and torch.equal(vv[Q:], v[Q:])
    lowbit_k, lowbit_v = vk.clone(), vv.clone()

    first = torch.tensor([[0, 3, 9, 17, 31], [1, 2, 8, 20, 30]])
    assert cache.prefetch(first) == first.numel() * D * 2 * 2  # 16-bit K and V of every row, none resident yet
    for h in range(H_KV):
        rows = first[h]
        assert torch.equal(cache.view()[0][rows, h], k[rows, h]) and torch.equal(cache.view()[1][rows, h], v[rows, h])
        other = torch.tensor([i for i in range(50) if i not in rows.tolist()])
        assert torch.equal(cache.view()[0][other, h], lowbit_k[other, h])
    second = torch.tensor([[0, 3, 9, 17, 30], [4, 5, 6, 7, 10]])
    assert cache.prefetch(second) == (1 + 5) * D * 2 * 2  # only the rows not already resident move
    assert torch.equal(cache.view()[0][31, 0], lowbit_k[31, 0])  # left the set: back to its low-bit value
    assert torch.equal(cache.view()[1][1, 1], lowbit_v[1, 1])

    every = LayerCache(SpeCacheConfig(bits=bits, group=8, residual=12, topk=Q), H_KV, D, capacity=58)
    every.append(k, v)
    every.prefetch(torch.arange(Q).repeat(H_KV, 1))
    assert torch.equal(every.view()[0], k) and torch.equal(every.view()[1], v)  # all pairs fetched: exact


def test_appending_one_by_one_equals_at_once():
    cache, k, v = filled(1, 50)
    step = LayerCache(SpeCacheConfig(bits=1, **CFG), H_KV, D, capacity=58)
    step.append(k[:30], v[:30])
    assert step.quantised == 16
    for i in range(30, 50):
        step.append(k[i : i + 1], v[i : i + 1])
        assert step.quantised == max(i + 1 - 12, 0) // 8 * 8
    assert torch.equal(step.view()[0], cache.view()[0]) and torch.equal(step.view()[1], cache.view()[1])


def test_accounting():
    """SmolLM2's layer shape (3 KV heads, head_dim 64) at 1 bit, g = 32: per token K codes 8 B + K params 8 B + V
    codes 8 B + V params 8 B per head, an eighth of 16-bit K/V."""
    cfg = SpeCacheConfig(bits=1, group=32, residual=64, topk=64)
    assert lowbit_bytes(cfg, 3, 64, 320) == 320 * 3 * 32
    assert lowbit_bytes(cfg, 3, 64, 320) * 8 == 320 * full_bytes(3, 64)
    assert lowbit_bytes(SpeCacheConfig(bits=2, group=32), 3, 64, 32) == 32 * 3 * 48
    cache = LayerCache(cfg, 3, 64, capacity=1000)
    cache.append(torch.randn(1000, 3, 64), torch.randn(1000, 3, 64))
    Q = 928
    assert cache.device_bytes() == lowbit_bytes(cfg, 3, 64, Q) + (1000 - Q + 64) * full_bytes(3, 64)
    cache.prefetch(torch.arange(64).repeat(3, 1))
    assert cache.attention_read_bytes() == lowbit_bytes(cfg, 3, 64, Q) + (1000 - Q + 64) * full_bytes(3, 64)


def paper_step(cache: LayerCache, full_k, full_v, kappa, q, k_new, v_new, scale, candidates, topk):
    """Alg. 3 as written, materialised: the mixed cache, repeat_kv, A = softmax(QK^T) with x_t blind to s_t."""
    bits, g = cache.cfg.bits, cache.cfg.group
    n, Q = cache.n, cache.quantised
    K = torch.cat([naive_lowbit(full_k[:Q], bits, g, "channel"), full_k[Q:n]])
    V = torch.cat([naive_lowbit(full_v[:Q], bits, g, "token"), full_v[Q:n]])
    for h in range(H_KV):
        K[kappa[h], h], V[kappa[h], h] = full_k[kappa[h], h], full_v[kappa[h], h]
    K, V = torch.cat([K, k_new]), torch.cat([V, v_new])
    M = q.shape[0]
    Kr, Vr = K.repeat_interleave(GROUPS, dim=1), V.repeat_interleave(GROUPS, dim=1)  # [n+M, Hq, D]
    A = torch.einsum("mhd,nhd->hmn", q, Kr) * scale
    for i in range(M):
        A[:, i, n + i + 1 :] = float("-inf")
    A = A.softmax(-1)
    O = torch.einsum("hmn,nhd->mhd", A, Vr)
    avg = A[:, -1].reshape(H_KV, GROUPS, -1).mean(1)
    kappa_next = [sorted(avg[h, :candidates].topk(min(topk, candidates)).indices.tolist()) for h in range(H_KV)]
    return O, kappa_next


@pytest.mark.parametrize("bits,rows", [(1, 2), (2, 2), (1, 1)])
def test_step_matches_paper(bits, rows):
    cache, k, v = filled(bits, 50, seed=bits)
    kappa = torch.tensor([[2, 5, 11, 19, 23], [0, 7, 8, 29, 31]])
    cache.prefetch(kappa)
    torch.manual_seed(7)
    q, k_new, v_new = torch.randn(rows, H_KV * GROUPS, D), torch.randn(rows, H_KV, D), torch.randn(rows, H_KV, D)
    scale = D**-0.5
    out, probs = speculative_attention(q, k_new, v_new, *cache.view(), scale)
    candidates = cache.quantised_len(51)  # x_t joins the cache before the next step
    ref_out, ref_kappa = paper_step(cache, k, v, kappa, q, k_new, v_new, scale, candidates, 5)
    assert torch.allclose(out, ref_out, atol=1e-5)
    assert select_topk(probs[-1], candidates, 5).tolist() == ref_kappa
    assert probs.shape == (rows, H_KV, 50 + rows)


def test_real_token_does_not_see_speculative_token():
    cache, _, _ = filled(1, 50)
    torch.manual_seed(3)
    q, k_new, v_new = torch.randn(2, H_KV * GROUPS, D), torch.randn(2, H_KV, D), torch.randn(2, H_KV, D)
    out, probs = speculative_attention(q, k_new, v_new, *cache.view(), 0.25)
    k_other, v_other = k_new.clone(), v_new.clone()
    k_other[1], v_other[1] = torch.randn(H_KV, D), torch.randn(H_KV, D)
    out2, probs2 = speculative_attention(q, k_other, v_other, *cache.view(), 0.25)
    assert torch.equal(out[0], out2[0]) and not torch.allclose(out[1], out2[1])
    assert (probs[0, :, -1] == 0).all() and (probs[1, :, -2] > 0).all()  # s_t attends to x_t


def test_prefetch_refused_outside_lowbit():
    cache, _, _ = filled(1, 50)
    with pytest.raises(ValueError, match="quantised tokens"):
        cache.prefetch(torch.tensor([[40], [1]]))
    with pytest.raises(ValueError, match="at most 5"):
        cache.prefetch(torch.zeros(2, 6, dtype=torch.long))
