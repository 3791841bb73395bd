"""CacheBlend: recompute the tokens whose reused K or V deviate most from freshly computed ones at one shallow
check layer (||dV|| at layer 1 by default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import REGISTRY, Features, Layout, Selection, finish
from .budget import top_k


@REGISTRY.register
@dataclass(frozen=True)
class CacheBlendSelector:
    name: ClassVar[str] = "cacheblend"
    layer: int = 1  # check layer (0-based): layers before it are recomputed in full to get its fresh K/V
    which: str = "v"  # "v" (CacheBlend's choice) or "k"
    whole_units: bool = False  # keep numbers / words whole (off: the paper's plain top-K)

    def __post_init__(self) -> None:
        if self.which not in ("k", "v"):
            raise ValueError(f"which must be 'k' or 'v', got {self.which!r}")

    @property
    def needs(self) -> tuple[tuple[str, tuple], ...]:
        return (("kv_deviation", (self.layer, self.which)),)

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        scores = features.kv_deviation(self.layer, self.which)
        picked = top_k(layout, scores, ratio, features, self.whole_units)
        return finish(layout, picked, scores)
