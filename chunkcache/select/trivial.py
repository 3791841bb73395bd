"""The two ends of the budget: `full` recomputes everything (the oracle), `none` only the forced tokens."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import REGISTRY, Features, Layout, Selection, finish


@REGISTRY.register
class Full:
    name: ClassVar[str] = "full"
    fixed_ratio: ClassVar[float] = 1.0  # the share of the context it recomputes whatever rho (blend.cost.work)

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        return finish(layout, layout.context_mask().nonzero().flatten(), None)


@REGISTRY.register
class NoRecompute:
    name: ClassVar[str] = "none"
    fixed_ratio: ClassVar[float] = 0.0

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        return finish(layout, torch.empty(0, dtype=torch.long), None)
