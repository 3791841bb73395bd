"""ProphetKV (Alg. 1): the user query, run through all layers against the reused KV, attends to the context
tokens that matter for the answer; per-layer attention averaged over query tokens and heads, fused over layers
(Eq. 7), top-K. The engine computes the fused score (Features.query_attention) at O(|query| * N) per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import REGISTRY, Features, Layout, Selection, finish
from .budget import top_k
from .overlap import check_overlap, top_k as overlap_top_k


@REGISTRY.register
@dataclass(frozen=True)
class ProphetSelector:
    name: ClassVar[str] = "prophet"
    needs: ClassVar[tuple] = (("query_attention", ()),)
    whole_units: bool = False  # keep numbers / words whole (off: the paper's plain top-K)
    # share of the budget spent first on whole sentences holding the query's rarest words (overlap.py); 0: off
    overlap: float = 0.0

    def __post_init__(self) -> None:
        check_overlap(self.overlap)
        if self.overlap and self.whole_units:
            raise ValueError("overlap and whole_units cannot be combined")

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        scores = features.query_attention()
        if self.overlap:
            picked = overlap_top_k(layout, scores, layout.budget(ratio), *features.prompt_text(), self.overlap)
        else:
            picked = top_k(layout, scores, ratio, features, self.whole_units)
        return finish(layout, picked, scores)
