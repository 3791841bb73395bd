"""The two ends of the budget: `full` recomputes everything (the oracle), `none` only the forced tokens."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from .base import REGISTRY, Layout, Selection, finish


@REGISTRY.register
class Full:
    name: ClassVar[str] = "full"
    needs: ClassVar[frozenset[str]] = frozenset()

    def select(self, layout: Layout, ratio: float, features: Mapping[str, Any]) -> Selection:
        return finish(layout, layout.context_mask().nonzero().flatten(), None, 0.0)


@REGISTRY.register
class NoRecompute:
    name: ClassVar[str] = "none"
    needs: ClassVar[frozenset[str]] = frozenset()

    def select(self, layout: Layout, ratio: float, features: Mapping[str, Any]) -> Selection:
        return finish(layout, torch.empty(0, dtype=torch.long), None, 0.0)
