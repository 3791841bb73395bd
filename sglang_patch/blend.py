"""The blended prefill of one extend batch, run in place of SGLang's model forward when a request carries chunks.

Passes, each one forward of SGLang's own model with `SparseAttention` standing in for the attention backend:
  1. fill:     the part of each shared prefix not matched by the radix tree, and every missing chunk computed
               standalone right after its shared prefix (its KV is kept aside and inserted into the chunk store);
  2. features: only if the selector asks (ProphetKV: the query tokens against the reused KV, attention recorded);
  3. blend:    after each chunk's stored KV is copied into the request's slots (K re-rotated to its positions),
               the selected tokens are recomputed through all layers; its logits are the batch's output.
Requests without chunks in the same batch are computed in full in pass 3 (exact).
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from chunkcache.align import decode_with_offsets
from chunkcache.hashing import chunk_key, prefix_key
from chunkcache.hints import HintError, find_payload, parse
from chunkcache.rope import rerotate
from chunkcache.select import Layout
from chunkcache.store import ChunkEntry

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
    spans: list[tuple[int, int]] = field(default_factory=list)  # chunks blended in this request
    shared: int = 0  # the shared prefix is ids[:shared]
    keys: list[str] = field(default_factory=list)
    entries: list[ChunkEntry | None] = field(default_factory=list)
    selector: str = ""
    ratio: float = 0.0
    selected: torch.Tensor | None = None
    hits: int = 0  # chunks found in the store before pass 1
    offsets: list[int] = field(default_factory=list)  # where each blended span starts inside its stored chunk

    @property
    def blended(self) -> bool:
        return bool(self.spans)

    @property
    def start(self) -> int:
        """First token the blend does not already have exact KV for after pass 1."""
        return self.spans[0][0] if self.spans else self.exact


def plan(cache, forward_batch, reqs) -> list[Work]:
    pool = cache.req_to_token_pool.req_to_token
    works = []
    for i, req in enumerate(reqs):
        seq_len = int(forward_batch.seq_lens_cpu[i])
        exact = int(forward_batch.extend_prefix_lens_cpu[i])
        row = pool[forward_batch.req_pool_indices[i], :seq_len].long()
        tokens = list(req.origin_input_ids) + list(req.output_ids)
        ids = torch.as_tensor(tokens[:seq_len], dtype=torch.long)
        work = Work(req, i, row, ids, exact)
        works.append(work)
        payload = find_payload(getattr(req, "kv_hints", None))
        prefill = seq_len == len(req.origin_input_ids)
        if payload is None or (seq_len - exact == 1 and not prefill):  # no chunks, or a decode step in a mixed batch
            continue
        if not prefill:
            cache.fallback(req, "partial_prefill", "chunked prefill or a retracted request: this round is computed in full")
            continue
        try:
            hint = parse(payload, seq_len)
        except HintError as exc:  # validated at the HTTP layer; an Engine-side bypass still must not crash the batch
            cache.fallback(req, "bad_hint", str(exc))
            continue
        if seq_len - exact == 1:  # the radix tree holds the whole prompt: nothing to blend, but say so
            report(cache, work, hint.selector or cache.config.select.selector,
                   cache.config.select.ratio if hint.ratio is None else hint.ratio, recomputed=1, select_s=0.0,
                   stages={"match_fill": 0.0, "copy": 0.0, "select": 0.0, "prefill": 0.0})
            continue
        work.shared = hint.token_spans[0][0]
        # a chunk the radix match reaches into keeps the tree's exact KV for its head; only its tail is blended
        work.spans = [(max(s, exact), e) for s, e in hint.token_spans if e > exact]
        whole = [(s, e) for s, e in hint.token_spans if e > exact]
        work.selector = hint.selector or cache.config.select.selector
        work.ratio = cache.config.select.ratio if hint.ratio is None else hint.ratio
        namespace = hint.namespace or cache.config.store.namespace
        prefix = prefix_key(ids[: work.shared].tolist())
        work.keys = [chunk_key(cache.fingerprint, namespace, prefix, ids[s:e].tolist()) for s, e in whole]
        work.offsets = [b - s for (s, _), (b, _) in zip(whole, work.spans)]
        work.entries = [cache.store.get(k) for k in work.keys]
        work.hits = sum(e is not None for e in work.entries)
    return works


def run(cache, model_runner, forward_batch, reqs):
    t0 = time.perf_counter()
    works = plan(cache, forward_batch, reqs)
    if not any(w.blended for w in works):
        return None
    device = forward_batch.input_ids.device
    _fill(cache, model_runner, forward_batch, works, device)
    t_fill = time.perf_counter()
    for w in works:
        if w.blended:
            _copy_chunks(cache, w)
    t_copy = time.perf_counter()
    select_s = {}
    for w in works:
        if w.blended:
            t = time.perf_counter()
            w.selected = _select(cache, model_runner, forward_batch, w, device)
            select_s[w.index] = time.perf_counter() - t
    t_select = time.perf_counter()
    segments, ids, pos, loc, counts = [], [], [], [], []
    for w in works:
        sel = w.selected if w.blended else torch.arange(w.exact, len(w.ids))
        _add(segments, ids, pos, loc, w, sel, ctx=len(w.ids))
        counts.append(len(sel))
    result = _forward(model_runner, forward_batch, segments, ids, pos, loc, device, counts=counts)
    t_end = time.perf_counter()
    stages = {"match_fill": t_fill - t0, "copy": t_copy - t_fill, "select": t_select - t_copy, "prefill": t_end - t_select}
    for w in works:
        if w.blended:
            report(cache, w, w.selector, w.ratio, recomputed=len(w.selected), select_s=select_s[w.index],
                   stages=stages, blend_s=t_end - t0 - sum(select_s.values()))
    return result


def report(cache, w: Work, selector: str, ratio: float, recomputed: int, select_s: float, stages: dict,
           blend_s: float = 0.0) -> None:
    """The request's meta_info["chunkcache"] (stage timings are the whole batch's)."""
    reused = sum(e - s for s, e in w.spans) - (_in_spans(w.selected, w.spans) if w.spans else 0)
    w.req.chunkcache_info = {
        "chunk_hits": w.hits, "chunk_misses": len(w.spans) - w.hits, "reused_tokens": reused,
        "recomputed_tokens": recomputed, "radix_tokens": w.exact, "selector": selector, "ratio": ratio,
        "select_s": round(select_s, 6), "blend_s": round(blend_s, 6),
        "stages_s": {k: round(v, 6) for k, v in stages.items()},
    }
    cache.record(w.req, w.req.chunkcache_info)


def _in_spans(sel: torch.Tensor, spans) -> int:
    return sum(int(((sel >= s) & (sel < e)).sum()) for s, e in spans)


def _fill(cache, model_runner, forward_batch, works, device):
    """Pass 1: unmatched shared-prefix tokens (exact, in place) and missing chunks (standalone, kept aside)."""
    segments, ids, pos, loc = [], [], [], []
    missing: dict[str, tuple[Work, int]] = {}
    for w in works:
        if not w.blended:
            continue
        if w.exact < w.start:
            _add(segments, ids, pos, loc, w, torch.arange(w.exact, w.start), ctx=w.start)
        for j, (key, entry) in enumerate(zip(w.keys, w.entries)):
            if entry is None and key not in missing:
                missing[key] = (w, j)
    standalone = []
    for key, (w, j) in missing.items():
        s, e = w.spans[j][0] - w.offsets[j], w.spans[j][1]
        n = sum(len(x) for x in ids)
        seg = Segment(slice(n, n + e - s), torch.arange(w.shared, w.shared + e - s, device=device),
                      w.row[: w.shared].to(device), write=False)
        segments.append(seg)
        ids.append(w.ids[s:e])
        pos.append(seg.q_pos.cpu())
        loc.append(torch.zeros(e - s, dtype=torch.long))  # never written: standalone KV stays in seg.scratch
        standalone.append((key, w, j, seg))
    if segments:
        _forward(model_runner, forward_batch, segments, ids, pos, loc, device)
    for key, w, j, seg in standalone:
        s, e = w.spans[j][0] - w.offsets[j], w.spans[j][1]
        entry = ChunkEntry(key=key, token_ids=w.ids[s:e].clone(),
                           k=torch.stack([k for k, _ in seg.scratch]).cpu(), v=torch.stack([v for _, v in seg.scratch]).cpu(),
                           start_pos=w.shared, model_fingerprint=cache.fingerprint)
        cache.store.put(entry)
        for other in works:
            other.entries = [entry if k == key else en for k, en in zip(other.keys, other.entries)]


def _copy_chunks(cache, w: Work):
    """Copy (never alias) each chunk's stored KV into the request's slots, K re-rotated to its new positions."""
    pool = cache.token_to_kv_pool
    device, dtype = w.row.device, pool.get_key_buffer(0).dtype
    # all chunks of the request at once: one indexed write per layer and buffer
    slots = torch.cat([w.row[s:e] for s, e in w.spans])
    # with the cached positions, re-rotation reproduces the model's own float32 angle rounding (see chunkcache.rope)
    k = torch.cat([rerotate(entry.k[:, off:].to(device), s - off - entry.start_pos, cache.rope,
                            torch.arange(entry.start_pos + off, entry.start_pos + entry.num_tokens)).to(dtype)
                   for (s, _), off, entry in zip(w.spans, w.offsets, w.entries)], dim=1)
    v = torch.cat([entry.v[:, off:].to(device=device, dtype=dtype) for off, entry in zip(w.offsets, w.entries)], dim=1)
    for layer in range(k.shape[0]):
        pool.get_key_buffer(layer)[slots] = k[layer]
        pool.get_value_buffer(layer)[slots] = v[layer]


class _Features:
    """The Features protocol on the SGLang path (what selectors may ask of the running request)."""

    def __init__(self, cache, model_runner, forward_batch, w: Work, device):
        self.cache, self.model_runner, self.forward_batch, self.w, self.device = cache, model_runner, forward_batch, w, device

    def query_attention(self) -> torch.Tensor:
        w = self.w
        q = torch.arange(w.spans[-1][1], len(w.ids))
        segments, ids, pos, loc = [], [], [], []
        _add(segments, ids, pos, loc, w, q, ctx=len(w.ids))
        segments[0].record = torch.zeros(len(w.ids), dtype=torch.float32, device=self.device)
        _forward(self.model_runner, self.forward_batch, segments, ids, pos, loc, self.device)
        return segments[0].record.cpu()

    def kv_deviation(self, layer: int, which: str) -> torch.Tensor:
        """Every token after the exact prefix computed exactly through layers 0..`layer` only, its K/V kept aside
        (the pool keeps the reused KV) and compared with the reused K/V at `layer`."""
        if which not in ("k", "v"):
            raise ValueError(f"which must be 'k' or 'v', got {which!r}")
        w, pool = self.w, self.cache.token_to_kv_pool
        if not 0 <= layer < pool.layer_num:
            raise ValueError(f"layer {layer} outside [0, {pool.layer_num})")
        tokens = torch.arange(w.start, len(w.ids))
        seg = Segment(slice(0, len(tokens)), tokens.to(self.device), w.row[: w.start].to(self.device), write=False)
        loc = torch.zeros(len(tokens), dtype=torch.long)  # never written
        with _first_layers(self.model_runner.model, layer + 1):
            _forward(self.model_runner, self.forward_batch, [seg], [w.ids[tokens]], [tokens], [loc], self.device)
        fresh = seg.scratch[layer][0 if which == "k" else 1]
        buf = pool.get_key_buffer(layer) if which == "k" else pool.get_value_buffer(layer)
        reused = buf[w.row[w.start:].to(buf.device)]
        dev = torch.zeros(len(w.ids))
        dev[w.start:] = (fresh.float() - reused.float()).flatten(1).norm(dim=1).cpu()
        return dev * _layout(w).context_mask()

    def prompt_text(self):
        return decode_with_offsets(self.cache.tokenizer, self.w.ids.tolist())

    def draft(self, model: str, layers: int | None):
        return self.cache.draft(model, layers)

    def chunk_features(self, index: int) -> dict[str, torch.Tensor]:
        return self.w.entries[index].features


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


def _layout(w: Work) -> Layout:
    return Layout(token_ids=w.ids, prefix_len=w.start, chunk_spans=tuple(w.spans), query_span=(w.spans[-1][1], len(w.ids)))


def _select(cache, model_runner, forward_batch, w: Work, device) -> torch.Tensor:
    layout = _layout(w)
    selection = cache.selector(w.selector).select(layout, w.ratio, _Features(cache, model_runner, forward_batch, w, device))
    return selection.indices.cpu()


def _add(segments, ids, pos, loc, w: Work, sel: torch.Tensor, ctx: int):
    """Append a pool-writing segment: tokens `sel` of request `w`, attending to its row [0, ctx)."""
    n = sum(len(x) for x in ids)
    device = w.row.device
    segments.append(Segment(slice(n, n + len(sel)), sel.to(device), w.row[:ctx]))
    ids.append(w.ids[sel])
    pos.append(sel)
    loc.append(w.row[sel])


def _forward(model_runner, forward_batch, segments, ids, pos, loc, device, counts=None):
    """One forward of SGLang's model over the given tokens. With `counts` (tokens per request, each request's last
    prompt token last) it returns the logits output; otherwise only the KV side effects matter."""
    from sglang.srt.model_executor.forward_context import forward_context, get_forward_context

    fb = copy.copy(forward_batch)
    fb.input_ids = torch.cat(ids).to(device)
    fb.positions = torch.cat(pos).to(device)
    fb.out_cache_loc = torch.cat(loc).to(device=device, dtype=forward_batch.out_cache_loc.dtype)
    n = fb.input_ids.numel()
    lens = counts if counts is not None else [n]
    fb.extend_num_tokens = n
    fb.extend_seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    fb.extend_seq_lens_cpu = list(lens)
    fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
    if counts is not None:
        fb.extend_prefix_lens = forward_batch.seq_lens - fb.extend_seq_lens
        fb.extend_prefix_lens_cpu = [int(s) - c for s, c in zip(forward_batch.seq_lens_cpu, counts)]
        fb.extend_logprob_start_lens_cpu = [c - 1 for c in counts] if forward_batch.extend_logprob_start_lens_cpu else None
    backend = SparseAttention(model_runner.attn_backend, segments)
    ctx = replace(get_forward_context(), attn_backend=backend) if _has_ctx() else None
    model = model_runner.model
    with forward_context(ctx or _new_ctx(backend), forward_batch=fb):
        if counts is None:
            model.model(fb.input_ids, fb.positions, fb)
            return None
        return model.forward(fb.input_ids, fb.positions, fb)


def _has_ctx() -> bool:
    from sglang.srt.model_executor.forward_context import has_forward_context

    return has_forward_context()


def _new_ctx(backend):
    from sglang.srt.model_executor.forward_context import ForwardContext

    return ForwardContext(attn_backend=backend)
