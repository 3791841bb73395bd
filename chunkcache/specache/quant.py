"""KIVI-style group quantisation of K and V, with SpeCache's placement of the two 1-bit levels.

K is quantised per channel over groups of `group` consecutive tokens (a few key channels carry outliers: a
per-channel range keeps them from flattening every other channel), V per token over groups of `group` channels
(KIVI, §3). For b >= 2 bits a group gets zero = min and scale = (max - min) / (2^b - 1) (KIVI). At b = 1 those
levels would be min and max, the two worst stand-ins for the values in between; SpeCache puts them at the
midpoints of the lower and upper halves of the range, zero = (3*min + max) / 4 and scale = (max - min) / 2, so a
value still goes to the nearer level (the threshold stays at the range's midpoint).

Codes are packed 8 // b to a byte along head_dim (the layout whose bytes the pool accounting counts); zero and
scale are float16, the 16-bit parameters the paper's compression ratios assume. quantize, pack and unpack also
serve the chunk store's 8- and 4-bit codec (chunkcache/store/codec.py).
"""

from __future__ import annotations

import torch

PARAM_DTYPE = torch.float16
BITS = (1, 2, 4)


def check_layout(bits: int, group: int, head_dim: int) -> None:
    """Refuse a (bits, group) pair this head_dim cannot hold, naming why."""
    if bits not in BITS:
        raise ValueError(f"SpeCache quantises to {', '.join(map(str, BITS))} bits, not {bits}")
    if head_dim * bits % 8:
        raise ValueError(f"head_dim {head_dim} does not pack into whole bytes at {bits} bits")
    if group < 1 or head_dim % group:
        raise ValueError(f"group {group} must divide head_dim {head_dim} (V is quantised per token in groups of "
                         f"`group` channels of one head)")


def quantize(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, unpacked, shape of x), scale and zero (PARAM_DTYPE, `dim` kept with size 1) of the groups
    that `dim` spans."""
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    if bits == 1:
        zero, scale = (3 * lo + hi) / 4, (hi - lo) / 2
    else:
        zero, scale = lo, (hi - lo) / (2**bits - 1)
    zero, scale = zero.to(PARAM_DTYPE), scale.to(PARAM_DTYPE)
    if not (torch.isfinite(zero).all() and torch.isfinite(scale).all()):
        raise ValueError(f"KV values beyond the {PARAM_DTYPE} range of the quantisation parameters")
    # codes from the parameters as stored, so that dequantisation reproduces what was rounded; a constant group
    # (scale 0) is all code 0, which dequantises to its value
    s = scale.float()
    t = (x - zero.float()) / torch.where(s > 0, s, torch.ones_like(s))
    codes = t.round().clamp_(0, 2**bits - 1).to(torch.uint8)
    return codes, scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float() + zero.float()


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] -> [..., D * bits / 8], the first code in the lowest bits."""
    per = 8 // bits
    if per == 1:
        return codes
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    c = (packed.to(torch.int32)[..., None] >> shifts) & (2**bits - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per).to(torch.uint8)


def quantize_keys(k: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k [T, H, D] with T a multiple of `group` -> packed codes [T, H, D*bits/8], scale and zero [T/group, H, D]."""
    T, H, D = k.shape
    if T % group:
        raise ValueError(f"keys are quantised in whole groups of {group} tokens, got {T}")
    codes, scale, zero = quantize(k.reshape(T // group, group, H, D), bits, dim=1)
    return pack(codes.reshape(T, H, D), bits), scale.squeeze(1), zero.squeeze(1)


def dequantize_keys(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Keys from codes [..., D*bits/8] and each token's own group's parameters [..., D] (same leading shape)."""
    return dequantize(unpack(packed, bits), scale, zero)


def quantize_values(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v [T, H, D] -> packed codes [T, H, D*bits/8], scale and zero [T, H, D/group]."""
    T, H, D = v.shape
    codes, scale, zero = quantize(v.reshape(T, H, D // group, group), bits, dim=-1)
    return pack(codes.reshape(T, H, D), bits), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_values(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Values from codes [..., D*bits/8] and their parameters [..., D/group] (same leading shape)."""
    codes = unpack(packed, bits)
    group = codes.shape[-1] // scale.shape[-1]
    return dequantize(codes.unflatten(-1, (-1, group)), scale[..., None], zero[..., None]).flatten(-2)
