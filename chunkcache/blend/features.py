"""What selectors may ask of a request (chunkcache.select.base.Features), the same for every engine.

`RequestFeatures` memoises every value per request, decodes the prompt's text, hands out the engine's drafts and the
chunk store's per-chunk feature slots, and notes which features a selector added to them. The two values that need the target
model (ProphetKV's query attention, CacheBlend's KV deviation) come from the engine's batched passes
(`FeaturePasses`), so the pipeline can compute them for a whole batch before any selector runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..align import decode_with_offsets
from ..ranks import Ranks
from ..rope import rerotate
from ..select.base import Layout
from ..store import ChunkEntry

if TYPE_CHECKING:
    from ..draft import Draft


class FeaturePasses(Protocol):
    """The model passes behind the features, for several requests at once (indices into the pipeline's batch)."""

    n_layers: int

    def query_attention(self, requests: Sequence[int]) -> list[torch.Tensor]: ...

    def kv_deviation(self, requests: Sequence[int], layer: int, which: str) -> list[torch.Tensor]: ...

    def aside(self) -> "ExactKV":
        """The forward a measurement after the batch runs (DeviationJob), keeping nothing of the batch's engine."""
        ...


# K and V [layers, tokens, KV heads, dim] of token ids computed exactly through their first `layers` layers (the
# prompt alone, from its first token; nothing of any request's KV read or written, so it can run after the request):
# a generator whose steps are the forwards (chunkcache.blend.idle runs one step per idle turn), returning them
ExactKV = Callable[[torch.Tensor, int], Generator[None, None, tuple[torch.Tensor, torch.Tensor]]]


class Models:
    """The tokenizer and draft models selectors may ask for, loaded on first use and kept for the engine's life."""

    def __init__(self, model_dir: str | os.PathLike, load_draft: Callable[[str, int | None], "Draft"],
                 default_draft: tuple[str, int | None] = ("self", None)):
        self.model_dir = str(model_dir)
        self._load_draft = load_draft
        self.default_draft = default_draft
        self._drafts: dict[tuple[str, int | None], "Draft"] = {}
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    def draft(self, model: str | None = None, layers: int | None = None) -> "Draft":
        """None (model or layers) takes the default draft's."""
        model = model or self.default_draft[0]
        layers = self.default_draft[1] if layers is None else layers
        if (model, layers) not in self._drafts:
            self._drafts[model, layers] = self._load_draft(model, layers)
        return self._drafts[model, layers]


def check_deviation_args(layer: int, which: str, n_layers: int) -> None:
    if which not in ("k", "v"):
        raise ValueError(f"which must be 'k' or 'v', got {which!r}")
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} outside [0, {n_layers})")


# A chunk's K/V deviation grows with how far it sits from where its KV was computed: its mean K deviation at layer
# 3, measured at depths d1 and d2 (positions between its home and its place), follows (d2 / d1) ** 0.32 on MuSiQue
# passages (r 0.94, 239 pairs of the same chunk in three orders) and ** 0.35 on synthetic multikey documents (r 0.97,
# 60 pairs; SmolLM2-135M, docs/bench/eval_select.md). An entry remembers its deviation as it would be DEPTH_REF
# positions from home, and a request reads it scaled to the chunk's depth there: without this, a chunk measured
# deep and read shallow outweighs one measured shallow and read deep.
DEPTH_EXPONENT = 0.3
DEPTH_REF = 1024
# Within a chunk away from home the deviation falls with the token's offset from the chunk's start: the first tokens
# lost the most context. Mean K deviation at layer 3 over its chunk's mean, by offset (realkey, 6 cases, 42 chunks):
# 2.09 at 0, 1.65 at 4-7, 1.36 at 16-31, 0.90 at 64-127, 0.72 past 128; log-log slope -0.28. A chunk without a
# remembered deviation reads its estimated level in this shape, (offset + 1) ** -OFFSET_EXPONENT, mean 1 over the chunk.
OFFSET_EXPONENT = 0.3
# measurements a remembered deviation averages at most: each refinement rewrites the whole entry (its KV too) in the
# disk and remote tiers, and the mean of a few contexts moves little after
DEVIATION_MEASUREMENTS = 4


def deviation_feature(layer: int, which: str) -> str:
    """The name of a chunk entry's remembered deviation (RequestFeatures.known_deviation), at DEPTH_REF."""
    return f"deviation@{DEPTH_REF}:{which}{layer}"


def _offset_shape(tokens: int) -> torch.Tensor:
    """[tokens] float32, mean 1: the estimated deviation of a chunk's tokens by offset, over its mean."""
    shape = (torch.arange(tokens, dtype=torch.float32) + 1) ** -OFFSET_EXPONENT
    return shape / shape.mean()


