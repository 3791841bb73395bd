"""The one interface every selector implements.

A selector decides which prompt tokens must have their KV recomputed when cached chunk KV is reused.
Budget convention (the papers'): rho counts *context* tokens only, i.e. the tokens of reused chunks.
K = ceil(rho * n_context) context tokens are picked; the query tokens and the last prompt token are always
recomputed on top of that budget, and prefix tokens are never selected (their KV is exact: every chunk was
computed right after the same shared prefix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ..config import ConfigError, SelectConfig

if TYPE_CHECKING:
    from ..draft import Draft

# ProphetKV's relevance is the attention the query's last QUERY_PASS_TOKENS tokens pay each context token. Only those
# tokens run in the query pass, attending the prefix, the chunks and each other: an automatic hint's "query" is
# everything after the last stored segment, uncovered passages included, and running it all here would compute it
# twice (the recompute computes it again), and recording a row is an explicit softmax over the whole context. What
# the query's earlier tokens and the tokens between chunks say reaches these rows only in the recompute.
QUERY_PASS_TOKENS = 64


@dataclass(frozen=True)
class Layout:
    """Where everything sits in one request's prompt (target-model token indices, end exclusive)."""

    token_ids: torch.Tensor  # [N] int64, the whole prompt
    prefix_len: int  # tokens [0, prefix_len) are the shared prefix
    chunk_spans: tuple[tuple[int, int], ...]  # reused chunks, sorted, non-overlapping, after the prefix
    query_span: tuple[int, int]  # the user query; always ends at N

    @property
    def n(self) -> int:
        return int(self.token_ids.numel())

    def context_mask(self) -> torch.Tensor:
        """Bool [N]: tokens that belong to a reused chunk (the candidates a selector ranks)."""
        m = torch.zeros(self.n, dtype=torch.bool)
        for s, e in self.chunk_spans:
            m[s:e] = True
        return m

    def forced_mask(self) -> torch.Tensor:
        """Bool [N]: tokens recomputed whatever the selector says (query, anything between chunks, last token)."""
        m = ~self.context_mask()
        m[: self.prefix_len] = False
        m[self.n - 1] = True
        return m

    def held(self) -> torch.Tensor:
        """[M] sorted positions holding the prompt's KV before anything is recomputed: the prefix and the chunks.
        The rest (tokens between chunks, the query) has none until the recompute."""
        return torch.cat([torch.arange(self.prefix_len), *(torch.arange(s, e) for s, e in self.chunk_spans)])

    def query_pass(self) -> torch.Tensor:
        """The positions the query pass runs (and whose attention it records): the query's last QUERY_PASS_TOKENS
        tokens, attending the held positions and each other (QUERY_PASS_TOKENS above)."""
        return torch.arange(max(self.query_span[0], self.n - QUERY_PASS_TOKENS), self.n)

    def budget(self, ratio: float) -> int:
        """K = ceil(rho * n_context), the number of context tokens a selector may pick."""
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        n_ctx = int(self.context_mask().sum())
        return min(n_ctx, math.ceil(ratio * n_ctx - 1e-9))


@dataclass
class Selection:
    indices: torch.Tensor  # [M] int64, sorted target-token indices to recompute (forced tokens included)
    scores: torch.Tensor | None = None  # [N] float, the selector's per-token importance (None if it has none)
    # the budget the selector chose itself (an adaptive budget: chunkcache.select.adaptive), at most the request's
    # rho; None: it spent the request's rho
    ratio: float | None = None


