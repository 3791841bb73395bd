"""EPIC: recompute the first tokens of every chunk (static; ProphetKV App. C value function -(distance to chunk
start)), where the chunk-boundary attention sinks sit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import REGISTRY, Features, Layout, Selection, finish, top_k_context


@REGISTRY.register
@dataclass(frozen=True)
class EpicSelector:
    name: ClassVar[str] = "epic"
    k: int | None = None  # tokens per chunk; None spends the budget K: floor(K / chunks) each, the rest to the earliest

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        t0 = time.perf_counter()
        dist = torch.full((layout.n,), float("inf"))
        for s, e in layout.chunk_spans:
            dist[s:e] = torch.arange(e - s, dtype=dist.dtype)
        if self.k is None:
            # ranking by -distance with ties to the lower index gives every chunk its first tokens in turn
            picked = top_k_context(layout, -dist, layout.budget(ratio))
        else:
            picked = (dist < self.k).nonzero().flatten()
        return finish(layout, picked, -dist, time.perf_counter() - t0)
