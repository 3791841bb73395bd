"""The blend of a batch of requests, the same steps for every engine:

  lookup     the chunk store's entries for the batch's chunks (the only store reads), a remote one fetched only when
             that is predicted faster than computing the chunk here (`compute`: this server's measured cost);
  fill       exact KV for each request's unmatched shared prefix, and every chunk no entry holds computed
             standalone right after its request's shared prefix (once per batch);
  learn      those chunks go into the store;
  copy       every chunk's KV into its request's slots, K re-rotated to where the chunk now sits;
  features   the model passes the batch's selectors declare (Selector.needs), one per feature for the whole batch;
  select     per request, at its ratio or, with a quality floor (plan.max_kl), at the smallest rho whose fidelity
             estimate meets it (chunkcache.blend.fidelity: no model pass); every request's estimate at the rho it
             got; per-chunk features a selector kept go into the store with their entry;
  recompute  the selected tokens of every request through all layers; its output is the engine's.

The engine (`Engine`) runs the model: the reference blender on HF modules (chunkcache.reference), SGLang's model
runner in the server (sglang_patch.scheduler.blend). Plans come from chunkcache.blend.plan.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..select.base import Selector, needs
from ..store import ChunkEntry, ChunkStore, Lookup
from . import fidelity
from .cost import ComputeCost
from .features import DeviationJob, FeaturePasses, Models, RequestFeatures, check_deviation_args
from .plan import Placement, RequestPlan, recompute_set, to_compute

log = logging.getLogger(__name__)
STEPS = ("lookup", "fill", "learn", "copy", "features", "select", "recompute")
PASSES = ("query_attention", "kv_deviation")  # the features an engine computes with model passes


class Engine(FeaturePasses, Protocol):
    """The model side of a batch's blend; built for one batch of `plans` (requests are indices into them)."""

    fingerprint: str
    models: Models
    rope: Any  # chunkcache.rope.RopeSpec: stored keys moved to where a chunk sits
    entry_shape: tuple[int, int, int]  # a stored entry's K per token: (layers, KV heads, head dim)

    def fill(self, chunks: list[tuple[int, Placement]]) -> list[ChunkEntry]:
        """Exact KV for tokens [matched, start) of every request, in place; and each (request, chunk) computed
        standalone right after that request's shared prefix, returned as entries (not stored, not copied)."""
        ...

    def copy(self, entries: list[list[ChunkEntry]]) -> None:
        """Each request's chunk entries (plan.chunks order) into its slots, K re-rotated; `head` tokens skipped."""
        ...

    def recompute(self, tokens: list[torch.Tensor]) -> Any:
        """Each request's tokens (sorted prompt indices) through all layers; the engine's output."""
        ...


@dataclass
class Blended:
    """What the blend did for one request."""

    plan: RequestPlan
    hits: int  # chunks found in the store (before the fill)
    recomputed: torch.Tensor  # [M] int64, sorted prompt indices recomputed in this prompt's context
    scores: torch.Tensor | None  # the selector's per-token scores, if it has any
    select_s: float  # this request's own selection time (batched feature passes excluded)
    passes: tuple[str, ...] = ()  # the engine's feature passes this request took part in (FeaturePasses methods)
    ratio: float = 0.0  # the rho it was selected at (plan.ratio, or the quality floor's choice)
    estimate: fidelity.Estimate | None = None  # its fidelity estimate at that rho; None without mix's signals
    floor_met: bool | None = None  # with a quality floor: whether some rho up to the cap met it (else ratio 1)
    fetched: int = 0  # of its chunk hits, those the remote tier served
    computed_instead: int = 0  # chunks not asked of the remote tier: computing them was predicted faster

    @property
    def reused_tokens(self) -> int:
        """Chunk tokens whose KV came from the store and was not recomputed."""
        blended = sum(e - s for s, e in (c.span for c in self.plan.chunks))
        spans = self.plan.layout().context_mask()
        return blended - int(spans[self.recomputed].sum())


@dataclass
class BatchBlend:
    output: Any  # the engine's recompute output
    requests: list[Blended]
    seconds: dict[str, float]  # per step (STEPS)
    # deviations estimated for chunks that remembered none (mix's first_reuse "estimate"), for the engine's owner to
    # measure after the batch: each job's `run` returns the features to write through (ChunkStore.add_features)
    deferred: list[DeviationJob]


