"""A request's chunk reuse, in the order it happens, the same for every engine (the reference blender on HF
modules, chunkcache.reference; SGLang's model runner, sglang_patch.scheduler.blend). One `ChunkRequest`
(chunkcache.blend.request) carries the request through:

  detect     automatic detection only: the prompt's stored segments past its exact prefix become its hint, when they
             are enough to blend; the store's entries stay on the request for the lookup (`detect`)
  plan       the round's blend plan, once per radix match (ChunkRequest.plan)
  lookup     the store's entries for a batch's chunks (the only store reads), a remote one fetched only when that is
             predicted faster than computing the chunk here (`compute`: this server's measured cost)
  fill       exact KV for each request's unmatched shared prefix, and every chunk no entry holds computed standalone
             right after its request's shared prefix (once per batch)
  learn      those chunks go into the store (`store_entries`) when their keys name the context they were computed
             after (a client's chunks); after the prefill, the prompt's paragraphs holding segments no tier holds are
             named (`to_encode`) and each is later computed alone after the canonical head and stored
             (`store_encode`: a server's idle work; chunkcache.blend.auto)
  copy       every chunk's KV into its request's slots, K re-rotated to where the chunk now sits
  features   the model passes the batch's selectors declare (Selector.needs), one per feature for the whole batch
  select     per request, at its ratio or, with a quality floor (plan.max_kl), at the smallest rho whose fidelity
             estimate meets it (chunkcache.blend.fidelity: no model pass); per-chunk features a selector kept go into
             the store with their entry
  recompute  the selected tokens of every request through all layers; its output is the engine's
  record     each round's report, the same fields from both engines (`record`, `record_held`), checked against its
             shape's schema (chunkcache.blend.round_report); the glue only puts it in meta_info, logs and /metrics

`run` is lookup through recompute for one batch (the engine's forward); the engine (`Engine`) runs the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from ..ranks import Ranks, all_hold
from ..select.base import Selector, needs
from ..store import ChunkEntry, ChunkStore, Lookup
from . import fidelity, round_report
from .auto import AutoChunks, Encode, Segments
from .cost import ComputeCost, Prediction
from .features import DeviationJob, FeaturePasses, Models, RequestFeatures, check_deviation_args
from .plan import Placement, RequestPlan, recompute_set, to_compute
from .request import STAGES, ChunkRequest, Detection, RequestHint

log = logging.getLogger(__name__)
PASSES = ("query_attention", "kv_deviation")  # the features an engine computes with model passes
NO_BATCH = {"requests": 0, "plain": 0, "decodes": 0, "forwards": 0}  # a round that blended nothing
UNCALIBRATED = ("no fidelity estimator was fitted for this model, so no rho can be promised to meet max_kl: computed "
                "in full (`chunkcache calibrate --model MODEL` fits one: docs/calibration.md)")
UNCALIBRATED_FIRST = ("no first-token fidelity estimator was fitted for this model, so no rho can be promised to meet "
                      "max_kl over the first token (kl_over: first_token): computed in full (`chunkcache calibrate` "
                      "fits one beside the answer's: docs/calibration.md)")


@dataclass(frozen=True)
class Defaults:
    """What a hint found by detection asks for: the server's (or the request's) selector, ratio, namespace, floor."""

    selector: str
    ratio: float
    namespace: str
    max_kl: float | None = None
    kl_over: str = "answer"


def detect(store: ChunkStore, auto: AutoChunks, token_ids: Sequence[int] | torch.Tensor, segments: Segments,
           matched: int, defaults: Defaults, compute: ComputeCost | None = None, ranks: Ranks = Ranks()) -> Detection:
    """The stored segments of a prompt past its first `matched` tokens (held exactly) as an auto hint, or none when
    they are too few to blend (the request is then served as stock). The store is asked once for all the segments
    (the remote tier in one round trip, for those worth fetching: a segment computing faster than it fetches is a
    hole); the entries it returned for the hint's chunks are kept for the blend's lookup. A segment counts as
    stored only where every rank's store holds it (`ranks`)."""
    t0 = time.perf_counter()
    wanted = segments.lookup_keys(matched)
    costs = None if compute is None else {k: (n, compute.chunk_s(n)) for n, k in wanted}
    looked, held = ranks.decide(
        lambda: store.lookup([k for _, k in wanted], costs) if wanted else Lookup({}, frozenset(), frozenset()),
        lambda here: [_position(here.entries.get(k)) for _, k in wanted], _held_alike)
    found = auto.detect(segments, len(token_ids), matched, {k for (_, k), have in zip(wanted, held) if have})
    hint = None if found is None else RequestHint(
        token_ids=torch.as_tensor(list(token_ids), dtype=torch.long), spans=found.spans, keys=found.keys,
        selector=defaults.selector, ratio=defaults.ratio, namespace=defaults.namespace, auto=True,
        max_kl=defaults.max_kl, kl_over=defaults.kl_over, tenant=segments.tenant)
    keys = frozenset(() if found is None else found.keys)
    kept = Lookup({k: looked.entries[k] for k in keys}, looked.fetched & keys, frozenset())
    return Detection(hint, kept, sum(e > matched for _, e in segments.spans), time.perf_counter() - t0)


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
    """What the blend did for one request in one round."""

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
    uncalibrated: bool = False  # its selector gives the estimator's signals, but the model has no estimator

    @property
    def reused_tokens(self) -> int:
        """Chunk tokens whose KV came from the store and was not recomputed."""
        blended = sum(e - s for s, e in (c.span for c in self.plan.chunks))
        spans = self.plan.layout().context_mask()
        return blended - int(spans[self.recomputed].sum())

    @property
    def attended_pairs(self) -> int:
        """(query, key) pairs the recomputed tokens attend, against the n(n+1)/2 of a causal prefill."""
        return int((self.recomputed + 1).sum())