class Features(Protocol):
    """What a selector may ask of the engine running the request; computed lazily, at most once per request.

    Selectors stay pure functions of (layout, ratio, features): tests pass a stand-in with hand-made values.
    Engines (the reference blender, the SGLang scheduler hook) implement the methods they support and raise
    NotImplementedError for the others.
    """

    def kv_deviation(self, layer: int, which: str) -> torch.Tensor:
        """[N] float: per-token L2 distance between freshly computed and reused K ("k") or V ("v") at `layer`
        (all heads flattened). Zero for tokens that are not reused."""
        ...

    def known_deviation(self, layer: int, which: str) -> torch.Tensor:
        """kv_deviation as the chunks' store entries remember it: each chunk's was measured in the first request
        that blended it away from the place it was computed, and kept with its KV (a chunk at that place has none:
        its reused KV is exact). When a chunk has none yet, kv_deviation is measured in this request and remembered
        by the chunks that had none."""
        ...

    def remembered_deviation(self, layer: int, which: str) -> torch.Tensor:
        """known_deviation without a pass in the request: a chunk away from home that remembers none yet reads an
        estimate (the mean level of the request's remembered chunks at its depth, falling with each token's offset
        in the chunk), and the engine measures it after the request."""
        ...

    def query_attention(self) -> torch.Tensor:
        """[N] float: ProphetKV's fused score: the query tokens run through all layers against the reused KV;
        per layer the softmax attention from query tokens to each token, averaged over query tokens and heads;
        summed over layers."""
        ...

    def true_deviation(self, attended: bool) -> torch.Tensor:
        """[N] float: per token, summed over all layers, ||K_reused - K_full|| + ||V_reused - V_full|| between the
        reused KV (copied from the store, K re-rotated) and full recompute's (all heads flattened); zero for tokens
        that are not reused. `attended`: each layer's term weighted by full recompute's attention from the query
        tokens to the token at that layer (averaged over query tokens and heads): the deviation the query reads.
        The ground truth of what should be recomputed (the `oracle` selector); it costs a full prefill, so only the
        reference blender serves it."""
        ...

    def prompt_text(self) -> tuple[str, list[tuple[int, int]]]:
        """The prompt as text and each target token's (start, end) character offsets in it
        (`chunkcache.align.decode_with_offsets` computes both from the token ids)."""
        ...

    def draft(self, model: str | None, layers: int | None) -> "Draft":
        """The engine's in-process draft model (`chunkcache.draft.load`), loaded once and kept by the engine:
        "self" is the target truncated to its first `layers` layers, anything else a model name or path;
        None (model or layers) takes the engine's configured draft (config.DraftConfig)."""
        ...

    def chunk_features(self, index: int) -> dict[str, torch.Tensor]:
        """The feature slot of chunk `index` (layout.chunk_spans order), kept with the chunk's cached KV in the
        chunk store, so per-chunk selector data (e.g. CacheClip's auxiliary-model KV) is computed once."""
        ...


class Selector(Protocol):
    name: ClassVar[str]  # registry key, also what configs and request hints name
    # Engine features the selector will ask for, as (Features method, args) pairs. An engine that serves many
    # requests at once computes them for the whole batch before any select() call (one model pass for all, not
    # one per request); select() then finds them computed. Optional: without it a selector is simply served lazily.
    needs: tuple[tuple[str, tuple], ...]

    def select(self, layout: Layout, ratio: float, features: Features) -> Selection: ...


def needs(selector: Selector) -> tuple[tuple[str, tuple], ...]:
    """The features `selector` declares (see Selector.needs); none for a selector that declares nothing."""
    return tuple(getattr(selector, "needs", ()))


def finish(layout: Layout, picked: torch.Tensor, scores: torch.Tensor | None,
           ratio: float | None = None) -> Selection:
    """Union the picked context tokens with the forced ones and return them sorted (`ratio`: Selection.ratio)."""
    mask = layout.forced_mask()
    if picked.numel():
        mask[picked.long()] = True
    return Selection(indices=mask.nonzero().flatten(), scores=scores, ratio=ratio)


class Registry:
    """Selector classes by their `name`. A name is registered once: a second class under it is refused, since
    which selector a config or a request hint means must not depend on which module was imported last."""

    def __init__(self) -> None:
        self._classes: dict[str, type] = {}

    def register(self, cls: type) -> type:
        """Class decorator; ValueError for a blank or already registered name."""
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"selector class {cls.__qualname__} needs a non-empty string `name`, has {name!r}")
        if name in self._classes:
            taken = self._classes[name]
            raise ValueError(f"selector {name!r} is already registered by {taken.__module__}.{taken.__qualname__}; "
                             f"{cls.__module__}.{cls.__qualname__} needs another name")
        self._classes[name] = cls
        return cls

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted(self._classes)

    def create(self, name: str, **options: Any) -> Selector:
        if name not in self._classes:
            raise ValueError(f"unknown selector {name!r}; known: {', '.join(self.names())}")
        return self._classes[name](**options)

    def check(self, select: SelectConfig) -> None:
        """ConfigError for a config's select section naming a selector not registered, or options its class refuses
        (an unknown option, a value out of range): Config.load(..., selectors=REGISTRY) reports them at load, not
        every request that uses them. Options that are not a mapping are SelectConfig.check's to report."""
        known = self.names()
        if select.selector not in self._classes:
            raise ConfigError("selector", f"{select.selector!r} is not one of {', '.join(known)}")
        for name, opts in select.options.items():
            if name not in self._classes:
                raise ConfigError("options", f"{name!r} is not a selector; known: {', '.join(known)}")
            if isinstance(opts, dict):
                try:
                    self.create(name, **opts)
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"options:{name}", str(exc)) from None


REGISTRY = Registry()
