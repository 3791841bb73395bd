"""The blended prefill of one extend batch, run in place of SGLang's model forward when a request carries chunks.

`run` reads as the request's path, each step once for the whole batch:
  plan      which requests blend, their chunk-store entries (no side effects beyond store lookups);
  fill      one pass (split at the prefill budget): the part of each shared prefix the radix tree did not match,
            and every missing chunk computed standalone right after its shared prefix (kept aside);
  learn     the missing chunks go into the chunk store;
  copy      every chunk's stored KV into its request's slots, K re-rotated to its positions (one write per layer);
  features  one pass per feature the batch's selectors declared (ProphetKV: the query tokens against the reused KV,
            attention recorded; CacheBlend: the first layers over every reused token);
  select    per request, from those features;
  recompute one pass: the selected tokens of every blended request and every token of the plain requests (exact);
            its logits are the batch's output;
  report    each request's meta_info["chunkcache"].
Every pass is a forward of SGLang's own model with `SparseAttention` standing in for the attention backend.
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch

from chunkcache.align import decode_with_offsets
from chunkcache.hints import HintError
from chunkcache.rope import rerotate
from chunkcache.select import Layout
from chunkcache.select.base import needs
from chunkcache.store import ChunkEntry

from . import request_hint
from .request_hint import RequestHint
from .sparse_attention import Segment, SparseAttention

log = logging.getLogger(__name__)


@dataclass
class Work:
    """One request of the batch: where it sits and what the blend does for it."""

    req: object
    index: int  # position in the batch
    row: torch.Tensor  # [seq_len] KV slots of the request's tokens
    ids: torch.Tensor  # [seq_len] token ids
    exact: int  # tokens [0, exact) already hold exact KV (radix prefix)
    hint: RequestHint | None = None  # set when the request blends
    spans: list[tuple[int, int]] = field(default_factory=list)  # chunks blended here (minus any radix-matched head)
    offsets: list[int] = field(default_factory=list)  # where each blended span starts inside its stored chunk
    keys: list[str] = field(default_factory=list)  # chunk-store key of each blended span's chunk
    entries: list[ChunkEntry | None] = field(default_factory=list)
    hits: int = 0  # chunks found in the store before the fill
    features: dict = field(default_factory=dict)  # (Features method, args) -> value, computed at most once
    selected: torch.Tensor | None = None
    select_s: float = 0.0  # this request's own selection time (its share of batched feature passes excluded)

    @property
    def blended(self) -> bool:
        return bool(self.spans)

    @property
    def decode(self) -> bool:
        """A decode row of a mixed batch (--enable-mixed-chunk): one new token after the prompt."""
        return len(self.ids) - self.exact == 1 and len(self.ids) > len(self.req.origin_input_ids)

    @property
    def start(self) -> int:
        """First token the blend does not already have exact KV for after the fill."""
        return self.spans[0][0] if self.spans else self.exact

    @property
    def whole(self) -> list[tuple[int, int]]:
        """The stored chunks behind `spans` (a span may be the tail of its chunk)."""
        return [(s - off, e) for (s, e), off in zip(self.spans, self.offsets)]


def run(cache, model_runner, forward_batch, reqs):
    t0 = time.perf_counter()
    works = plan(cache, forward_batch, reqs)
    blended = [w for w in works if w.blended]
    if not blended:
        return None
    runner = Runner(model_runner, forward_batch, cache.prefill_budget)
    learn(cache, blended, fill(cache, runner, blended))
    t_fill = time.perf_counter()
    copy_chunks(cache, blended)
    t_copy = time.perf_counter()
    prefetch(cache, runner, blended)
    t_features = time.perf_counter()
    for w in blended:
        t = time.perf_counter()
        w.selected = _select(cache, runner, w)
        w.select_s = time.perf_counter() - t
    t_select = time.perf_counter()
    result = recompute(runner, works)
    t_end = time.perf_counter()
    stages = {"match_fill": t_fill - t0, "copy": t_copy - t_fill, "features": t_features - t_copy,
              "select": t_select - t_features, "prefill": t_end - t_select}
    decodes = sum(w.decode for w in works)
    batch = {"requests": len(blended), "plain": len(works) - len(blended) - decodes, "decodes": decodes,
             "forwards": runner.forwards}
    feature_s = stages["features"] / len(blended)  # a batched feature pass is shared evenly by its requests
    for w in blended:
        report(cache, w, recomputed=len(w.selected), select_s=feature_s + w.select_s, stages=stages, batch=batch,
               blend_s=t_end - t0 - stages["features"] - stages["select"])
    return result


def plan(cache, forward_batch, reqs) -> list[Work]:
    pool = cache.req_to_token_pool.req_to_token
    works = []
    for i, req in enumerate(reqs):
        seq_len = int(forward_batch.seq_lens_cpu[i])
        exact = int(forward_batch.extend_prefix_lens_cpu[i])
        row = pool[forward_batch.req_pool_indices[i], :seq_len].long()
        tokens = list(req.origin_input_ids) + list(req.output_ids)
        work = Work(req, i, row, torch.as_tensor(tokens[:seq_len], dtype=torch.long), exact)
        works.append(work)
        try:
            hint = request_hint.of(cache, req)
        except HintError as exc:  # validated at the HTTP layer; an Engine-side bypass still must not crash the batch
            cache.fallback(req, "bad_hint", str(exc))
            continue
        prefill = seq_len == len(req.origin_input_ids)
        if hint is None or work.decode:
            continue
        if not prefill:
            cache.fallback(req, "partial_prefill", f"tokens [{exact}, {seq_len}) of {len(req.origin_input_ids)} "
                           "(chunked prefill or a retracted request): this round is computed in full")
            continue
        if seq_len - exact == 1:  # the radix tree holds the whole prompt: nothing to blend, but say so
            work.hint = hint
            report(cache, work, recomputed=1, select_s=0.0, batch={"requests": 0, "plain": 0, "decodes": 0, "forwards": 0},
                   stages={"match_fill": 0.0, "copy": 0.0, "features": 0.0, "select": 0.0, "prefill": 0.0})
            continue
        work.hint = hint
        # a chunk the radix match reaches into keeps the tree's exact KV for its head; only its tail is blended
        kept = [(span, key) for span, key in zip(hint.spans, hint.keys) if span[1] > exact]
        work.spans = [(max(s, exact), e) for (s, e), _ in kept]
        work.offsets = [max(s, exact) - s for (s, _), _ in kept]
        work.keys = [key for _, key in kept]
        work.entries = [_holding(cache.store.get(key), work.ids[s:e], key) for (s, e), key in kept]
        work.hits = sum(e is not None for e in work.entries)
    return works


def _holding(entry: ChunkEntry | None, ids: torch.Tensor, key: str) -> ChunkEntry | None:
    """`entry` if it holds exactly these tokens, else a miss: a value under the right key with other tokens (a
    forged or foreign shared-tier value with a valid checksum) must never be copied into a request. The chunk is
    then computed, and its put replaces the bad value in every tier."""
    if entry is None or torch.equal(entry.token_ids.to(ids.device), ids):
        return entry
    log.warning("chunkcache: store entry %s holds %d other tokens than its chunk's %d; computing the chunk",
                key, entry.num_tokens, len(ids))
    return None


def report(cache, w: Work, recomputed: int, select_s: float, stages: dict, batch: dict, blend_s: float = 0.0) -> None:
    """The request's meta_info["chunkcache"] for this round (stage timings and `batch` are the whole batch's)."""
    reused = sum(e - s for s, e in w.spans) - (_in_spans(w.selected, w.spans) if w.spans else 0)
    cache.record(w.req, {
        "chunk_hits": w.hits, "chunk_misses": len(w.spans) - w.hits, "reused_tokens": reused,
        "recomputed_tokens": recomputed, "radix_tokens": w.exact, "selector": w.hint.selector, "ratio": w.hint.ratio,
        "select_s": round(select_s, 6), "blend_s": round(blend_s, 6),
        "stages_s": {k: round(v, 6) for k, v in stages.items()}, "batch": batch,
        "admitted_compute": w.req.__dict__.get(request_hint.COMPUTE),
    })


def _in_spans(sel: torch.Tensor, spans) -> int:
    return sum(int(((sel >= s) & (sel < e)).sum()) for s, e in spans)


def fill(cache, runner: "Runner", works: list[Work]) -> list[tuple[str, Work, int, Segment]]:
    """Unmatched shared-prefix tokens (exact, in place) and missing chunks (standalone, kept aside), packed into
    passes of at most the prefill budget. A request's prefix segment is added before its chunks, so it runs in the
    same or an earlier pass than the chunks that attend to it. Returns the standalone segments."""
    passes = [Pass()]

    def room(n: int) -> Pass:
        if passes[-1].n and runner.budget and passes[-1].n + n > runner.budget:
            passes.append(Pass())
        return passes[-1]

    for w in works:
        if w.exact < w.start:
            room(w.start - w.exact).add(w, torch.arange(w.exact, w.start), ctx=w.start)
    standalone, seen = [], set()
    for w in works:
        for j, ((s, e), key, entry) in enumerate(zip(w.whole, w.keys, w.entries)):
            if entry is None and key not in seen:
                seen.add(key)
                seg = room(e - s).add_aside(w.ids[s:e], torch.arange(w.hint.shared, w.hint.shared + e - s),
                                            w.row[: w.hint.shared])
                standalone.append((key, w, j, seg))
    for p in passes:
        if p.n:
            runner.run(p)
    return standalone


def learn(cache, works: list[Work], standalone) -> None:
    """Insert the chunks the fill computed into the store, and hand them to every request of the batch that has
    them (a chunk missing from several requests is computed once)."""
    computed = {}
    for key, w, j, seg in standalone:
        s, e = w.whole[j]
        entry = ChunkEntry(key=key, token_ids=w.ids[s:e].clone(), k=torch.stack([k for k, _ in seg.kept_kv]).cpu(),
                           v=torch.stack([v for _, v in seg.kept_kv]).cpu(), start_pos=w.hint.shared,
                           model_fingerprint=cache.fingerprint)
        if not cache.store.put(entry):
            log.warning("chunkcache: the chunk store kept no copy of chunk %s (%d bytes); every request that uses it "
                        "computes it again", key, entry.nbytes)
        computed[key] = entry
    for w in works:
        w.entries = [computed.get(key, entry) for key, entry in zip(w.keys, w.entries)]


def copy_chunks(cache, works: list[Work]) -> None:
    """Copy (never alias) every chunk's stored KV into its request's slots, K re-rotated to its new positions: the
    whole batch at once, one indexed write per layer and buffer."""
    pool = cache.token_to_kv_pool
    dtype = pool.get_key_buffer(0).dtype
    device = works[0].row.device
    parts = [(w.row[s:e], s - off, off, entry) for w in works
             for (s, e), off, entry in zip(w.spans, w.offsets, w.entries)]
    total = sum(len(slots) for slots, *_ in parts)
    first = parts[0][3]
    k = torch.empty(first.num_layers, total, first.num_kv_heads, first.head_dim, dtype=dtype, device=device)
    v = torch.empty_like(k)
    at = 0
    for slots, start, off, entry in parts:
        n = len(slots)
        # with the cached positions, re-rotation reproduces the model's own float32 angle rounding (chunkcache.rope)
        k[:, at: at + n] = rerotate(entry.k[:, off:].to(device), start - entry.start_pos, cache.rope,
                                    torch.arange(entry.start_pos + off, entry.start_pos + entry.num_tokens))
        v[:, at: at + n] = entry.v[:, off:]
        at += n
    slots = torch.cat([slots for slots, *_ in parts])
    for layer in range(k.shape[0]):
        pool.get_key_buffer(layer)[slots] = k[layer]
        pool.get_value_buffer(layer)[slots] = v[layer]


def prefetch(cache, runner: "Runner", works: list[Work]) -> None:
    """Compute, in one pass per feature, every feature the batch's selectors declare (Selector.needs)."""
    wanted: dict[tuple[str, tuple], list[Work]] = {}
    for w in works:
        for need in needs(cache.selector(w.hint.selector)):
            wanted.setdefault(need, []).append(w)
    for (name, args), ws in wanted.items():
        if name == "query_attention":
            for w, value in zip(ws, query_attention(runner, ws)):
                w.features[name, args] = value
        elif name == "kv_deviation":
            for w, value in zip(ws, kv_deviation(cache, runner, ws, *args)):
                w.features[name, args] = value


