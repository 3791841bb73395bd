"""CacheClip (002): an auxiliary model's last-layer attention from the query tokens to each chunk's tokens, run as
(shared prefix + chunk + query) pairs over the auxiliary model's own cached chunk KV, averaged over query tokens
and heads; top-K; grouping (windows of 8 tokens, a window's picks kept only when at least 5 are picked); mapped to
target tokens through character offsets.

The auxiliary chunk KV lives in the chunk store entry's feature slot (Features.chunk_features), so each chunk
is run through the auxiliary model once. Budget: exactly K target context tokens (budget.fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..align import Alignment, close_units, unit_ids
from ..draft import KV, Draft
from .base import REGISTRY, Features, Layout, Selection, finish
from .budget import first, fit, rank
from .view import DraftView, concat, digest, draft_view


def window_ids(lengths: list[int], window: int = 8) -> torch.Tensor:
    """[sum(lengths)] window id per token: each segment is cut into windows of `window` tokens from its start."""
    ids, base = [], 0
    for n in lengths:
        local = torch.arange(n) // window
        ids.append(local + base)
        base += (n + window - 1) // window
    return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)


def group(picked: torch.Tensor, windows: torch.Tensor, min_picked: int = 5) -> torch.Tensor:
    """Keep a window's picks only where the window has at least `min_picked` of them."""
    count = torch.bincount(windows, weights=picked.double())
    return picked & (count[windows] >= min_picked)


@REGISTRY.register
@dataclass(frozen=True, eq=False)
class ClipSelector:
    name: ClassVar[str] = "clip"
    draft: str | Draft | None = None  # auxiliary model: a Draft, a name the engine resolves, None: the engine's own
    layers: int | None = None  # auxiliary depth (None: the engine's; "self" defaults to a third of the target)
    window: int = 8  # grouping window, in auxiliary tokens
    min_picked: int = 5  # picks a window needs to be kept
    whole_units: bool = True  # close the target selection over whole numbers / words

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        draft = self.draft if isinstance(self.draft, Draft) else features.draft(self.draft, self.layers)
        prefix = draft_view(draft, layout, features, (0, layout.prefix_len)) if layout.prefix_len else None
        query = draft_view(draft, layout, features, layout.query_span)
        prefix_kv = draft.prefill(prefix.ids) if prefix is not None else None
        key = f"clip:{draft.fingerprint}:{digest(prefix.ids if prefix is not None else torch.zeros(0))}"
        views: list[DraftView] = []
        scores: list[torch.Tensor] = []
        for i, span in enumerate(layout.chunk_spans):
            view = draft_view(draft, layout, features, span)
            kv = self._chunk_kv(draft, features.chunk_features(i), key, view, prefix_kv)
            past = kv if prefix_kv is None else torch.cat([prefix_kv, kv], dim=2)
            scores.append(draft.query_attention(past, query.ids)[past.shape[2] - view.n :])
            views.append(view)
        att, chunks = torch.cat(scores), concat(views, layout.n)
        windows = window_ids([v.n for v in views], self.window)
        units = unit_ids(*features.prompt_text()) if self.whole_units else None
        picked = self.pick(layout, ratio, chunks.align, att, chunks.candidates, windows, units)
        return finish(layout, picked.nonzero().flatten(), chunks.align.project_scores(att).float())

    def pick(self, layout: Layout, ratio: float, align: Alignment, att: torch.Tensor, candidates: torch.Tensor,
             windows: torch.Tensor, units: torch.Tensor | None) -> torch.Tensor:
        """Bool [N]: exactly K target context tokens from auxiliary-token scores `att` (aligned by `align`,
        grouped by `windows`, closed over `units` if given)."""
        ctx = layout.context_mask()
        order = rank(att, candidates)

        def expand(j: int) -> torch.Tensor:
            kept = group(first(order, j, att.numel()), windows, self.min_picked)
            out = align.project(kept) & ctx
            return close_units(out, units) & ctx if units is not None else out

        return fit(layout.budget(ratio), order.numel(), expand, align.project_scores(att), ctx, units)

    @staticmethod
    def _chunk_kv(draft: Draft, slot: dict[str, torch.Tensor], key: str, view: DraftView, prefix_kv: KV | None) -> KV:
        if key not in slot:
            slot[key] = draft.prefill(view.ids, past=prefix_kv).cpu()
        return slot[key].to(draft.device)

