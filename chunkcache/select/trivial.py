"""The two ends of the budget: `full` recomputes everything (the oracle), `none` only the forced tokens."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import REGISTRY, Features, Layout, Selection, finish


@REGISTRY.register
class Full:
    name: ClassVar[str] = "full"

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        return finish(layout, layout.context_mask().nonzero().flatten(), None)


@REGISTRY.register
class NoRecompute:
    name: ClassVar[str] = "none"

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        return finish(layout, torch.empty(0, dtype=torch.long), None)