def query_attention(runner: "Runner", works: list[Work]) -> list[torch.Tensor]:
    """ProphetKV's score for each request: its query tokens through all layers against its reused KV, the attention
    to each token recorded (Features.query_attention)."""
    p = Pass()
    segments = []
    for w in works:
        seg = p.add(w, torch.arange(w.hint.query, len(w.ids)), ctx=len(w.ids))
        seg.attention_sum = torch.zeros(len(w.ids), dtype=torch.float32, device=w.row.device)
        segments.append(seg)
    runner.run(p)
    return [seg.attention_sum.cpu() for seg in segments]


def kv_deviation(cache, runner: "Runner", works: list[Work], layer: int, which: str) -> list[torch.Tensor]:
    """Each request's tokens after its exact prefix computed exactly through layers 0..`layer` only, their K/V kept
    aside (the pool keeps the reused KV) and compared with the reused K/V at `layer` (Features.kv_deviation)."""
    if which not in ("k", "v"):
        raise ValueError(f"which must be 'k' or 'v', got {which!r}")
    pool = cache.token_to_kv_pool
    if not 0 <= layer < pool.layer_num:
        raise ValueError(f"layer {layer} outside [0, {pool.layer_num})")
    p = Pass()
    segments = [p.add_aside(w.ids[w.start:], torch.arange(w.start, len(w.ids)), w.row[: w.start]) for w in works]
    runner.run(p, layers=layer + 1)
    buf = pool.get_key_buffer(layer) if which == "k" else pool.get_value_buffer(layer)
    out = []
    for w, seg in zip(works, segments):
        fresh = seg.kept_kv[layer][0 if which == "k" else 1]
        reused = buf[w.row[w.start:].to(buf.device)]
        dev = torch.zeros(len(w.ids))
        dev[w.start:] = (fresh.float() - reused.float()).flatten(1).norm(dim=1).cpu()
        out.append(dev * _layout(w).context_mask())
    return out


