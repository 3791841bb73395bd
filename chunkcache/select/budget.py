"""Exact budget control for selectors whose picks grow or shrink after ranking (span completion, grouping,
cross-tokenizer alignment, whole-unit closure).

Such a selector is a monotone map `expand(j)`: start from its j best-ranked tokens, post-process, and return the
target context tokens to recompute. The literal rule "if the expanded set exceeds K keep the K best-scored
tokens" would undo every completion (the K best-scored tokens are the initial top-K), so instead the starting
set is shrunk: the largest j whose expansion fits in K is kept, and the few slots left are filled with the
best-scored remaining tokens, whole units at a time.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..align import close_units, unit_ids
from .base import Layout


def fit(
    k: int,
    j_max: int,
    expand: Callable[[int], torch.Tensor],
    scores: torch.Tensor,
    candidates: torch.Tensor,
    units: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool [N] mask of exactly k candidate tokens (fewer only if no remaining whole unit fits in the rest).

    expand(j) -> bool [N], monotone in j, subset of `candidates`, unit-closed when `units` is given.
    scores: [N] target-space scores ranking the fill. units: [N] group ids (align.unit_ids) or None.
    """
    lo, hi = 0, j_max
    while lo < hi:  # largest j with |expand(j)| <= k; expand(0) is empty
        mid = (lo + hi + 1) // 2
        if int(expand(mid).sum()) <= k:
            lo = mid
        else:
            hi = mid - 1
    mask = expand(lo)
    room = k - int(mask.sum())
    rest = rank(scores, candidates & ~mask)
    if room <= 0 or units is None:
        mask[rest[: max(room, 0)]] = True
        return mask
    groups: dict[int, list[int]] = {}  # unit -> its remaining candidates; insertion order = the unit's best rank
    for t, u in zip(rest.tolist(), units[rest].tolist()):
        groups.setdefault(u, []).append(t)
    for members in groups.values():
        if len(members) <= room:
            mask[members] = True
            room -= len(members)
            if room == 0:
                break
    return mask


def rank(scores: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Eligible positions, best score first; ties go to the lower index (deterministic). Every selector's top-k is
    a prefix of this one ranking, so equal scores are broken the same way everywhere."""
    idx = eligible.nonzero().flatten()
    # a stable sort on -score keeps the earlier index first among equal scores
    return idx[torch.sort(-scores[idx].double(), stable=True).indices]


def first(order: torch.Tensor, j: int, n: int) -> torch.Tensor:
    """Bool [n] mask of the first j positions of a ranking."""
    out = torch.zeros(n, dtype=torch.bool)
    out[order[:j]] = True
    return out


def top_k_whole(layout: Layout, scores: torch.Tensor, k: int, units: torch.Tensor) -> torch.Tensor:
    """Indices of k context tokens by score, whole units only: the best-ranked units that fit, then the fill."""
    ctx = layout.context_mask()
    order = rank(scores, ctx)
    mask = fit(k, order.numel(), lambda j: close_units(first(order, j, layout.n), units) & ctx, scores, ctx, units)
    return mask.nonzero().flatten()


def top_k(layout: Layout, scores: torch.Tensor, ratio: float, features, whole_units: bool) -> torch.Tensor:
    """The score-ranked selectors' pick: the budget's best context tokens, closed over whole units if asked."""
    k = layout.budget(ratio)
    if whole_units:
        return top_k_whole(layout, scores, k, unit_ids(*features.prompt_text()))
    return rank(scores, layout.context_mask())[:k]