@dataclass
class BatchBlend:
    output: Any  # the engine's recompute output
    requests: list[Blended]
    seconds: dict[str, float]  # per stage (STAGES), the batch's
    # deviations estimated for chunks that remembered none (mix's first_reuse "estimate"), for the engine's owner to
    # measure after the batch: each job's `run` returns the features to write through (ChunkStore.add_features)
    deferred: list[DeviationJob] = field(default_factory=list)


def run(engine: Engine, store: ChunkStore, plans: Sequence[RequestPlan], selector: Callable[[str], Selector],
        floor_cap: float = 1.0, compute: ComputeCost | None = None,
        prefetched: Iterable[Lookup] = (), estimator: fidelity.Model | None = None,
        ranks: Ranks = Ranks()) -> BatchBlend:
    """lookup, fill, learn, copy, features, select and recompute for one batch. `floor_cap`: the largest rho a
    request's quality floor may choose. `compute`: what computing a chunk costs this server (priced against a remote
    fetch, and measured on the fill); None: every remote entry is fetched. `prefetched`: entries detection already
    fetched (not asked of the store again). `estimator`: the served model's fidelity estimator (None: none was fitted
    for it, so no blend is estimated and a quality floor recomputes every context token). `ranks`: the
    tensor-parallel ranks whose forwards must compute the same rows: the chunks found and the tokens recomputed are
    agreed over them (rank 0's selection, from features every rank reduced over all heads)."""
    seconds = dict.fromkeys(STAGES, 0.0)
    step = _stopwatch(seconds)
    with step("lookup"):
        looked = lookup(store, plans, engine, compute, prefetched, ranks)
    found = looked.entries
    missing = to_compute(plans, found)
    with step("fill"):
        computed = engine.fill(missing)
    if compute is not None:
        compute.observe(sum(e.num_tokens for e in computed), seconds["fill"])
    with step("learn"):  # only what its key names (RequestPlan.context): an auto segment's fill serves this request
        named = {c.key for i, c in missing if plans[i].context is not None}
        store_entries(store, [e for e in computed if e.key in named])
    entries = {**found, **{e.key: e for e in computed}}
    per_request = [[entries[c.key] for c in p.chunks] for p in plans]
    with step("copy"):
        engine.copy(per_request)
    features = [RequestFeatures(engine, engine.models, i, p.layout(), chunks)
                for i, (p, chunks) in enumerate(zip(plans, per_request))]
    selectors = [selector(p.selector) for p in plans]
    with step("features"):
        prefetch(engine, features, selectors)
    with step("select"):
        blended = _agreed(ranks, lambda: [_select(p, f, sel, floor_cap, looked, estimator)
                                          for p, f, sel in zip(plans, features, selectors)])
        _keep_features(store, features)
    with step("recompute"):
        output = engine.recompute([b.recomputed for b in blended])
    return BatchBlend(output, blended, seconds, [DeviationJob(engine.aside(), plans[f.index].token_ids, f, engine.rope,
                                                              ranks) for f in features if f.unmeasured is not None])