def recompute(runner: "Runner", works: list[Work]):
    """The selected tokens of every blended request and every extend token of the others, in batch order; each
    request's last prompt token comes last, so the logits are the batch's output."""
    p = Pass()
    for w in works:
        p.add(w, w.selected if w.blended else torch.arange(w.exact, len(w.ids)), ctx=len(w.ids))
    return runner.run(p, logits=True)


class _Features:
    """The Features protocol on the SGLang path: what the batch prefetched, else computed for this request alone."""

    def __init__(self, cache, runner: "Runner", w: Work):
        self.cache, self.runner, self.w = cache, runner, w

    def _memo(self, name: str, args: tuple, compute):
        if (name, args) not in self.w.features:
            self.w.features[name, args] = compute()
        return self.w.features[name, args]

    def query_attention(self) -> torch.Tensor:
        return self._memo("query_attention", (), lambda: query_attention(self.runner, [self.w])[0])

    def kv_deviation(self, layer: int, which: str) -> torch.Tensor:
        return self._memo("kv_deviation", (layer, which),
                          lambda: kv_deviation(self.cache, self.runner, [self.w], layer, which)[0])

    def prompt_text(self):
        return decode_with_offsets(self.cache.tokenizer, self.w.ids.tolist())

    def draft(self, model: str, layers: int | None):
        return self.cache.draft(model, layers)

    def chunk_features(self, index: int) -> dict[str, torch.Tensor]:
        return self.w.entries[index].features


