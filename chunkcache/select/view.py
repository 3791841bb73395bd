"""What a draft model sees of a request: its own token ids for a stretch of the prompt and how they align to
the target's tokens (identity when the draft shares the target's vocabulary, character overlaps otherwise)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..align import Alignment, encode_with_offsets
from ..draft import Draft
from .base import Features, Layout


@dataclass
class DraftView:
    ids: torch.Tensor  # [n] draft token ids
    align: Alignment  # draft token -> target tokens of the whole prompt
    candidates: torch.Tensor  # bool [n]: draft tokens overlapping at least one reused-context target token
    body_start: int  # first draft token after the shared prefix

    @property
    def n(self) -> int:
        return int(self.ids.numel())


def draft_view(draft: Draft, layout: Layout, features: Features, span: tuple[int, int] | None = None) -> DraftView:
    """The draft's view of target tokens [s, e) (default: the whole prompt). The draft tokenizer's special
    tokens (BOS) are added only when the stretch starts the prompt."""
    s, e = span or (0, layout.n)
    if draft.tokenizer is None:
        ids = layout.token_ids[s:e]
        align = Alignment.identity(e - s).shifted(0, s, e - s, layout.n)
        body_start = max(0, layout.prefix_len - s)
    else:
        text, offsets = features.prompt_text()
        a, b = offsets[s][0], offsets[e - 1][1]
        ids_list, local = encode_with_offsets(draft.tokenizer, text[a:b], add_special_tokens=s == 0)
        ids = torch.tensor(ids_list, dtype=torch.long)
        mine = [(x + a, y + a) for x, y in local]
        align = Alignment.between(mine, offsets[s:e]).shifted(0, s, len(mine), layout.n)
        prefix_end = offsets[layout.prefix_len - 1][1] if layout.prefix_len > s else a
        body_start = next((i for i, (x, y) in enumerate(mine) if x >= prefix_end and y > x), len(mine))
    candidates = torch.zeros(int(ids.numel()), dtype=torch.bool)
    candidates[align.src[layout.context_mask()[align.dst]]] = True
    return DraftView(ids, align, candidates, body_start)


def concat(views: list[DraftView], n_target: int) -> DraftView:
    """Several stretches' views laid end to end (e.g. every chunk, each tokenised by the draft on its own)."""
    src, dst, off = [], [], 0
    for v in views:
        src.append(v.align.src + off)
        dst.append(v.align.dst)
        off += v.n
    align = Alignment((torch.cat(src), torch.cat(dst)), off, n_target)
    return DraftView(torch.cat([v.ids for v in views]), align, torch.cat([v.candidates for v in views]), 0)


def digest(ids: torch.Tensor) -> str:
    """Short content hash of draft token ids: names per-chunk features computed after a given prefix."""
    return hashlib.blake2b(ids.to(torch.int64).numpy().tobytes(), digest_size=8).hexdigest()