def _select(plan: RequestPlan, f: RequestFeatures, sel: Selector, floor_cap: float, looked: Lookup,
            estimator: fidelity.Model | None) -> Blended:
    """One request's selection at its ratio (or its quality floor's), and its fidelity estimate at that rho."""
    t = time.perf_counter()
    estimator = fidelity.bounding(estimator, plan.kl_over)
    ratio, met = _budget(plan, sel, f, floor_cap, estimator)
    selection = sel.select(f.layout, ratio, f)
    recomputed = recompute_set(f.layout, selection.indices)
    estimate = None if selection.scores is None or estimator is None else fidelity.estimate(
        fidelity.signals(fidelity.evidence(f.layout, selection.scores, f.values), recomputed), estimator)
    return Blended(plan, sum(c.key in looked.entries for c in plan.chunks), recomputed, selection.scores,
                   time.perf_counter() - t, tuple(sorted({name for name, _ in f.values if name in PASSES})),
                   ratio, estimate, met, sum(c.key in looked.fetched for c in plan.chunks),
                   sum(c.key in looked.computed_instead for c in plan.chunks),
                   uncalibrated=selection.scores is not None and estimator is None)


def _agreed(ranks: Ranks, select: Callable[[], list[Blended]]) -> list[Blended]:
    """Every rank selects (each remembers what it measured), then takes rank 0's tokens and rho for every request:
    the features were reduced over all heads, but a float's order of summation may still tip a near tie one way on
    one rank and the other way on another. A rank whose selection raised makes every rank raise (RanksFailed)."""
    here, picks = ranks.decide(select, lambda blended: [(b.recomputed, b.ratio, b.floor_met) for b in blended])
    return [b if b.recomputed is r else replace(b, recomputed=r, ratio=ratio, floor_met=met)
            for b, (r, ratio, met) in zip(here, picks, strict=True)]


def _keep_features(store: ChunkStore, features: list[RequestFeatures]) -> None:
    """Per-chunk selector features reach every tier and the host budget."""
    added: dict[str, dict[str, torch.Tensor]] = {}
    for f in features:
        for key, feats in f.added_features().items():
            added.setdefault(key, {}).update(feats)
    for key, feats in added.items():
        store.add_features(key, feats)


def _budget(plan: RequestPlan, sel: Selector, features: RequestFeatures, cap: float,
            estimator: fidelity.Model | None) -> tuple[float, bool | None]:
    """(rho, whether the quality floor was met): the plan's ratio without a floor; with one, the smallest rho of the
    fidelity grid up to `cap` whose estimate meets it, else (and without an estimator) 1: every context token
    recomputed."""
    if plan.max_kl is None:
        return plan.ratio, None
    if estimator is None:
        return 1.0, False
    chosen = fidelity.smallest_ratio(fidelity.at_ratios(sel, features.layout, features), plan.max_kl, estimator,
                                     cap=cap)
    return (1.0, False) if chosen is None else (chosen, True)


