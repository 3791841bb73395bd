"""One cached chunk: its tokens and the KV the target model computed for it right after the shared prefix.

Canonical layout (other code depends on it): `k`, `v` are [num_layers, num_tokens, num_kv_heads, head_dim],
token-major per layer like SGLang's `k_buffer[layer][slot]`; K is post-RoPE at positions
`start_pos .. start_pos + num_tokens - 1`, with `start_pos` = the shared prefix's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class FingerprintMismatch(ValueError):
    """A cached entry was computed by a different model than the one asking for it."""


@dataclass(frozen=True)
class EntryLayout:
    """What the serving model's KV looks like. An entry read from outside the process (a disk file) that decodes
    cleanly can still be another model's or a forged one; it must fit before it is used."""

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def check(self, entry: "ChunkEntry") -> None:
        """ValueError saying what does not fit."""
        entry.check_model(self.model_fingerprint)
        want = (self.num_layers, self.num_kv_heads, self.head_dim)
        got = (entry.num_layers, entry.num_kv_heads, entry.head_dim)
        if got != want:
            raise ValueError(f"KV of [layers, kv heads, head_dim] = {list(got)}, the model has {list(want)}")


@dataclass
class ChunkEntry:
    key: str  # store key (hashing.chunk_key)
    token_ids: torch.Tensor  # [T] int64
    k: torch.Tensor  # [L, T, H_kv, D], post-RoPE
    v: torch.Tensor  # [L, T, H_kv, D]
    start_pos: int  # position of the chunk's first token when k was computed
    model_fingerprint: str  # hashing.model_fingerprint of the model that computed k and v
    features: dict[str, torch.Tensor] = field(default_factory=dict)  # selector features (e.g. draft KV, scores)

    def __post_init__(self) -> None:
        if self.k.dim() != 4 or self.k.shape != self.v.shape:
            raise ValueError(f"k and v must both be [L, T, H, D]; got {tuple(self.k.shape)} and {tuple(self.v.shape)}")
        if self.token_ids.dim() != 1 or self.token_ids.numel() != self.k.shape[1]:
            raise ValueError(f"{self.token_ids.numel()} token ids for KV of {self.k.shape[1]} tokens")
        if self.k.dtype != self.v.dtype:
            raise ValueError(f"k is {self.k.dtype} but v is {self.v.dtype}")
        if self.start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {self.start_pos}")

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        tensors = [self.token_ids, self.k, self.v, *self.features.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def check_model(self, fingerprint: str) -> None:
        if self.model_fingerprint != fingerprint:
            raise FingerprintMismatch(
                f"chunk {self.key} was computed by model {self.model_fingerprint}, not by {fingerprint}; "
                "refusing to reuse another model's KV"
            )
