"""Adaptive budget: a request's rho chosen from its selector's own scores instead of fixed.

A selector whose scores estimate how much each context token's reused KV would hurt (non-negative, mass where the
damage is) ranks the tokens and recomputes the fewest whose share of the total score reaches `mass`: the estimated
deviation left in the unselected tokens is then at most 1 - mass of the whole. A request whose damage sits in a few
tokens spends little; one whose damage is spread spends more. The choice is clamped between a floor (a score can
miss what it does not see) and a cap; the cap is never above the request's own rho, which is what the server charged
the request for at admission (sglang_patch.scheduler.admission) and the most the caller allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Layout
from .budget import rank


@dataclass(frozen=True)
class AdaptiveBudget:
    mass: float  # share of the context's total score the recomputed tokens must hold, in (0, 1]
    floor: float  # smallest rho a request gets, in [0, 1] (the request's rho if that is smaller)
    cap: float  # largest rho a request gets, in [0, 1] (the request's rho if that is smaller)

    def __post_init__(self) -> None:
        if not 0.0 < self.mass <= 1.0:
            raise ValueError(f"mass must be in (0, 1], got {self.mass}")
        for name in ("floor", "cap"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.floor > self.cap:
            raise ValueError(f"floor {self.floor} is above cap {self.cap}")

    def pick(self, layout: Layout, scores: torch.Tensor, ratio: float) -> tuple[torch.Tensor, float]:
        """(the picked context tokens, best first; the rho they make: picked / context tokens)."""
        ctx = layout.context_mask()
        order = rank(scores, ctx)
        n_ctx = order.numel()
        high = layout.budget(min(self.cap, ratio))
        low = min(layout.budget(min(self.floor, ratio)), high)
        mass = scores[order].double().clamp_min(0).cumsum(0)
        if n_ctx == 0 or float(mass[-1]) <= 0.0:  # no signal: nothing says where the damage is
            k = low
        else:  # the fewest tokens whose cumulative share reaches `mass` (rounding slack so mass=1 means all)
            k = int((mass < self.mass * float(mass[-1]) * (1 - 1e-12)).sum()) + 1
        k = max(low, min(high, k))
        return order[:k], k / n_ctx if n_ctx else 0.0
