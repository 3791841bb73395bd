"""chunkcache's own selector: the anchors' three cheap signals, each normalised to a distribution over the context
tokens and mixed.

* relevance: ProphetKV's query attention (the query through all layers over the reused KV) finds the tokens the
  answer reads;
* deviation: CacheBlend's KV deviation (of K by default) at a shallow check layer finds the tokens whose reused KV
  is most wrong wherever the query looks;
* boundary: EPIC's chunk starts, where each chunk's standalone KV holds an attention sink the blended prompt lacks.

Each signal sums to 1 over the context before mixing (their raw scales differ by orders of magnitude, and per request).
`combine` says how: "sum" weighs them as shares of the mixed score; "product" multiplies them, each raised to its
weight, which estimates the deviation the query reads (the attended oracle's form: a token matters when its reused
KV is wrong *and* the answer reads it). A chunk whose KV is exact (the first after the shared prefix) has no
deviation, so the product spends nothing on it where the sum spends relevance's share. Either way the mixed score is
renormalised to a distribution: the adaptive budget (adaptive.py) reads its cumulative mass as the share of estimated
damage recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .adaptive import AdaptiveBudget
from .base import REGISTRY, Features, Layout, Selection, finish
from .budget import rank
from .overlap import check_overlap, top_k as overlap_top_k


def distribution(scores: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
    """[N] float64: non-negative `scores` on the context tokens scaled to sum to 1 (uniform when they are all 0)."""
    s = scores.detach().cpu().double().clamp_min(0) * ctx  # an engine may hand its features over on its device
    total = float(s.sum())
    if total > 0:
        return s / total
    return ctx.double() / max(int(ctx.sum()), 1)


def chunk_starts(layout: Layout, tokens: int) -> torch.Tensor:
    """Bool [N]: the first `tokens` tokens of every reused chunk."""
    m = torch.zeros(layout.n, dtype=torch.bool)
    for s, e in layout.chunk_spans:
        m[s: min(e, s + tokens)] = True
    return m


@REGISTRY.register
@dataclass(frozen=True)
class MixSelector:
    name: ClassVar[str] = "mix"
    # Weights and check layer from chunkbench/studies/select_study.py (48 synthetic cases, seeds the eval does not use,
    # rho = 0.15): relevance alone recovers 0.72 of the oracle's deviation but misses the fewest needle tokens,
    # deviation alone the reverse; deeper check layers predict the truth better (layer 1: 0.871, 3: 0.938 alone) at
    # (layer + 1) / layers of a prefill. Chunk starts add nothing there: the deviation signal already picks them. The
    # product (first-token KL against full recompute at rho 0.15, paired per case with prophet on the same blend):
    # multikey seeds 1000-1029 -8 %, 21 of 30 cases better; MuSiQue records 0-29 -6 %, 20 of 30; the sum +1 % and +4 %
    # (docs/bench/eval_select.md, "Product or sum"); then at 100 cases per family -7 % to -29 %. K's deviation rather
    # than V's (same 30 cases: -10 % / -14 % vs prophet against V's -8 % / -6 %; at 100 cases MuSiQue -6 % vs V paired,
    # the synthetic families within +-2 %): K decides which tokens the answer reads.
    relevance: float = 0.5  # weight of ProphetKV's query attention
    deviation: float = 0.5  # weight of CacheBlend's KV deviation at `layer`
    boundary: float = 0.0  # weight of EPIC's chunk starts (spread evenly over their first `boundary_tokens`)
    boundary_tokens: int = 2  # tokens at each chunk's start the boundary weight covers
    layer: int = 3  # deviation check layer (0-based; layers up to it run over every token)
    which: str = "k"  # deviation of "k" or "v"
    combine: str = "product"  # "product": weights are exponents (boundary must be 0); "sum": weights are shares
    # adaptive budget: None spends the request's rho; a share in (0, 1] recomputes the fewest tokens holding that
    # share of the mixed score, between rho_floor and min(rho_cap, the request's rho)
    mass: float | None = None
    rho_floor: float = 0.05  # adaptive: smallest rho a request gets
    rho_cap: float = 1.0  # adaptive: largest rho a request gets (the request's rho if smaller)
    # share of the budget spent first on whole sentences holding the query's rarest words (overlap.py); 0: off
    overlap: float = 0.0
    # the deviation each chunk's store entry remembers, so a request whose chunks all have one runs no deviation pass
    # (layers 0..`layer` over every token, mix's cost above prophet's); False measures it in every request
    stored_deviation: bool = False
    # with stored_deviation, a chunk blended away from home for the first time: "estimate" reads the mean level of
    # the request's remembered chunks (Features.remembered_deviation) and measures it after the request, off its
    # path; "measure" runs the deviation pass in the request (Features.known_deviation)
    first_reuse: str = "estimate"

    def __post_init__(self) -> None:
        weights = (self.relevance, self.deviation, self.boundary)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"weights (relevance, deviation, boundary) must be >= 0 with a positive sum, "
                             f"got {weights}")
        if self.boundary_tokens < 1:
            raise ValueError(f"boundary_tokens must be at least 1, got {self.boundary_tokens}")
        if self.combine not in ("sum", "product"):
            raise ValueError(f"combine must be 'sum' or 'product', got {self.combine!r}")
        if self.combine == "product" and self.boundary:
            raise ValueError("combine='product' needs boundary=0: the chunk starts' distribution is zero elsewhere, "
                             "so the product would keep only them")
        if self.first_reuse not in ("estimate", "measure"):
            raise ValueError(f"first_reuse must be 'estimate' or 'measure', got {self.first_reuse!r}")
        if self.which not in ("k", "v"):
            raise ValueError(f"which must be 'k' or 'v', got {self.which!r}")
        if self.layer < 0:
            raise ValueError(f"layer must be at least 0, got {self.layer}")
        check_overlap(self.overlap)
        if self.overlap and self.mass is not None:
            raise ValueError("overlap and an adaptive budget (mass) cannot be combined: set overlap: 0 beside mass "
                             "(the shipped options set overlap: 0.15)")
        if self.mass is not None:
            self.budget()  # refuses a bad mass, floor or cap when the selector is configured, not per request

    @property
    def needs(self) -> tuple[tuple[str, tuple], ...]:
        return ((("query_attention", ()),) if self.relevance else ()) + \
            (((self._deviation_feature, (self.layer, self.which)),) if self.deviation else ())

    @property
    def _deviation_feature(self) -> str:
        if not self.stored_deviation:
            return "kv_deviation"
        return "remembered_deviation" if self.first_reuse == "estimate" else "known_deviation"

    def budget(self) -> AdaptiveBudget:
        return AdaptiveBudget(self.mass, self.rho_floor, self.rho_cap)

    def scores(self, layout: Layout, features: Features) -> torch.Tensor:
        """[N] float64, the mixed distribution over the context tokens."""
        ctx = layout.context_mask()
        signals = []
        if self.relevance:
            signals.append((self.relevance, distribution(features.query_attention(), ctx)))
        if self.deviation:
            deviation = getattr(features, self._deviation_feature)(self.layer, self.which)
            signals.append((self.deviation, distribution(deviation, ctx)))
        if self.boundary:
            signals.append((self.boundary, distribution(chunk_starts(layout, self.boundary_tokens).double(), ctx)))
        if self.combine == "sum":
            return sum(w * d for w, d in signals) / sum(w for w, _ in signals)
        mixed = torch.ones(layout.n, dtype=torch.float64)
        for w, d in signals:
            mixed *= d ** w
        return distribution(mixed, ctx)

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        scores = self.scores(layout, features)
        if self.mass is None:
            k = layout.budget(ratio)
            picked = (overlap_top_k(layout, scores, k, *features.prompt_text(), self.overlap) if self.overlap
                      else rank(scores, layout.context_mask())[:k])
            return finish(layout, picked, scores.float())
        picked, rho = self.budget().pick(layout, scores, ratio)
        return finish(layout, picked, scores.float(), rho)