def _layout(w: Work) -> Layout:
    return Layout(token_ids=w.ids, prefix_len=w.start, chunk_spans=tuple(w.spans), query_span=(w.hint.query, len(w.ids)))


def _select(cache, runner: "Runner", w: Work) -> torch.Tensor:
    entries = {e.key: e for e in w.entries}
    had = {key: set(e.features) for key, e in entries.items()}
    selection = cache.selector(w.hint.selector).select(_layout(w), w.hint.ratio, _Features(cache, runner, w))
    for key, e in entries.items():
        if e.features.keys() != had[key]:  # a selector kept per-chunk features in it: charge and persist them
            cache.store.add_features(key, {name: e.features[name] for name in e.features.keys() - had[key]})
    return selection.indices.cpu()


class Pass:
    """The tokens of one forward, as segments (see sparse_attention.Segment) with their ids, positions and pool
    slots; built first, then run once."""

    def __init__(self):
        self.segments: list[Segment] = []
        self.ids: list[torch.Tensor] = []
        self.pos: list[torch.Tensor] = []
        self.loc: list[torch.Tensor] = []
        self.counts: list[int] = []  # tokens per segment

    @property
    def n(self) -> int:
        return sum(self.counts)

    def add(self, w: Work, sel: torch.Tensor, ctx: int) -> Segment:
        """Tokens `sel` of request `w`, written to its slots, attending to its row [0, ctx)."""
        return self._append(Segment(slice(self.n, self.n + len(sel)), sel.to(w.row.device), w.row[:ctx]),
                            w.ids[sel], sel, w.row[sel])

    def add_aside(self, ids: torch.Tensor, q_pos: torch.Tensor, ctx_slots: torch.Tensor) -> Segment:
        """Tokens at positions `q_pos` attending to `ctx_slots` and to each other; their K/V are kept in the
        segment's kept_kv, never written to the pool."""
        seg = Segment(slice(self.n, self.n + len(ids)), q_pos.to(ctx_slots.device), ctx_slots, to_pool=False)
        return self._append(seg, ids, q_pos, torch.zeros(len(ids), dtype=torch.long))

    def _append(self, seg: Segment, ids, pos, loc) -> Segment:
        self.segments.append(seg)
        self.ids.append(ids)
        self.pos.append(pos.cpu())
        self.loc.append(loc)
        self.counts.append(len(ids))
        return seg


