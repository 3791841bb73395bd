"""One layer's KV of one sequence under SpeCache: what attention reads, and what each memory holds.

- host: every token's K/V in full precision (`full_k`, `full_v`);
- device pool: the low-bit codes and parameters of tokens [0, quantised), the full-precision residual
  [quantised, n), and the prefetched full-precision pairs: up to `topk` token indices per KV head (`prefetched`).

`quantised` is the largest multiple of `group` at most n - residual: K is quantised per channel over groups of
`group` tokens, so a token is quantised when its group is complete and older than the residual window (at least
`residual`, fewer than `residual + group` recent tokens stay full precision; with SGLang pages of `group` tokens
a group is a page).

Attention reads `view_k`/`view_v` [n, H, D]: the low-bit copy dequantised, the residual and the prefetched pairs
in full precision. The view is kept up to date incrementally (a group is dequantised once, when it is quantised;
a prefetch rewrites only the rows entering and leaving the prefetched set, the leaving ones dequantised from the
codes) because it stands in for what a fused kernel reads from the pool on a GPU; the bytes counted are the
pool's, never the view's.
"""

from __future__ import annotations

import torch

from ..config import SpeCacheConfig
from . import quant

FULL_BYTES = 2  # a full-precision element as the pool and the host hold it (16-bit), whatever dtype simulates it


