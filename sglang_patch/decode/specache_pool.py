"""SpeCache's low-bit side pool: the quantised K/V of SGLang's KV slots, every layer.

SGLang has no 1- or 2-bit KV dtype, so the low-bit copy is a plugin-owned pool indexed like SGLang's own: codes
and V's per-token (scale, zero) by KV slot, K's per-channel (scale, zero) by group of `group` slots. K groups are
`group` consecutive positions of one request (chunkcache.specache.quant); with SGLang's page size a multiple of the
group, a group is `group` consecutive slots of one page (the allocator keeps slot % page == position % page), so
`slot // group` names it, and a radix-shared prefix shares whole groups.

SGLang's own pool buffers keep every token's full-precision K/V: they are the host copy that residual rows and
prefetched pairs are read from. Quantising is a pure function of that copy, so the low-bit pool is filled from it
(`quantise`) whenever a request's group leaves its residual window, whoever wrote the slots (SGLang's extend,
chunkcache's blended prefill, a radix-matched prefix quantised by an earlier request: same slots, same codes).
"""

from __future__ import annotations

import torch

from chunkcache.config import SpeCacheConfig
from chunkcache.specache import quant


class LowBitPool:
    def __init__(self, cfg: SpeCacheConfig, kv_pool):
        k0 = kv_pool.get_key_buffer(0)
        rows, H, D = k0.shape
        quant.check_layout(cfg.bits, cfg.group, D)
        if rows % cfg.group:
            raise ValueError(f"KV pool of {rows} slots is not whole groups of {cfg.group}")
        self.cfg, self.kv_pool = cfg, kv_pool
        self.layers, self.heads, self.head_dim = kv_pool.layer_num, H, D
        L, b, g = self.layers, cfg.bits, cfg.group
        codes = dict(dtype=torch.uint8, device=k0.device)
        params = dict(dtype=quant.PARAM_DTYPE, device=k0.device)
        self.codes_k = torch.zeros(L, rows, H, D * b // 8, **codes)
        self.codes_v = torch.zeros(L, rows, H, D * b // 8, **codes)
        self.k_scale = torch.zeros(L, rows // g, H, D, **params)
        self.k_zero = torch.zeros_like(self.k_scale)
        self.v_scale = torch.zeros(L, rows, H, D // g, **params)
        self.v_zero = torch.zeros_like(self.v_scale)
        # byte -> its 8 // bits codes as floats: one gather unpacks a row (quant.unpack's order)
        self._lut = quant.unpack(torch.arange(256, dtype=torch.uint8, device=k0.device)[:, None], b).float()
        self._heads = torch.arange(H, device=k0.device)[:, None]

    # ---- accounting -----------------------------------------------------------------------------------------

    def lowbit_bytes_per_token(self) -> int:
        """Codes and parameters of one quantised token, all layers (what the device pool holds per token)."""
        from chunkcache.specache.layer_cache import lowbit_bytes

        g = self.cfg.group
        return lowbit_bytes(self.cfg, self.heads, self.head_dim, g) // g * self.layers

    def full_bytes_per_token(self) -> int:
        """One token's K and V in SGLang's pool, all layers (stock's device bytes per token; here the host copy)."""
        return 2 * self.heads * self.head_dim * self.elem_bytes * self.layers

    @property
    def elem_bytes(self) -> int:
        return self.kv_pool.get_key_buffer(0).element_size()

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.codes_k, self.codes_v, self.k_scale, self.k_zero, self.v_scale, self.v_zero))

    # ---- writing --------------------------------------------------------------------------------------------

    def quantise(self, slots: torch.Tensor) -> None:
        """Quantise the full-precision K/V at `slots` (whole groups: each run of `group` is one request's group,
        in position order) into the low-bit pool, every layer."""
        g, b = self.cfg.group, self.cfg.bits
        if slots.numel() == 0:
            return
        runs = slots.view(-1, g)
        if bool((runs[:, 0] % g != 0).any()) or bool((runs - runs[:, :1] != torch.arange(g, device=slots.device)).any()):
            raise RuntimeError(f"SpeCache: a group of {g} positions is not one aligned run of {g} KV slots; the "
                               f"page size must be a multiple of decode.specache.group")
        groups = runs[:, 0] // g
        for layer in range(self.layers):
            k = self.kv_pool.get_key_buffer(layer)[slots]
            v = self.kv_pool.get_value_buffer(layer)[slots]
            self.codes_k[layer, slots], ks, kz = quant.quantize_keys(k, b, g)
            self.k_scale[layer, groups], self.k_zero[layer, groups] = ks, kz
            self.codes_v[layer, slots], vs, vz = quant.quantize_values(v, b, g)
            self.v_scale[layer, slots], self.v_zero[layer, slots] = vs, vz

    # ---- reading --------------------------------------------------------------------------------------------

    def context(self, layer: int, slots: torch.Tensor, quantised: int, prefetched: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n, H, D] float32 of a request's context (its slots in position order) as SpeCache's attention
        reads them: positions [0, quantised) low-bit except the `prefetched` [H, k] positions of each KV head,
        which are full precision from the host copy, as is the residual [quantised, n)."""
        g = self.cfg.group
        k_buf, v_buf = self.kv_pool.get_key_buffer(layer), self.kv_pool.get_value_buffer(layer)
        low = slots[:quantised]
        groups = low[::g] // g
        # the same arithmetic as quant.dequantize_*: codes * scale + zero in float32, K's parameters broadcast over
        # their group's tokens
        k = self._codes(self.codes_k[layer, low]).unflatten(0, (-1, g))
        k = (k * self.k_scale[layer, groups].float()[:, None] + self.k_zero[layer, groups].float()[:, None]).flatten(0, 1)
        v = self._codes(self.codes_v[layer, low]).unflatten(-1, (-1, g))
        v = (v * self.v_scale[layer, low].float()[..., None] + self.v_zero[layer, low].float()[..., None]).flatten(-2)
        if prefetched.numel():
            heads = self._heads.expand_as(prefetched)
            at = low[prefetched]
            k[prefetched, heads] = k_buf[at, heads].float()
            v[prefetched, heads] = v_buf[at, heads].float()
        rest = slots[quantised:]
        return torch.cat([k, k_buf[rest].float()]), torch.cat([v, v_buf[rest].float()])

    def _codes(self, packed: torch.Tensor) -> torch.Tensor:
        # index_select: ~3x faster than advanced indexing on this CPU
        codes = self._lut.index_select(0, packed.reshape(-1).long())
        return codes.view(*packed.shape[:-1], packed.shape[-1] * self._lut.shape[1])  # no -1: a context may be empty