class Runner:
    """Runs passes as forwards of SGLang's model on a copy of the batch that states the pass's own tokens."""

    def __init__(self, model_runner, forward_batch, budget: int | None):
        self.model_runner, self.forward_batch = model_runner, forward_batch
        self.budget = budget  # tokens per fill forward (SGLang's chunked-prefill size); None: unbounded
        self.device = forward_batch.input_ids.device if forward_batch.input_ids is not None else model_runner.device
        self.forwards = 0

    def run(self, p: Pass, logits: bool = False, layers: int | None = None):
        """One forward over `p`. With `logits`, `p` holds one segment per request of the batch, each ending with
        that request's last prompt token, and the logits output is returned; otherwise only the KV side effects
        (pool writes, segment kept_kv and attention sums) matter. `layers` stops the forward after that many layers."""
        from sglang.srt.model_executor.forward_context import forward_context, get_forward_context, has_forward_context

        src = self.forward_batch
        device = self.device
        fb = copy.copy(src)
        fb.input_ids = torch.cat(p.ids).to(device)
        fb.positions = torch.cat(p.pos).to(device)
        fb.out_cache_loc = torch.cat(p.loc).to(device=device, dtype=src.out_cache_loc.dtype)
        n = fb.input_ids.numel()
        lens = p.counts if logits else [n]
        fb.extend_num_tokens = n
        fb.extend_seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        fb.extend_seq_lens_cpu = list(lens)
        fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
        # SGLang narrows q/k/v to the batch's real token count (graph_utils.padded_extend_real_tokens): a pass
        # states its own, or one with more tokens than the scheduled extend would be cut short
        fb.global_num_token_non_padded_cpu = n
        if src.global_num_token_non_padded is not None:
            fb.global_num_token_non_padded = torch.tensor(n, dtype=torch.int32, device=device)
        if src.num_token_non_padded is not None:
            fb.num_token_non_padded = torch.tensor(n, dtype=src.num_token_non_padded.dtype, device=device)
        if logits:
            fb.extend_prefix_lens = src.seq_lens - fb.extend_seq_lens
            fb.extend_prefix_lens_cpu = [int(s) - c for s, c in zip(src.seq_lens_cpu, lens)]
            fb.extend_logprob_start_lens_cpu = [c - 1 for c in lens] if src.extend_logprob_start_lens_cpu else None
        backend = SparseAttention(self.model_runner.attn_backend, p.segments, fb.out_cache_loc, device)
        if has_forward_context():
            ctx = replace(get_forward_context(), attn_backend=backend)
        else:
            from sglang.srt.model_executor.forward_context import ForwardContext

            ctx = ForwardContext(attn_backend=backend)
        model = self.model_runner.model
        self.forwards += 1
        with forward_context(ctx, forward_batch=fb), (_first_layers(model, layers) if layers else nullcontext()):
            if logits:
                return model.forward(fb.input_ids, fb.positions, fb)
            model.model(fb.input_ids, fb.positions, fb)
            return None


@contextmanager
def _first_layers(model, n: int):
    """Run only the first `n` decoder layers (SGLang's models loop over `model.model.start_layer..end_layer`)."""
    inner = model.model
    if not hasattr(inner, "end_layer"):
        raise NotImplementedError(f"{type(inner).__name__} has no end_layer: cannot stop its forward early")
    end = inner.end_layer
    inner.end_layer = min(end, inner.start_layer + n)
    try:
        yield
    finally:
        inner.end_layer = end
