"""SpecCache's selector (seed 000), registered as `spec`: a draft model reads the assembled prompt; importance =
mean hidden-state norm over its deep layers (Eq. 1); top-K; semantic span completion (Eq. 3-6); cross-tokenizer
alignment to target tokens (Eq. 7). Not SpeCache (seed 003, decode-time KV offload: chunkcache.specache).

Budget: the final set holds exactly K target context tokens (budget.fit). Numbers and words are recomputed
whole or not at all when `whole_units` is set (the alignment is closed over align.unit_ids).

`per_chunk` trades the paper's full-prompt draft pass for one draft pass per chunk (shared prefix + chunk), kept
in the chunk store like the chunk's KV: a request then costs no draft forward at all, at the price of hidden
states that have not seen the other chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..align import close_units, unit_ids
from ..draft import Draft
from .base import REGISTRY, Features, Layout, Selection, finish
from .budget import first, fit, rank
from .view import DraftView, concat, digest, draft_view


def segment_spans(scores: torch.Tensor, tau_smooth: float = 0.4, max_span: int = 16) -> torch.Tensor:
    """Eq. 3-4: [n] span id per token. Min-max normalise, cut after token i when
    delta_i = |I~_{i+1} - I~_i| / I~_i >= tau_smooth, and cut smooth runs into pieces of at most max_span."""
    n = scores.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    s = scores.double()
    norm = (s - s.min()) / (s.max() - s.min()).clamp_min(1e-12)
    diff = (norm[1:] - norm[:-1]).abs()
    # delta is 0/0 on a flat run at the minimum (smooth) and x/0 leaving it (a cut)
    delta = torch.where(diff == 0, torch.zeros_like(diff), diff / norm[:-1])
    starts = torch.cat([torch.ones(1, dtype=torch.bool), delta >= tau_smooth])
    seg = starts.cumsum(0) - 1
    seg_start = starts.nonzero().flatten()
    piece = (torch.arange(n) - seg_start[seg]) // max_span
    new = starts.clone()
    new[1:] |= piece[1:] != piece[:-1]
    return new.cumsum(0) - 1


def complete_spans(span_ids: torch.Tensor, init: torch.Tensor, tau_cover: float = 0.7) -> torch.Tensor:
    """Eq. 5-6: the initial picks plus every span whose coverage |picked in span| / |span| >= tau_cover."""
    picked = torch.bincount(span_ids, weights=init.double())
    size = torch.bincount(span_ids).double()
    return init | (picked / size >= tau_cover)[span_ids]


@REGISTRY.register
@dataclass(frozen=True, eq=False)
class DraftNormSelector:
    name: ClassVar[str] = "spec"
    draft: str | Draft | None = None  # a loaded Draft, a name the engine resolves ("self", model, path), None: its own
    layers: int | None = None  # draft depth (None: the engine's; "self" defaults to a third of the target)
    tau_smooth: float = 0.4  # span cut threshold on the relative score change (Eq. 4)
    tau_cover: float = 0.7  # a span is completed when this share of it is already picked (Eq. 5)
    max_span: int = 16  # longest span
    deep_fraction: float = 1 / 3  # Eq. 1 averages the last third of the draft's layers
    whole_units: bool = True  # close the target selection over whole numbers / words
    per_chunk: bool = False  # score each chunk once after the shared prefix (stored) instead of the whole prompt

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        draft = self.draft if isinstance(self.draft, Draft) else features.draft(self.draft, self.layers)
        if self.per_chunk:
            view, imp = self._stored_importance(draft, layout, features)
        else:
            view = draft_view(draft, layout, features)
            imp = draft.importance(view.ids, self.deep_fraction)
        units = unit_ids(*features.prompt_text()) if self.whole_units else None
        picked = self.pick(layout, ratio, view, imp, units)
        scores = view.align.project_scores(imp).float()
        return finish(layout, picked.nonzero().flatten(), scores)

    def pick(self, layout: Layout, ratio: float, view: DraftView, imp: torch.Tensor,
             units: torch.Tensor | None) -> torch.Tensor:
        """Bool [N]: exactly K target context tokens from draft-token importances `imp` (closed over `units`
        if given)."""
        ctx = layout.context_mask()
        spans = torch.full((view.n,), -1, dtype=torch.long)
        body = slice(view.body_start, view.n)
        spans[body] = segment_spans(imp[body], self.tau_smooth, self.max_span)
        order = rank(imp, view.candidates)

        def expand(j: int) -> torch.Tensor:
            init = first(order, j, view.n)
            grown = init.clone()
            grown[body] = complete_spans(spans[body], init[body], self.tau_cover)
            out = view.align.project(grown) & ctx
            return close_units(out, units) & ctx if units is not None else out

        return fit(layout.budget(ratio), order.numel(), expand, view.align.project_scores(imp), ctx, units)

    def _stored_importance(self, draft: Draft, layout: Layout, features: Features) -> tuple[DraftView, torch.Tensor]:
        """Eq. 1 per chunk, computed on (prefix + chunk) the first time the chunk is seen and kept in its store
        entry; the chunks' draft tokens laid end to end."""
        prefix = draft_view(draft, layout, features, (0, layout.prefix_len)).ids if layout.prefix_len else None
        after = digest(prefix if prefix is not None else torch.zeros(0))
        key = f"spec:{draft.fingerprint}:{self.deep_fraction:.4f}:{after}"
        views, imps = [], []
        for i, span in enumerate(layout.chunk_spans):
            view = draft_view(draft, layout, features, span)
            slot = features.chunk_features(i)
            # keyed by the draft tokens scored too: a stored score is laid over this request's view of the chunk,
            # which is not always the whole chunk (on a server an exact prefix may cover its head), and a score
            # fits only the tokens it was computed on
            chunk_key = f"{key}:{digest(view.ids)}"
            if chunk_key not in slot:
                ids = view.ids if prefix is None else torch.cat([prefix, view.ids])
                slot[chunk_key] = draft.importance(ids, self.deep_fraction)[ids.numel() - view.n :]
            views.append(view)
            imps.append(slot[chunk_key])
        return concat(views, layout.n), torch.cat(imps)
