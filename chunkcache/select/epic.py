"""EPIC: recompute the first tokens of every chunk (static; ProphetKV App. C value function -(distance to chunk
start)), where the chunk-boundary attention sinks sit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import REGISTRY, Features, Layout, Selection, finish
from .budget import rank


@REGISTRY.register
@dataclass(frozen=True)
class EpicSelector:
    name: ClassVar[str] = "epic"
    k: int | None = None  # tokens per chunk; None spends the budget K: floor(K / chunks) each, the rest to the earliest

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        dist = torch.full((layout.n,), float("inf"))
        for s, e in layout.chunk_spans:
            dist[s:e] = torch.arange(e - s, dtype=dist.dtype)
        if self.k is None:
            # ranking by -distance with ties to the lower index gives every chunk its first tokens in turn
            picked = rank(-dist, layout.context_mask())[: layout.budget(ratio)]
        else:
            picked = (dist < self.k).nonzero().flatten()
        return finish(layout, picked, -dist)
