"""The blend's floor on this host: what a blended prefill cannot avoid, priced at stock SGLang's own rates measured in
the same run (notes: shared/notes/speed.md).

    floor = rho_eff x T_linear + (pairs_blend / pairs_stock) x T_attention + bytes_copied / bandwidth

* T_attention: stock's causal attention over the whole prompt, timed here on the model's head shapes and dtype
  (torch's causal SDPA, the kernel SGLang's torch_native prefill calls), times the layer count;
* T_linear: the rest of stock's measured TTFT on the same prompt (its matmuls, norms, sampling, scheduling);
* rho_eff: tokens the blend recomputed over the prompt's tokens (holes included);
* pairs_blend: the (query, key) pairs the recomputed tokens attend (the server reports them), against the N(N+1)/2
  of a causal prefill;
* bandwidth: this host's memory copy rate, timed here on a buffer the size of the KV copied.
Selection passes (features, select) and the fill have no floor: a selector that needs a pass earns it in quality.

Under concurrency (the closed loop) there is no per-request TTFT to split, so `StockRates` prices work instead:
stock's machine seconds per request (a block's wall time over its requests) less its attention at the timed
kernel's cost per causal pair, over the prompt tokens it computed, is its cost per computed token; a blended
request's floor is that per recomputed token, plus its attended pairs at the kernel's rate, plus its copy. Stock's
share of decoding rides in the per-token cost, so a blend's floor carries only rho's share of it: the floor is low,
and the fraction reached conservative.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkcache.cpu_dtype import best_seconds


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of_model(cls, model_dir: str, dtype: str | torch.dtype) -> "Shape":
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model_dir)
        c = getattr(c, "text_config", c)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return cls(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, head_dim, dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize


def causal_attention_s(shape: Shape, n: int, repeats: int = 3) -> float:
    """Seconds of stock's causal attention over an n-token prompt, all layers (one layer timed, times the count)."""
    q = torch.randn(1, shape.heads, n, shape.head_dim).to(shape.dtype)
    k, v = (torch.randn(1, shape.kv_heads, n, shape.head_dim).to(shape.dtype) for _ in range(2))
    one = best_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=shape.head_dim ** -0.5,
                                                       enable_gqa=shape.heads != shape.kv_heads), repeats)
    return one * shape.layers


def copy_bandwidth(nbytes: int, repeats: int = 3) -> float:
    """Bytes per second of a plain memory copy of `nbytes` (at least 64 MB, so caches do not flatter it)."""
    nbytes = max(nbytes, 64 << 20)
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return nbytes / best_seconds(lambda: dst.copy_(src), repeats)


@dataclass(frozen=True)
class Floor:
    recompute_s: float  # rho_eff x T_linear + pairs share x T_attention
    copy_s: float  # bytes copied / bandwidth

    @property
    def total_s(self) -> float:
        return self.recompute_s + self.copy_s


def floor(shape: Shape, n: int, stock_s: float, recomputed: int, pairs: int, reused: int,
          attention_s: float, bandwidth: float) -> Floor:
    """The floor of one blended request of n prompt tokens whose stock TTFT was `stock_s`."""
    linear = max(stock_s - attention_s, 0.0)
    recompute = recomputed / n * linear + pairs / (n * (n + 1) / 2) * attention_s
    return Floor(recompute, reused * shape.kv_bytes_per_token / bandwidth)


def causal_pairs(n: int, cached: int = 0) -> int:
    """(query, key) pairs a causal prefill of tokens [cached, n) attends over the whole n-token context."""
    return (n * (n + 1) - cached * (cached + 1)) // 2


@dataclass(frozen=True)
class StockRates:
    """Stock's own cost per unit of work on this host under a load (see the module's docstring)."""

    token_s: float  # per computed prompt token, attention excluded
    pair_s: float  # per causal (query, key) pair of attention
    copy_bytes_s: float  # a plain memory copy's bandwidth

    @classmethod
    def measured(cls, seconds: float, computed: list[tuple[int, int]], pair_s: float,
                 copy_bytes_s: float) -> "StockRates":
        """From stock's wall `seconds` for requests whose (prompt, cached) tokens are `computed`."""
        attention = pair_s * sum(causal_pairs(n, c) for n, c in computed)
        return cls(max(seconds - attention, 0.0) / sum(n - c for n, c in computed), pair_s, copy_bytes_s)

    def blend_s(self, shape: Shape, recomputed: int, pairs: int, reused: int) -> float:
        return recomputed * self.token_s + pairs * self.pair_s + reused * shape.kv_bytes_per_token / self.copy_bytes_s

    def stock_s(self, n: int, cached: int) -> float:
        return (n - cached) * self.token_s + causal_pairs(n, cached) * self.pair_s