def _depth(end: int, entry: ChunkEntry) -> int:
    """Positions between where the chunk ending at `end` sits and where its KV was computed; 0: at home (exact)."""
    return abs(end - entry.num_tokens - entry.start_pos)


def _depth_scale(depth: int) -> float:
    """Deviation at `depth` over the deviation at DEPTH_REF."""
    return (max(depth, 1) / DEPTH_REF) ** DEPTH_EXPONENT


class RequestFeatures:
    """The Features of request `index` of a pipeline batch; each value is computed at most once."""

    def __init__(self, passes: FeaturePasses, models: Models, index: int, layout: Layout,
                 entries: Sequence[ChunkEntry]):
        self.passes, self.models, self.index, self.layout = passes, models, index, layout
        self.entries = list(entries)  # layout.chunk_spans order
        self.values: dict[tuple[str, tuple], Any] = {}  # (Features method, args) -> value
        self._had = {e.key: dict(e.features) for e in self.entries}  # features before any selector ran
        self.unmeasured: tuple[int, str] | None = None  # (layer, which) a remembered deviation was estimated for

    def _memo(self, name: str, args: tuple, compute: Callable[[], Any]) -> Any:
        if (name, args) not in self.values:
            self.values[name, args] = compute()
        return self.values[name, args]

    def query_attention(self) -> torch.Tensor:
        return self._memo("query_attention", (), lambda: self.passes.query_attention([self.index])[0])

    def kv_deviation(self, layer: int, which: str) -> torch.Tensor:
        check_deviation_args(layer, which, self.passes.n_layers)
        return self._memo("kv_deviation", (layer, which),
                          lambda: self.passes.kv_deviation([self.index], layer, which)[0])

    def known_deviation(self, layer: int, which: str) -> torch.Tensor:
        """kv_deviation as each chunk's store entry remembers it (stored_deviation) when every chunk has one, else
        measured in this request by the engine's pass, which every chunk away from home folds into its remembered
        mean (at most DEVIATION_MEASUREMENTS measurements)."""
        check_deviation_args(layer, which, self.passes.n_layers)
        return self._memo("known_deviation", (layer, which), lambda: self._known_deviation(layer, which))

    def remembered_deviation(self, layer: int, which: str) -> torch.Tensor:
        """kv_deviation as each chunk's store entry remembers it, never a pass on the request's path: a chunk away
        from home with none yet reads an estimate (the mean level of the request's remembered chunks at its own
        depth, 1 when no chunk remembers one, falling with each token's offset in the chunk: OFFSET_EXPONENT) and
        is listed in `unmeasured`, for a DeviationJob after the request."""
        check_deviation_args(layer, which, self.passes.n_layers)
        return self._memo("remembered_deviation", (layer, which), lambda: self._remembered(layer, which))

    def stored_deviation(self, layer: int, which: str) -> torch.Tensor | None:
        """[N] float32: each reused chunk's deviation from its entry at the chunk's depth here, zero for a chunk at the
        place it was computed (its reused KV is exact); None when another chunk has none stored."""
        out, missing = self._stored(layer, which)
        return None if missing else out

    def _stored(self, layer: int, which: str) -> tuple[torch.Tensor, list[int]]:
        """The remembered deviations at the chunks' depths here (zero where a chunk has none) and the chunks away
        from home that have none (indices into the layout's chunks)."""
        name = deviation_feature(layer, which)
        out, missing = torch.zeros(self.layout.n), []
        for i, ((s, e), entry) in enumerate(zip(self.layout.chunk_spans, self.entries)):
            depth = _depth(e, entry)
            if not depth:
                continue
            stored = entry.features.get(name)
            if stored is None:
                missing.append(i)
                continue
            # an exact prefix may cover the chunk's head here
            out[s:e] = stored[len(stored) - (e - s):] * _depth_scale(depth)
        return out, missing

    def _remembered(self, layer: int, which: str) -> torch.Tensor:
        out, missing = self._stored(layer, which)
        if not missing:
            return out
        name, spans = deviation_feature(layer, which), self.layout.chunk_spans
        levels = [float(self.entries[i].features[name].mean()) for i, ((s, e), entry)
                  in enumerate(zip(spans, self.entries)) if _depth(e, entry) and i not in missing]
        level = sum(levels) / len(levels) if levels else 1.0  # at DEPTH_REF
        for i in missing:
            s, e = spans[i]
            entry = self.entries[i]
            shape = _offset_shape(entry.num_tokens)[entry.num_tokens - (e - s):]  # an exact prefix may cover its head
            out[s:e] = level * _depth_scale(_depth(e, entry)) * shape
        self.unmeasured = (layer, which)
        return out

    def _known_deviation(self, layer: int, which: str) -> torch.Tensor:
        # a request the batch's pass measured keeps its own: another request of the batch may have stored the chunks'
        # deviations (measured in its context) since the prefetch
        measured = ("kv_deviation", (layer, which)) in self.values
        stored = None if measured else self.stored_deviation(layer, which)
        if stored is not None:
            return stored
        fresh = self.kv_deviation(layer, which)
        remember(self.layout, self.entries, fresh, layer, which)
        return fresh

    def true_deviation(self, attended: bool = False) -> torch.Tensor:
        serve = getattr(self.passes, "true_deviation", None)  # optional: it costs a full prefill (the oracle's)
        if serve is None:
            raise NotImplementedError(f"{type(self.passes).__name__} does not serve true_deviation (full "
                                      "recompute's KV, for the oracle selector): use the reference blender")
        return self._memo("true_deviation", (attended,), lambda: serve([self.index], attended)[0])

    def prompt_text(self) -> tuple[str, list[tuple[int, int]]]:
        return self._memo("prompt_text", (),
                          lambda: decode_with_offsets(self.models.tokenizer, self.layout.token_ids.tolist()))

    def draft(self, model: str | None, layers: int | None) -> "Draft":
        return self.models.draft(model, layers)

    def chunk_features(self, index: int) -> dict[str, torch.Tensor]:
        return self.entries[index].features

    def added_features(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per chunk key, the features a selector added to its entry, or replaced, during this request."""
        added = {}
        for e in self.entries:
            had = self._had[e.key]
            new = {name: t for name, t in e.features.items() if had.get(name) is not t}
            if new:
                added[e.key] = new
        return added


def remember(layout: Layout, entries: Sequence[ChunkEntry], deviation: torch.Tensor, layer: int, which: str) -> None:
    """Fold a request's measured deviation ([N], its prompt's tokens) into every whole chunk's entry away from home:
    each entry keeps the mean of its first DEVIATION_MEASUREMENTS measurements at DEPTH_REF, each in another
    context, so what is particular to one context weighs less. At home the deviation is zero and says nothing of
    elsewhere; a chunk whose head the radix match covered was measured in part."""
    name = deviation_feature(layer, which)
    count = f"{name}/n"
    for (s, e), entry in zip(layout.chunk_spans, entries):
        depth = _depth(e, entry)
        if not depth or e - s != entry.num_tokens:
            continue
        kept, n = entry.features.get(name), entry.features.get(count, torch.zeros(1))
        if n >= DEVIATION_MEASUREMENTS:
            continue
        at_ref = deviation[s:e].float() / _depth_scale(depth)
        entry.features[name] = at_ref if kept is None else kept + (at_ref - kept) / (n + 1)
        entry.features[count] = n + 1


class DeviationJob:
    """The deviation a request's estimate stood in for, measured after the request (an idle server, or the
    reference blender once the blend is done): the prompt computed exactly through the check layer, compared with
    each chunk's stored KV moved to where the chunk sat, and folded into the entries (`remember`)."""

    def __init__(self, exact_kv: ExactKV, token_ids: torch.Tensor, features: RequestFeatures, rope,
                 ranks: Ranks = Ranks()):
        """`exact_kv`: the engine's forward of the prompt `token_ids` (FeaturePasses.aside); `ranks`: the
        tensor-parallel ranks whose KV heads it computes a slice of (the norm is over all)."""
        self.exact_kv, self.token_ids, self.rope, self.ranks = exact_kv, token_ids, rope, ranks
        self.layout, self.entries = features.layout, features.entries
        self.layer, self.which = features.unmeasured

    def run(self) -> Generator[None, None, dict[str, dict[str, torch.Tensor]]]:
        """Measures and remembers, a forward per step; returns the features each entry gained (for the store's
        write-through)."""
        had = {e.key: dict(e.features) for e in self.entries}
        k, v = yield from self.exact_kv(self.token_ids, self.layer + 1)
        fresh = (k if self.which == "k" else v)[self.layer].float()
        squares = torch.zeros(self.layout.n)
        for (s, e), entry in zip(self.layout.chunk_spans, self.entries):
            if not _depth(e, entry) or e - s != entry.num_tokens:
                continue
            if self.which == "k":
                at = torch.arange(entry.start_pos, entry.start_pos + entry.num_tokens)
                reused = rerotate(entry.k.float(), s - entry.start_pos, self.rope, at)[self.layer]
            else:
                reused = entry.v[self.layer].float()
            squares[s:e] = (fresh[s:e] - reused).flatten(1).square().sum(1)
        remember(self.layout, self.entries, self.ranks.sum_(squares).sqrt(), self.layer, self.which)
        return {e.key: new for e in self.entries
                if (new := {k: t for k, t in e.features.items() if had[e.key].get(k) is not t})}
