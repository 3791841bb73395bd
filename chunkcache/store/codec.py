"""Compressed K and V for the tiers that keep entries outside the process (disk, the shared Redis-protocol tier):
`store.compress: int8 | int4` quantises an entry's KV with SpeCache's KIVI-style quantiser
(chunkcache/specache/quant.py) when the tier writes it, and decodes it back to the entry's dtype when the tier reads
it, so the memory tier and the blend only ever see full-width tensors.

What holds:
- K is quantised per channel over groups of GROUP consecutive tokens, V per token over groups of channels of one head
  (GROUP, or the largest power of two dividing head_dim): a few key channels carry outliers, and a per-channel range
  keeps them from flattening every other channel (KIVI §3; 2.5x less K error on SmolLM2 and Gemma 3:
  docs/bench/compression.md).
- A group's levels are asymmetric min/max (zero = min, scale = (max - min) / (2^bits - 1), float16 parameters, codes
  rounded from the parameters as stored), so every value decodes within scale / 2 of itself (plus the float16
  rounding of the group's min), and the cast to the entry's dtype rounds once more (bfloat16: at most 2^-8 of it).
- A chunk's last K group may be short: it is padded with copies of the chunk's last token, which leaves every
  channel's min and max as they are, and the padding's codes are not kept.
- Bytes per token and layer-head at head_dim D: D * bits / 8 for K's codes and as many for V's, plus 4 bytes of
  parameters per channel per GROUP tokens for K (4 * D / GROUP) and 4 per V group (4 * D / group). SmolLM2-135M
  (30 layers, 3 KV heads, D 64, bfloat16: 23,040 B uncompressed): int8 12,960 B, int4 7,200 B.
- Decoding then encoding again (a remote hit written to the disk tier, features added to an entry read from disk)
  gives back the same codes in float32: code 0 decodes to the group's zero and the top code to its max. In bfloat16
  the decoded values' rounding can move a code by one (3 of 80 random tensors, none with a larger largest error).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..specache import quant

NAMES = ("none", "int8", "int4")  # store.compress
GROUP = 32  # tokens per K group, channels per V group (KIVI's and SpeCache's default)
TENSORS = ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")  # what encode returns and decode reads


@dataclass(frozen=True)
class Codec:
    bits: int
    group: int = GROUP

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or self.group < 1:
            raise ValueError(f"no codec for {self.bits} bits in groups of {self.group}")

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K and V [L, T, H, D] -> TENSORS: uint8 codes [L, T, H, D * bits / 8], K's float16 scale and zero
        [L, ceil(T / GROUP), H, D], V's [L, T, H, D / group]. ValueError if a value is not finite or beyond float16."""
        return dict(zip(TENSORS, (*self.per_channel(k), *self.per_token(v))))

    def decode(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [L, T, H, D] in `dtype` from what encode returned (a ValueError or RuntimeError if the shapes
        do not fit each other)."""
        k = self.from_per_channel(t["k"], t["k_scale"], t["k_zero"])
        return k.to(dtype).contiguous(), self.from_per_token(t["v"], t["v_scale"], t["v_zero"]).to(dtype)

    def per_channel(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [L, T, H, D], each channel over groups of GROUP tokens -> packed codes, scale and zero
        [L, ceil(T / GROUP), H, D]."""
        L, T, H, D = x.shape
        pad = -T % self.group
        if pad:
            x = torch.cat([x, x[:, -1:].expand(L, pad, H, D)], 1)
        codes, scale, zero = quant.quantize(x.unflatten(1, (-1, self.group)), self.bits, dim=2)
        return quant.pack(codes.flatten(1, 2)[:, :T], self.bits), scale.squeeze(2), zero.squeeze(2)

    def from_per_channel(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """float32 x back from what per_channel returned."""
        codes = quant.unpack(packed, self.bits)
        T = codes.shape[1]
        codes = F.pad(codes, (0, 0, 0, 0, 0, -T % self.group)).unflatten(1, (-1, self.group))
        return quant.dequantize(codes, scale.unsqueeze(2), zero.unsqueeze(2)).flatten(1, 2)[:, :T]

    def per_token(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [L, T, H, D], each token's channels in groups of `group` (GROUP, or the largest power of two dividing
        D: 80 -> 16) -> packed codes, scale and zero [L, T, H, D / group]."""
        group = math.gcd(x.shape[-1], self.group)
        codes, scale, zero = quant.quantize(x.unflatten(-1, (-1, group)), self.bits, dim=-1)
        return quant.pack(codes.flatten(-2), self.bits), scale.squeeze(-1), zero.squeeze(-1)

    def from_per_token(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """float32 x back from what per_token returned."""
        codes = quant.unpack(packed, self.bits).unflatten(-1, (scale.shape[-1], -1))
        return quant.dequantize(codes, scale.unsqueeze(-1), zero.unsqueeze(-1)).flatten(-2)


def named(name: str) -> Codec | None:
    """The codec `store.compress` names; None for "none"."""
    if name not in NAMES:
        raise ValueError(f"store.compress must be one of {', '.join(NAMES)}, got {name!r}")
    return None if name == "none" else Codec(int(name.removeprefix("int")))
