"""Moving cached post-RoPE keys to new positions.

With angle(p) = p * inv_freq, rotations compose: R(p + d) = R(d) R(p). A key cached at position p is moved to
p + d by rotating it by d, exactly, for every RoPE whose frequencies do not depend on the position or the sequence
length: default, linear (scaled inv_freq) and llama3 (per-frequency scaled inv_freq), per layer where layers differ
(a base per layer type; a layer without RoPE has zero frequencies). Everything else is refused.

The frequencies are computed exactly as transformers computes them (float32 ops in the same order), angles in
float64 and the rotation in float32 (any input dtype). Transformers (and SGLang) round each angle p * inv_freq to
float32, an error of ~p * 6e-8 rad (1e-4 rad at position 2000); given the cached positions, `rerotate` reproduces
that rounding at the new position instead of adding its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

SUPPORTED = ("default", "linear", "llama3")


class UnsupportedRope(ValueError):
    """The model's RoPE cannot be re-rotated exactly, so its cached KV cannot be moved."""


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    # float32, bit-identical to transformers' rotary embedding: [head_dim // 2] when every layer rotates alike, else
    # [layers, head_dim // 2] (each layer's own; zeros for a layer without RoPE, whose keys then never move)
    inv_freq: torch.Tensor
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> "RopeSpec":
        """From a transformers config (5.x `rope_parameters`, or the older `rope_scaling` + `rope_theta`). Per-layer
        RoPE comes from `layer_types` with `rope_parameters` keyed by layer type (Gemma 3: local and global bases)
        and from `no_rope_layers` (SmolLM3: 0 marks a layer without RoPE)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params = _rope_parameters(config)
        by_type = {k: v for k, v in params.items() if isinstance(v, dict)}
        if by_type:
            layer_types = list(getattr(config, "layer_types", None) or ())
            missing = sorted(set(layer_types) - set(by_type))
            if not layer_types or missing:
                raise UnsupportedRope(f"RoPE type 'per-layer' without parameters for layer types {missing or '?'}")
            kinds = {name: _inv_freq(p, config, head_dim) for name, p in by_type.items()}
            rope_type = "+".join(sorted({kinds[t][0] for t in layer_types}))
            rows = [kinds[t][1] for t in layer_types]
        else:
            rope_type, inv_freq = _inv_freq(params, config, head_dim)
            rows = None
        use_rope = getattr(config, "no_rope_layers", None)
        if use_rope is not None and not all(use_rope):
            rows = rows or [inv_freq] * len(use_rope)
            rows = [r if on else torch.zeros_like(r) for r, on in zip(rows, use_rope)]
            rope_type += "+nope"
        if rows is not None and all(torch.equal(r, rows[0]) for r in rows):
            inv_freq, rows = rows[0], None
        return cls(rope_type=rope_type, inv_freq=inv_freq if rows is None else torch.stack(rows), head_dim=head_dim)

    @property
    def per_layer(self) -> bool:
        return self.inv_freq.dim() == 2


def _inv_freq(params: dict, config: Any, head_dim: int) -> tuple[str, torch.Tensor]:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED:
        raise UnsupportedRope(
            f"RoPE type {rope_type!r} cannot be re-rotated exactly; chunk reuse supports {', '.join(SUPPORTED)}"
        )
    if "mrope_section" in params or params.get("mrope_interleaved"):
        raise UnsupportedRope("RoPE type 'mrope' (multimodal sections) is not supported for chunk reuse")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    if partial < 1.0:
        raise UnsupportedRope(f"RoPE type 'partial rotary' (partial_rotary_factor={partial}) is not supported")
    base = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, params, config)
    return rope_type, inv_freq


def _rope_parameters(config: Any) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
    return params


def _llama3(inv_freq: torch.Tensor, params: dict, config: Any) -> torch.Tensor:
    """transformers' `_compute_llama3_parameters`, same float32 operations in the same order."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params.get("original_max_position_embeddings", config.max_position_embeddings)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' convention: the two halves of the head dimension form the (real, imaginary) pairs."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rerotate(k: torch.Tensor, delta: int | torch.Tensor, spec: RopeSpec,
             positions: torch.Tensor | None = None) -> torch.Tensor:
    """Keys `k` [..., T, H, D], post-RoPE, moved by `delta` positions (an int, or a [T] tensor per token). With
    per-layer RoPE (`spec.per_layer`) `k` must be the store's [L, T, H, D], every layer rotated by its own frequencies.

    With `positions` ([T], where the keys were computed) the result reproduces the model's own rounding: the model
    rotates by float32(p * inv_freq), so the rotation applied is float32(p_new * inv_freq) - float32(p * inv_freq),
    exact in float64, and a moved key equals the key computed directly at its new position to float32 precision at
    any position. Without it the rotation is the exact delta * inv_freq.
    """
    if k.shape[-1] != spec.head_dim:
        raise ValueError(f"keys have head_dim {k.shape[-1]}, RoPE expects {spec.head_dim}")
    if positions is None and not isinstance(delta, torch.Tensor) and delta == 0:
        return k
    return Rotation.of(delta, spec, positions, k.device).apply(k)


@dataclass(frozen=True)
class Rotation:
    """One move of keys (rerotate's), its cos and sin computed once, for keys moved a layer at a time (the blend's
    layer-by-layer copy): [T or 1, 1, D / 2] float32, or [L, T or 1, 1, D / 2] for per-layer RoPE."""

    cos: torch.Tensor
    sin: torch.Tensor
    per_layer: bool

    @classmethod
    def of(cls, delta: int | torch.Tensor, spec: RopeSpec, positions: torch.Tensor | None = None,
           device: torch.device | None = None) -> "Rotation":
        inv_freq = spec.inv_freq.to(device)
        if spec.per_layer:
            inv_freq = inv_freq[:, None, :]  # [L, 1, F]: angles [L, T, F]
        d = torch.as_tensor(delta, device=device).reshape(-1, 1)  # [T or 1, 1]
        if positions is None:
            angles = d.double() * inv_freq.double()
        else:
            p = positions.to(device).reshape(-1, 1)
            angles = ((p + d).float() * inv_freq).double() - (p.float() * inv_freq).double()
        # [(L,) T or 1, 1, F]: broadcasts over heads
        return cls(angles.cos().float().unsqueeze(-2), angles.sin().float().unsqueeze(-2), spec.per_layer)

    def layer(self, i: int) -> "Rotation":
        """Layer i's rotation, for its keys [T, H, D]."""
        return replace(self, cos=self.cos[i], sin=self.sin[i], per_layer=False) if self.per_layer else self

    def apply(self, k: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`k` moved; written into `out` (k's shape, e.g. its slots of a KV pool) when given."""
        if self.per_layer and (k.dim() != 4 or k.shape[0] != self.cos.shape[0]):
            raise ValueError(f"per-layer RoPE moves keys stacked [L, T, H, D] for its {self.cos.shape[0]} layers; "
                             f"got {tuple(k.shape)}")
        # rotate_half's pairs: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each half written once into the output
        half = k.shape[-1] // 2
        x1, x2 = k[..., :half].float(), k[..., half:].float()
        if out is None:
            out = torch.empty_like(k)
        elif out.shape != k.shape:
            raise ValueError(f"moved keys {tuple(k.shape)} do not fit the output {tuple(out.shape)}")
        out[..., :half] = (x1 * self.cos).sub_(x2 * self.sin)
        out[..., half:] = (x2 * self.cos).add_(x1 * self.sin)
        return out