def lookup(store: ChunkStore, plans: Sequence[RequestPlan], engine: Engine, compute: ComputeCost | None,
           prefetched: Iterable[Lookup] = (), ranks: Ranks = Ranks()) -> Lookup:
    """Each distinct chunk's entry, where the store has one that holds exactly its tokens (the batch's keys not
    `prefetched` in one store call: one remote round trip per server at most, for the chunks worth fetching).
    Agreed over `ranks`: a chunk is found only where every rank's store holds it (the others compute it and store
    their shard), with only the features every rank's entry has (which passes run, and which deviations are
    estimated, follow from them)."""
    chunks = {c.key: (plan, c) for plan in plans for c in plan.chunks}
    given: dict[str, ChunkEntry] = {}
    fetched: set[str] = set()
    for p in prefetched:
        given.update(p.entries)
        fetched |= p.fetched
    asked = {key: c for key, (_, c) in chunks.items() if key not in given}
    costs = None if compute is None else {
        key: (c.span[1] - c.span[0], compute.chunk_s(c.span[1] - c.span[0])) for key, c in asked.items()}

    def held() -> tuple[Lookup, list[ChunkEntry | None]]:
        looked = store.lookup(list(asked), costs) if asked else Lookup({}, frozenset(), frozenset())
        held = {**given, **looked.entries}
        return looked, [_holding(held.get(key), plan.chunk_ids(c), key, engine) for key, (plan, c) in chunks.items()]

    (looked, found), common = ranks.decide(
        held, lambda here: [None if e is None else (e.start_pos, frozenset(e.features)) for e in here[1]],
        _common_features)
    entries = {key: _with_features(entry, names) for key, entry, names in zip(chunks, found, common)
               if names is not None}
    return Lookup(entries, frozenset(k for k in fetched | looked.fetched if k in entries), looked.computed_instead)


def _common_features(parts: list[list[tuple[int, frozenset[str]] | None]]) -> list[frozenset[str] | None]:
    """Per chunk, the feature names every rank's entry has; None (a miss on every rank) where some rank has no entry
    or the ranks' entries were computed at other positions (a chunk's K is re-rotated from where it was computed, so
    the ranks' copies would move differently: a store drifted by a bug or a hand-copied directory)."""
    return [None if any(p is None for p in per_rank) or len({pos for pos, _ in per_rank}) > 1
            else frozenset.intersection(*(names for _, names in per_rank))
            for per_rank in zip(*parts, strict=True)]


def _position(entry: ChunkEntry | None) -> int | None:
    """Where a found entry's KV was computed (its start_pos); None: not found."""
    return None if entry is None else entry.start_pos


def _held_alike(parts: list[list[int | None]]) -> list[bool]:
    """Per segment, whether every rank holds it, computed at the same position."""
    return [all(p is not None for p in per_rank) and len(set(per_rank)) == 1
            for per_rank in zip(*parts, strict=True)]


def _with_features(entry: ChunkEntry, names: frozenset[str]) -> ChunkEntry:
    """`entry`, or a copy of it that has only the features `names` (what another rank's entry lacks is unknown here
    too); what a selector adds to the copy reaches the store through ChunkStore.add_features."""
    if names.issuperset(entry.features):
        return entry
    return replace(entry, features={k: v for k, v in entry.features.items() if k in names})