def run(engine: Engine, store: ChunkStore, plans: Sequence[RequestPlan], selector: Callable[[str], Selector],
        floor_cap: float = 1.0, compute: ComputeCost | None = None) -> BatchBlend:
    """`floor_cap`: the largest rho a request's quality floor may choose. `compute`: what computing a chunk costs
    this server (priced against a remote fetch, and measured on the fill); None: every remote entry is fetched."""
    seconds = dict.fromkeys(STEPS, 0.0)
    step = _stopwatch(seconds)
    with step("lookup"):
        looked = lookup(store, plans, engine, compute)
    found = looked.entries
    with step("fill"):
        computed = engine.fill(to_compute(plans, found))
    if compute is not None:
        compute.observe(sum(e.num_tokens for e in computed), seconds["fill"])
    with step("learn"):
        for entry in computed:
            if not store.put(entry):
                log.warning("chunkcache: the chunk store kept no copy of chunk %s (%d bytes); every request that uses "
                            "it computes it again", entry.key, entry.nbytes)
    entries = {**found, **{e.key: e for e in computed}}
    per_request = [[entries[c.key] for c in p.chunks] for p in plans]
    with step("copy"):
        engine.copy(per_request)
    features = [RequestFeatures(engine, engine.models, i, p.layout(), chunks)
                for i, (p, chunks) in enumerate(zip(plans, per_request))]
    selectors = [selector(p.selector) for p in plans]
    with step("features"):
        prefetch(engine, features, selectors)
    blended = []
    with step("select"):
        for p, f, sel in zip(plans, features, selectors):
            t = time.perf_counter()
            layout = f.layout
            ratio, met = _budget(p, sel, f, floor_cap)
            selection = sel.select(layout, ratio, f)
            recomputed = recompute_set(layout, selection.indices)
            estimate = None if selection.scores is None else fidelity.estimate(
                fidelity.signals(fidelity.evidence(layout, selection.scores, f.values), recomputed))
            blended.append(Blended(p, sum(c.key in found for c in p.chunks), recomputed, selection.scores,
                                   time.perf_counter() - t, tuple(sorted({name for name, _ in f.values
                                                                          if name in PASSES})),
                                   ratio, estimate, met, sum(c.key in looked.fetched for c in p.chunks),
                                   sum(c.key in looked.computed_instead for c in p.chunks)))
        added: dict[str, dict[str, torch.Tensor]] = {}
        for f in features:  # per-chunk selector features reach every tier and the host budget
            for key, feats in f.added_features().items():
                added.setdefault(key, {}).update(feats)
        for key, feats in added.items():
            store.add_features(key, feats)
    with step("recompute"):
        output = engine.recompute([b.recomputed for b in blended])
    return BatchBlend(output, blended, seconds, [DeviationJob(engine, f, engine.rope) for f in features
                                                 if f.unmeasured is not None])


def _budget(plan: RequestPlan, sel: Selector, features: RequestFeatures, cap: float) -> tuple[float, bool | None]:
    """(rho, whether the quality floor was met): the plan's ratio without a floor; with one, the smallest rho of the
    fidelity grid up to `cap` whose estimate meets it, else 1 (every context token recomputed)."""
    if plan.max_kl is None:
        return plan.ratio, None
    chosen = fidelity.smallest_ratio(fidelity.at_ratios(sel, features.layout, features), plan.max_kl, cap=cap)
    return (1.0, False) if chosen is None else (chosen, True)


def lookup(store: ChunkStore, plans: Sequence[RequestPlan], engine: Engine, compute: ComputeCost | None) -> Lookup:
    """Each distinct chunk's entry, where the store has one that holds exactly its tokens (the batch's keys in one
    store call: one remote round trip per server at most, for the chunks worth fetching)."""
    chunks = {c.key: (plan, c) for plan in plans for c in plan.chunks}
    costs = None if compute is None else {
        key: (c.span[1] - c.span[0], compute.chunk_s(c.span[1] - c.span[0])) for key, (_, c) in chunks.items()}
    looked = store.lookup(list(chunks), costs)
    found = {key: _holding(looked.entries.get(key), plan.chunk_ids(c), key, engine)
             for key, (plan, c) in chunks.items()}
    entries = {key: entry for key, entry in found.items() if entry is not None}
    return Lookup(entries, frozenset(k for k in looked.fetched if k in entries), looked.computed_instead)


def _holding(entry: ChunkEntry | None, ids: torch.Tensor, key: str, engine: Engine) -> ChunkEntry | None:
    """`entry` if it holds these tokens' KV, else a miss: a value under the right key with other tokens or another
    shape (a forged or foreign shared-tier value with a valid checksum) must never be copied into a request. The
    chunk is then computed, and its put replaces the bad value in every tier. An entry of another model is refused
    outright (FingerprintMismatch): the store was set up for the wrong model."""
    if entry is None:
        return None
    entry.check_model(engine.fingerprint)
    layers, heads, dim = engine.entry_shape
    if tuple(entry.k.shape) == (layers, len(ids), heads, dim) and torch.equal(entry.token_ids.to(ids.device), ids):
        return entry
    log.warning("chunkcache: store entry %s holds %d other tokens (KV %s) than its chunk's %d; computing the chunk",
                key, entry.num_tokens, tuple(entry.k.shape), len(ids))
    return None


def prefetch(passes: FeaturePasses, features: list[RequestFeatures], selectors: list[Selector]) -> None:
    """Every feature the batch's selectors declare, one pass per feature for all the requests that want it."""
    wanted: dict[tuple[str, tuple], list[RequestFeatures]] = {}
    for f, sel in zip(features, selectors):
        for need in needs(sel):
            wanted.setdefault(need, []).append(f)
    for (name, args), fs in wanted.items():
        if name == "known_deviation":  # the deviation pass only for the requests a chunk of which has none stored
            check_deviation_args(*args, passes.n_layers)
            name = "kv_deviation"
            fs = [f for f in fs if f.stored_deviation(*args) is None and (name, args) not in f.values]
            if not fs:
                continue
        indices = [f.index for f in fs]
        if name == "query_attention":
            values = passes.query_attention(indices)
        elif name == "kv_deviation":
            check_deviation_args(*args, passes.n_layers)
            values = passes.kv_deviation(indices, *args)
        else:
            continue  # served lazily by RequestFeatures
        for f, value in zip(fs, values):
            f.values[name, args] = value


def _stopwatch(seconds: dict[str, float]):
    @contextmanager
    def step(name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds[name] += time.perf_counter() - t0

    return step
