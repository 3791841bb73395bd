"""Compressed K and V for the tiers that keep entries outside the process (disk, the shared Redis-protocol tier):
`store.compress: int8 | int4` quantises an entry's KV with SpeCache's KIVI-style quantiser
(chunkcache/specache/quant.py) when the tier writes it, and decodes it back to the entry's dtype when the tier reads
it, so the memory tier and the blend only ever see full-width tensors.

What holds:
- K is quantised per channel over groups of GROUP consecutive tokens, V per token over groups of channels of one head
  (GROUP, or the largest power of two dividing head_dim): a few key channels carry outliers, and a per-channel range
  keeps them from flattening every other channel (KIVI §3; measured on SmolLM2 in docs/bench/compression.md).
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

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K and V [L, T, H, D] -> TENSORS: uint8 codes [L, T, H, D * bits / 8], K's float16 scale and zero
        [L, ceil(T / GROUP), H, D], V's [L, T, H, D / group]. ValueError if a value is not finite or beyond float16."""
        L, T, H, D = k.shape
        pad = -T % self.group
        if pad:
            k = torch.cat([k, k[:, -1:].expand(L, pad, H, D)], 1)
        k_codes, k_scale, k_zero = quant.quantize(k.unflatten(1, (-1, self.group)), self.bits, dim=2)
        v_group = math.gcd(D, self.group)  # GROUP, or the largest power of two dividing head_dim (80: 16)
        v_codes, v_scale, v_zero = quant.quantize(v.unflatten(-1, (-1, v_group)), self.bits, dim=-1)
        return {"k": quant.pack(k_codes.flatten(1, 2)[:, :T], self.bits), "k_scale": k_scale.squeeze(2),
                "k_zero": k_zero.squeeze(2), "v": quant.pack(v_codes.flatten(-2), self.bits),
                "v_scale": v_scale.squeeze(-1), "v_zero": v_zero.squeeze(-1)}

    def decode(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [L, T, H, D] in `dtype` from what encode returned (a ValueError or RuntimeError if the shapes
        do not fit each other)."""
        k_codes = quant.unpack(t["k"], self.bits)
        T = k_codes.shape[1]
        k_codes = F.pad(k_codes, (0, 0, 0, 0, 0, -T % self.group)).unflatten(1, (-1, self.group))
        k = quant.dequantize(k_codes, t["k_scale"].unsqueeze(2), t["k_zero"].unsqueeze(2)).flatten(1, 2)[:, :T]
        v_codes = quant.unpack(t["v"], self.bits)
        v_codes = v_codes.unflatten(-1, (t["v_scale"].shape[-1], -1))
        v = quant.dequantize(v_codes, t["v_scale"].unsqueeze(-1), t["v_zero"].unsqueeze(-1)).flatten(-2)
        return k.to(dtype).contiguous(), v.to(dtype)


def named(name: str) -> Codec | None:
    """The codec `store.compress` names; None for "none"."""
    if name not in NAMES:
        raise ValueError(f"store.compress must be one of {', '.join(NAMES)}, got {name!r}")
    return None if name == "none" else Codec(int(name.removeprefix("int")))
