"""One cached chunk: its tokens and the KV the target model computed for them after a context.

The invariant every write path keeps: an entry's K and V are a pure function of what its key hashes
(hashing.entry_key) — the model (`model_fingerprint`), the tenant (`tenant`: namespace and salt), the exact tokens
its KV attended to before its own (`context`: a hinted chunk's shared prefix; an automatically detected segment's
head and the part of its paragraph before it) and its own tokens — computed in a forward of exactly those tokens
(context, then the entry's tokens) and nothing else. Never KV read out of a request's pool, which attended to
whatever that request's prompt held. So two servers, or one server taught by two prompts, store the same bits under
one key, and no prompt can set what another tenant, or another prompt of its own tenant, is served.
`tenant` and `context` travel with the entry (its header on disk and in the shared tier) so that a reader checks the
key against them (`check_key`). Selector features (`features`) are learned per key, so per tenant.

Canonical layout (other code depends on it): `k`, `v` are [num_layers, num_tokens, num_kv_heads, head_dim],
token-major per layer like SGLang's `k_buffer[layer][slot]`; K is post-RoPE at positions
`start_pos .. start_pos + num_tokens - 1`, with `start_pos` = the context's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..hashing import entry_key


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
    tenant: str = ""  # hashing.tenant_key of its namespace and salt; "" for an entry made outside a server's store
    context: str = ""  # hashing.prefix_key of the tokens its KV attended to before its own; "" as for `tenant`

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

    def check_key(self) -> None:
        """ValueError when the entry carries its digests and its key is not the key they and its tokens make: an
        entry stored under another's key, or one whose header was altered."""
        if (self.tenant or self.context) and entry_key(self.model_fingerprint, self.tenant, self.context,
                                                       self.token_ids) != self.key:
            raise ValueError(f"entry {self.key} is not what its tenant, context and tokens name")

    def check_model(self, fingerprint: str) -> None:
        if self.model_fingerprint != fingerprint:
            raise FingerprintMismatch(
                f"chunk {self.key} was computed by model {self.model_fingerprint}, not by {fingerprint}; "
                "refusing to reuse another model's KV"
            )
