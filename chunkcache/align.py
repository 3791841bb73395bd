"""Cross-tokenizer alignment through character offsets (SpecCache Eq. 7) and whole-unit closure.

Two tokenizations of one text are related many-to-many: token i of one maps to every token of the other whose
character span overlaps its own. A selection made on draft tokens is carried to target tokens this way.
Units are maximal word/number runs ("5663623", "123e4567-e89b-...", "10,000"): CacheClip's failure mode is a
number recomputed in part, so a selection can be closed to whole units (every target token touching a picked
unit's characters).
"""

from __future__ import annotations

import re
from typing import Sequence

import torch
from tokenizers.decoders import DecodeStream

Offsets = Sequence[tuple[int, int]]

# letters/digits joined by in-word separators: numbers with , . : / -, UUIDs, dates, contractions
UNIT = re.compile(r"[^\W_]+(?:[-.,:/'’][^\W_]+)*")


def decode_with_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text `ids` decode to, and each token's (start, end) character span in it.

    Incremental detokenisation, so ids that were tokenised piecewise (chunk by chunk) decode exactly. A token that
    completes no character by itself (part of a multi-byte character) shares the span of the character it helps
    write.
    """
    stream = DecodeStream(skip_special_tokens=False)
    backend = tokenizer.backend_tokenizer if hasattr(tokenizer, "backend_tokenizer") else tokenizer
    pieces: list[str] = []
    offsets: list[tuple[int, int]] = []
    pos, pending = 0, 0
    for i in ids:
        piece = stream.step(backend, int(i))
        if piece is None:
            pending += 1
            offsets.append((pos, pos))
            continue
        end = pos + len(piece)
        for j in range(len(offsets) - pending, len(offsets)):
            offsets[j] = (pos, end)
        offsets.append((pos, end))
        pieces.append(piece)
        pos, pending = end, 0
    return "".join(pieces), offsets


def encode_with_offsets(tokenizer, text: str, add_special_tokens: bool = False) -> tuple[list[int], Offsets]:
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def overlap_pairs(src: Offsets, dst: Offsets) -> tuple[torch.Tensor, torch.Tensor]:
    """All (i, j) with src token i and dst token j sharing at least one character, as two index tensors.

    Both offset lists must be sorted by start (tokenizer output is). Empty spans (special tokens) match nothing.
    A two-pointer sweep: O(len(src) + len(dst) + pairs).
    """
    si: list[int] = []
    dj: list[int] = []
    j0 = 0
    for i, (s, e) in enumerate(src):
        if e <= s:
            continue
        while j0 < len(dst) and dst[j0][1] <= s:
            j0 += 1
        j = j0
        while j < len(dst) and dst[j][0] < e:
            if dst[j][1] > dst[j][0] and dst[j][1] > s:
                si.append(i)
                dj.append(j)
            j += 1
    return torch.tensor(si, dtype=torch.long), torch.tensor(dj, dtype=torch.long)


class Alignment:
    """Many-to-many map from source (draft) tokens to target tokens."""

    def __init__(self, pairs: tuple[torch.Tensor, torch.Tensor], n_src: int, n_dst: int):
        self.src, self.dst = pairs
        self.n_src, self.n_dst = n_src, n_dst

    @classmethod
    def identity(cls, n: int) -> "Alignment":
        r = torch.arange(n)
        return cls((r, r), n, n)

    @classmethod
    def between(cls, src: Offsets, dst: Offsets) -> "Alignment":
        return cls(overlap_pairs(src, dst), len(src), len(dst))

    def shifted(self, src_offset: int, dst_offset: int, n_src: int, n_dst: int) -> "Alignment":
        """The same pairs inside a larger sequence pair (e.g. one chunk within the whole prompt)."""
        return Alignment((self.src + src_offset, self.dst + dst_offset), n_src, n_dst)

    def project(self, src_mask: torch.Tensor) -> torch.Tensor:
        """Eq. 7: bool [n_dst], every target token overlapping a selected source token."""
        out = torch.zeros(self.n_dst, dtype=torch.bool)
        out[self.dst[src_mask[self.src]]] = True
        return out

    def project_scores(self, src_scores: torch.Tensor) -> torch.Tensor:
        """[n_dst] float: the highest score among the source tokens overlapping each target token (-inf if none)."""
        out = torch.full((self.n_dst,), float("-inf"), dtype=torch.float64)
        return out.scatter_reduce(0, self.dst, src_scores.double()[self.src], reduce="amax")

    def covered(self) -> torch.Tensor:
        """Bool [n_src]: source tokens that overlap at least one target token."""
        out = torch.zeros(self.n_src, dtype=torch.bool)
        out[self.src] = True
        return out


def unit_ids(text: str, offsets: Offsets) -> torch.Tensor:
    """[N] int64 group id per token: tokens that overlap one unit (transitively) share an id; every other token
    is its own group. Closing a selection over these groups makes each number/word whole or absent."""
    n = len(offsets)
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    spans = [(m.start(), m.end()) for m in UNIT.finditer(text)]
    unit, tok = overlap_pairs(spans, offsets)
    first: dict[int, int] = {}
    for u, t in zip(unit.tolist(), tok.tolist()):
        if u in first:
            parent[find(t)] = find(first[u])
        else:
            first[u] = t
    return torch.tensor([find(i) for i in range(n)], dtype=torch.long)


def close_units(mask: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """The smallest superset of `mask` that contains every token of each unit it touches."""
    if not bool(mask.any()):
        return mask.clone()
    return torch.isin(units, units[mask])