class LayerCache:
    def __init__(self, cfg: SpeCacheConfig, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        quant.check_layout(cfg.bits, cfg.group, head_dim)
        self.cfg, self.capacity = cfg, capacity
        H, D, b, g = n_kv_heads, head_dim, cfg.bits, cfg.group
        full = dict(dtype=dtype, device=device)
        params = dict(dtype=quant.PARAM_DTYPE, device=device)
        self.full_k, self.full_v = torch.empty(capacity, H, D, **full), torch.empty(capacity, H, D, **full)
        self.view_k, self.view_v = torch.empty(capacity, H, D, **full), torch.empty(capacity, H, D, **full)
        self.codes_k = torch.empty(capacity, H, D * b // 8, dtype=torch.uint8, device=device)
        self.codes_v = torch.empty(capacity, H, D * b // 8, dtype=torch.uint8, device=device)
        self.k_scale = torch.empty(capacity // g, H, D, **params)
        self.k_zero = torch.empty_like(self.k_scale)
        self.v_scale = torch.empty(capacity, H, D // g, **params)
        self.v_zero = torch.empty_like(self.v_scale)
        self.n = 0
        self.quantised = 0
        self.prefetched = torch.empty(H, 0, dtype=torch.long, device=device)
        self._heads = torch.arange(H, device=device)[:, None]

    @property
    def n_kv_heads(self) -> int:
        return self.full_k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.full_k.shape[2]

    def quantised_len(self, n: int) -> int:
        g = self.cfg.group
        return max(n - self.cfg.residual, 0) // g * g

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens' K/V [T, H, D] (post-RoPE K, as the pool stores it) after the ones held: into the host copy and
        the residual; groups that leave the residual window are quantised into the pool."""
        T = k.shape[0]
        if self.n + T > self.capacity:
            raise ValueError(f"layer cache holds {self.capacity} tokens; {self.n} held, {T} more given")
        rows = slice(self.n, self.n + T)
        self.full_k[rows], self.full_v[rows] = k, v
        self.view_k[rows], self.view_v[rows] = k, v
        self.n += T
        lo, hi = self.quantised, self.quantised_len(self.n)
        if hi > lo:
            self._quantise(lo, hi)

    def _quantise(self, lo: int, hi: int) -> None:
        b, g = self.cfg.bits, self.cfg.group
        ck, ks, kz = quant.quantize_keys(self.full_k[lo:hi], b, g)
        cv, vs, vz = quant.quantize_values(self.full_v[lo:hi], b, g)
        self.codes_k[lo:hi], self.k_scale[lo // g : hi // g], self.k_zero[lo // g : hi // g] = ck, ks, kz
        self.codes_v[lo:hi], self.v_scale[lo:hi], self.v_zero[lo:hi] = cv, vs, vz
        dtype = self.view_k.dtype
        k = quant.dequantize_keys(ck, ks.repeat_interleave(g, 0), kz.repeat_interleave(g, 0), b)
        self.view_k[lo:hi] = k.to(dtype)
        self.view_v[lo:hi] = quant.dequantize_values(cv, vs, vz, b).to(dtype)
        self.quantised = hi

    def prefetch(self, idx: torch.Tensor) -> int:
        """Make the pairs at token indices idx [H, k'] (all below `quantised`, one row per KV head) the prefetched
        ones: rows leaving the set go back to their low-bit values, rows entering it get their full-precision
        values. Returns the host->device bytes this costs (the rows not already resident)."""
        if idx.shape[0] != self.n_kv_heads or idx.shape[1] > self.cfg.topk:
            raise ValueError(f"prefetch takes at most {self.cfg.topk} indices for each of {self.n_kv_heads} KV "
                             f"heads, got shape {tuple(idx.shape)}")
        if idx.numel() and int(idx.max()) >= self.quantised:
            raise ValueError(f"prefetched indices must be quantised tokens (< {self.quantised})")
        old = self.prefetched
        if old.numel():
            self._restore_lowbit(old)
        heads = self._heads.expand_as(idx)
        self.view_k[idx, heads] = self.full_k[idx, heads]
        self.view_v[idx, heads] = self.full_v[idx, heads]
        self.prefetched = idx
        resident = int((idx[:, :, None] == old[:, None, :]).any(-1).sum())
        return (idx.numel() - resident) * self.head_dim * 2 * FULL_BYTES

    def _restore_lowbit(self, idx: torch.Tensor) -> None:
        b, g = self.cfg.bits, self.cfg.group
        heads = self._heads.expand_as(idx)
        grp = idx // g
        k = quant.dequantize_keys(self.codes_k[idx, heads], self.k_scale[grp, heads], self.k_zero[grp, heads], b)
        v = quant.dequantize_values(self.codes_v[idx, heads], self.v_scale[idx, heads], self.v_zero[idx, heads], b)
        self.view_k[idx, heads], self.view_v[idx, heads] = k.to(self.view_k.dtype), v.to(self.view_v.dtype)

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n, H, D] as SpeCache's attention sees them."""
        return self.view_k[: self.n], self.view_v[: self.n]

    # ---- accounting (bytes of one layer; the pool counts 16-bit full-precision elements) ----------------------

    def device_bytes(self) -> int:
        """What the device pool holds for this layer: codes and parameters of the quantised tokens, the residual,
        and the prefetch buffer (allocated for `topk` pairs per KV head, whether or not filled)."""
        H, D = self.n_kv_heads, self.head_dim
        held = self.n - self.quantised + self.cfg.topk
        return lowbit_bytes(self.cfg, H, D, self.quantised) + held * full_bytes(H, D)

    def attention_read_bytes(self) -> int:
        """What one decode step's attention reads from the device pool: the low-bit copy, the residual and the
        filled prefetch rows (each head's own, so counted per head)."""
        H, D = self.n_kv_heads, self.head_dim
        prefetched_rows = self.prefetched.numel() * D * 2 * FULL_BYTES
        residual = (self.n - self.quantised) * full_bytes(H, D)
        return lowbit_bytes(self.cfg, H, D, self.quantised) + residual + prefetched_rows


def full_bytes(n_kv_heads: int, head_dim: int) -> int:
    """One token's 16-bit K and V in one layer."""
    return n_kv_heads * head_dim * 2 * FULL_BYTES


def lowbit_bytes(cfg: SpeCacheConfig, n_kv_heads: int, head_dim: int, tokens: int) -> int:
    """Codes and float16 parameters of `tokens` quantised tokens (a multiple of the group) in one layer: K has a
    (scale, zero) pair per channel per group of tokens, V one per group of channels per token."""
    H, D, g = n_kv_heads, head_dim, cfg.group
    param = torch.finfo(quant.PARAM_DTYPE).bits // 8
    codes = 2 * tokens * H * D * cfg.bits // 8
    k_params = (tokens // g) * H * D * 2 * param
    v_params = tokens * H * (D // g) * 2 * param
    return codes + k_params + v_params