def _holding(entry: ChunkEntry | None, ids: torch.Tensor, key: str, engine: Engine) -> ChunkEntry | None:
    """`entry` if it holds these tokens' KV, else a miss: a value under the right key with other tokens or another
    shape (a value written by a server that holds the shared tier's secret, or another model's) must never be copied
    into a request. The chunk is then computed, and its put replaces the bad value in the local tiers (the shared
    tier writes only where no value is: each server that fetches it computes the chunk again). An entry of another model is refused
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


def store_entries(store: ChunkStore, entries: Iterable[ChunkEntry]) -> dict[str, float]:
    """Put `entries` into the store: what it kept (segments, tokens, bytes). One it kept no copy of is said in the
    log: every request that uses it computes it again. A write that fails with an OSError (a disk error) is that: the
    write involves no other rank and no forward reads it, so under tensor parallelism it stays this rank's alone."""
    kept = {"segments": 0, "tokens": 0, "bytes": 0}
    for entry in entries:
        try:
            stored = store.put(entry)
        except OSError:
            log.exception("chunkcache: storing chunk %s failed", entry.key)
            stored = False
        if stored:
            kept["segments"] += 1
            kept["tokens"] += entry.num_tokens
            kept["bytes"] += entry.nbytes
        else:
            log.warning("chunkcache: the chunk store kept no copy of chunk %s (%d bytes); every request that uses "
                        "it computes it again", entry.key, entry.nbytes)
    return kept


def to_encode(store: ChunkStore, auto: AutoChunks, request: ChunkRequest, token_ids: torch.Tensor,
              token_bytes: int | None = None, ranks: Ranks = Ranks()) -> list[Encode]:
    """One request's paragraphs to encode (`to_encode_many`)."""
    return to_encode_many(store, auto, [(request, token_ids)], token_bytes, ranks)[0]


def to_encode_many(store: ChunkStore, auto: AutoChunks, taught: Sequence[tuple[ChunkRequest, torch.Tensor]],
                   token_bytes: int | None = None, ranks: Ranks = Ranks()) -> list[list[Encode]]:
    """After a batch's prompt prefills: per (request, its prompt's token ids), the paragraphs it teaches
    (AutoChunks.to_encode), none when it may not teach (`request.learn`). Asked once per prompt: each request's
    segments are dropped. A segment counts as stored only where every rank's store holds it; with `token_bytes` (KV
    bytes per token), a store some rank has no room for a prompt's KV in is crowded. Both are agreed in one exchange
    for the batch, so every rank queues the same encodes (their forwards run together); a store that fails on any
    rank makes every rank raise RanksFailed there, before anything is queued."""
    segments = []
    for request, _ in taught:
        kept, request.segments = request.segments, None
        segments.append(kept if kept is not None and request.learn and kept.keys else None)
    keys = [k for kept in segments if kept is not None for k in kept.keys]
    if not keys:
        return [[] for _ in taught]
    held, room = ranks.agree(lambda: ([k in store for k in keys], store.room()), _held_and_room)
    out, at = [], 0
    for kept, (_, token_ids) in zip(segments, taught):
        if kept is None:
            out.append([])
            continue
        need = sum(e - s for s, e in kept.spans) * (token_bytes or 0)
        crowded = token_bytes is not None and room < need
        out.append(auto.to_encode(kept, token_ids, held[at: at + len(kept.keys)], crowded))
        at += len(kept.keys)
    return out


def _held_and_room(parts: list[tuple[list[bool], int]]) -> tuple[list[bool], int]:
    """What every rank's store holds, and the least room any has."""
    return all_hold([held for held, _ in parts]), min(room for _, room in parts)


def store_encode(store: ChunkStore, encode: Encode, kv: tuple[torch.Tensor, torch.Tensor], fingerprint: str,
                 seconds: float = 0.0) -> dict[str, float]:
    """One paragraph learned: its segments' entries stored from `kv`, K and V [layers, tokens, heads, dim] on the
    host of a forward of exactly `encode.token_ids` from position 0, one row, attending nothing else (`seconds`: what
    that forward took). What the store kept, and the seconds."""
    k, v = kv
    entries = [ChunkEntry(key=key, token_ids=encode.token_ids[s:e].clone(), k=k[:, s:e].clone(), v=v[:, s:e].clone(),
                          start_pos=s, model_fingerprint=fingerprint, tenant=encode.tenant, context=context)
               for (s, e), key, context in encode.entries]
    return {**store_entries(store, entries), "seconds": round(seconds, 6)}


