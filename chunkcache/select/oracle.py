"""The ceiling: recompute the tokens whose reused KV deviates most from full recompute's (Features.true_deviation,
summed over every layer). Tokens left unselected keep their reused KV whatever else is recomputed, so at a budget of K
this pick leaves the least reused-KV deviation in the prompt. It needs full recompute's KV, a full prefill, so it is a
measuring stick (the reference blender serves it), not a way to save compute.

`attended` weighs each layer's deviation by full recompute's attention from the query to the token: the query's
attention output at a layer is the attention-weighted sum of the values, so a deviation the query does not read cannot
move the answer (on multikey the unweighted oracle's first-token KL was worse than ProphetKV's and mix's:
docs/bench/eval_select.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import REGISTRY, Features, Layout, Selection, finish
from .budget import rank


@REGISTRY.register
@dataclass(frozen=True)
class OracleSelector:
    name: ClassVar[str] = "oracle"
    attended: bool = False  # weigh each layer's deviation by full recompute's query attention to the token

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection:
        true_deviation = getattr(features, "true_deviation", None)
        if true_deviation is None:  # an engine whose Features predate the oracle (the server's)
            raise NotImplementedError(f"the oracle selector needs full recompute's KV (Features.true_deviation), "
                                      f"which {type(features).__name__} does not serve: use the reference blender")
        scores = true_deviation(self.attended)
        return finish(layout, rank(scores, layout.context_mask())[: layout.budget(ratio)], scores)