def record(request: ChunkRequest, b: Blended, *, stages: dict[str, float] | None = None, blend_s: float = 0.0,
           select_s: float = 0.0, batch: dict[str, int] | None = None,
           prediction: Prediction | None = None) -> dict:
    """A blended round's report: chunk hits, reused and recomputed tokens, the radix match, the selector and its rho,
    the fidelity estimate (and the quality floor), the remote tier's part, seconds per stage (`stages`, the batch's;
    `detect` is the request's own) and `blend_s`/`select_s` (this request's share), the blend-or-full `prediction`
    when one was made, and the engine's `batch` (requests, forwards)."""
    plan = b.plan
    return round_report.to_json("blended", {
        **detection_fields(request),
        "chunk_hits": b.hits, "chunk_misses": len(plan.chunks) - b.hits, "reused_tokens": b.reused_tokens,
        "recomputed_tokens": len(b.recomputed), "attended_pairs": b.attended_pairs, "radix_tokens": plan.matched,
        "selector": plan.selector, "ratio": b.ratio, "select_s": round(select_s, 6), "blend_s": round(blend_s, 6),
        "stages_s": _stages(request, stages), "batch": dict(batch or NO_BATCH),
        "admitted_compute": request.charged, "feature_passes": list(b.passes),
        **(prediction.report() if prediction is not None else {}),
        **({"fidelity": {"fitted_for": None}} if b.uncalibrated else {} if b.estimate is None else {
            "fidelity": {"kl": round(b.estimate.kl, 6), "agree": round(b.estimate.agree, 4),
                         "fitted_for": b.estimate.fitted_for, "covers": b.estimate.covers}}),
        **_floor(b), "fetched": b.fetched, "computed_instead": b.computed_instead,
    })


def _floor(b: Blended) -> dict:
    """With a quality floor: the bound and, when no rho up to the cap met it, the fallback (every context token
    recomputed) and why."""
    if b.plan.max_kl is None:
        return {}
    floor = {"max_kl": b.plan.max_kl, "kl_over": b.plan.kl_over}
    if b.floor_met:
        return floor
    if b.uncalibrated:
        return {**floor, "fallback": "uncalibrated",
                "detail": UNCALIBRATED_FIRST if b.plan.kl_over == "first_token" else UNCALIBRATED}
    detail = (f"no rho up to select.max_kl_cap has an estimated KL of at most {b.plan.max_kl}"
              if b.estimate is not None else f"selector {b.plan.selector!r} gives no fidelity estimate (the estimator "
              f"reads mix's signals)") + ": every context token recomputed"
    return {**floor, "fallback": "quality_floor", "detail": detail}


def record_held(request: ChunkRequest, plan: RequestPlan, computed: int) -> dict:
    """A round whose chunks the radix tree held entirely: computed exactly, nothing blended."""
    return round_report.to_json("held", {
        **detection_fields(request), "chunk_hits": 0, "chunk_misses": 0, "reused_tokens": 0,
        "recomputed_tokens": computed, "attended_pairs": 0, "radix_tokens": plan.matched, "selector": plan.selector,
        "ratio": plan.ratio, "select_s": 0.0, "blend_s": 0.0, "stages_s": _stages(request, None),
        "batch": dict(NO_BATCH), "admitted_compute": request.charged, "feature_passes": [], "fetched": 0,
        "computed_instead": 0})


def _stages(request: ChunkRequest, stages: dict[str, float] | None) -> dict[str, float]:
    seconds = {**(stages or {}), "detect": request.detection.seconds if request.detection else 0.0}
    return {k: round(seconds.get(k, 0.0), 6) for k in STAGES}


def detection_fields(request: ChunkRequest) -> dict:
    """What automatic detection did for the request (segments looked up, seconds, exact prefix tokens carried), when
    it ran."""
    d = request.detection
    return {} if d is None else {"auto": True, "segments": d.looked_up, "detect_s": round(d.seconds, 6),
                                 **({"exact_carried": d.carried} if d.carried else {})}


def _stopwatch(seconds: dict[str, float]):
    @contextmanager
    def step(name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds[name] += time.perf_counter() - t0

    return step
