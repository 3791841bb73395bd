"""Automatic chunk detection in the scheduler (config `auto.enabled`; chunkcache.blend.auto has the contract).

  * `detect`, when a request without a chunk hint becomes a `Req` (request_hint.attach): its content-defined
    segments are cut and kept on its record; the radix tree's exact match is found in the request's own partition;
    chunkcache.blend.pipeline.detect turns the stored segments past it into an auto hint, and the request moves to
    the auto radix partition (its KV will be approximate), taking the exact match along (`carry_exact_prefix`).
    Too few stored tokens: the request stays a plain one, served exactly as stock.
  * `learn`, after every extend forward: for each request whose prompt prefill finished in it, its segments that
    this prefill computed and no tier holds (chunkcache.blend.pipeline.segments_to_learn); `store_learned`, once
    the forward's outputs are sent, reads their KV once out of the pool and stores it (store_segments; their K at
    the positions they had here: the entry's start_pos), so learning never delays a first token. A
    plain request's whole prompt is exact (its radix match is in the exact partition); a hinted or auto request's
    tokens past its radix match count as computed (chunk tokens hold their stored KV re-rotated, which the selector
    already corrected where it mattered).
A request with input logprobs over its prompt is never detected (the blend does not compute those tokens' logits);
one with output logprobs alone is.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from array import array

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from chunkcache.blend import pipeline
from chunkcache.blend.request import ChunkRequest
from chunkcache.blend.reuse import ChunkReuse

from . import metrics, report
from .cache import reuse_of
from ..forward.forward_pass import Pass, Runner, batch_rows, one_row

log = logging.getLogger(__name__)


def detect(reuse: ChunkReuse, tree_cache, req, request: ChunkRequest, input_logprobs: bool = False) -> None:
    """The request's auto hint (on `request`; none: served as stock, as is one that asked for `input_logprobs`); its
    segments are kept for learning."""
    t0 = time.perf_counter()
    ids = req.origin_input_ids
    request.segments = reuse.segments(ids, getattr(req, "cache_salt", None))
    if input_logprobs or not request.segments.spans:
        return
    matched = exact_prefix(tree_cache, req)
    found = pipeline.detect(reuse.store, reuse.auto, ids, request.segments, matched, reuse.defaults, reuse.compute,
                            reuse.ranks)
    request.detection = dataclasses.replace(found, seconds=time.perf_counter() - t0)  # segmenting and matching too
    request.hint = found.hint
    hits = len(found.hint.spans) if found.hint else 0
    metrics.record_auto_lookup(hits=hits, misses=found.looked_up - hits, seconds=request.detection.seconds)


def exact_prefix(tree_cache, req) -> int:
    """Tokens of the prompt the radix tree holds exactly in the request's (plain) partition."""
    return int(tree_cache.match_prefix(MatchPrefixParams(key=_key(req, req.extra_key))).device_prefix_len)


def carry_exact_prefix(tree_cache, req, plain_extra_key: str | None) -> int:
    """Give the auto partition (the request's extra_key now) the exact prefix the plain partition holds beyond its
    own match: those tokens' KV copied into new slots and inserted under the auto key, so SGLang's own match finds
    them instead of the blend's fill computing them again. Exact KV is right in every partition. A pool without free
    room for them makes it by evicting the tree's least recently used KV, as SGLang's own allocation does (in a
    server's steady state the pool is full of cached prefixes), both partitions' matched paths locked meanwhile. The
    inserted node is unlocked, SGLang's to evict like any other. Returns the tokens carried: 0 when the auto
    partition matches as far, the tree cannot free enough room, or it keeps more than full-attention KV
    (sliding-window or state components, whose slots this copy does not carry)."""
    if tree_cache.supports_swa() or tree_cache.supports_mamba():
        return 0
    plain = tree_cache.match_prefix(MatchPrefixParams(key=_key(req, plain_extra_key)))
    auto = tree_cache.match_prefix(MatchPrefixParams(key=_key(req, req.extra_key)))
    held, have = int(plain.device_prefix_len), int(auto.device_prefix_len)
    if held <= have:
        return 0
    allocator = tree_cache.token_to_kv_pool_allocator
    locks = [tree_cache.lock(plain.last_device_node), tree_cache.lock(auto.last_device_node)]
    try:
        if allocator.available_size() < held - have:
            tree_cache.evict(EvictParams(num_tokens=held - have - allocator.available_size()))
        source = tree_cache.path_device_indices(plain.last_device_node)[have:held]
        own = tree_cache.path_device_indices(auto.last_device_node)[:have]
        if len(source) != held - have or len(own) != have:  # a match not all on its tree path (loaded, unpublished)
            return 0
        if allocator.available_size() < held - have:
            return 0
        slots = allocator.alloc(held - have)
        try:
            _copy_kv(allocator.get_kvcache(), slots, source)  # the plain partition keeps its own
            value = torch.cat([own.to(torch.int64), slots.to(torch.int64)])
        except BaseException:
            allocator.free(slots)
            raise
        # the tree's own slots below `have` are not duplicates (prev_prefix_len); from there on it owns the new ones
        tree_cache.insert(InsertParams(key=_key(req, req.extra_key, held), value=value, prev_prefix_len=have))
    finally:
        for lock in locks:
            tree_cache.unlock(lock)
    return held - have


def _copy_kv(pool, dst: torch.Tensor, src: torch.Tensor) -> None:
    """K and V of slots `src` written to slots `dst`, every layer."""
    for layer in range(pool.layer_num):
        for buffer in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            buffer[dst] = buffer[src]


def _key(req, extra_key: str | None, n: int | None = None) -> RadixKey:
    ids = req.origin_input_ids if n is None else req.origin_input_ids[:n]
    return RadixKey(token_ids=array("q", ids), extra_key=extra_key, cache_salt=getattr(req, "cache_salt", None))


def learn(reuse: ChunkReuse, model_runner, forward_batch, reqs, record_of) -> None:
    """For every request whose prompt prefill finished in this forward (`record_of(req)`: its ChunkRequest), the new
    segments to store, said in its report; their KV is read out of the pool and stored once the forward's outputs
    are sent (`reuse.after_outputs`, run by `store_learned`), off the request's first token; at once when the
    scheduler overlaps (`defer_learning`)."""
    records = [record_of(r) for r in reqs]
    if not any(r is not None and r.segments is not None for r in records):
        return  # decode rows and prompts already learned: nothing to read
    pool = model_runner.token_to_kv_pool
    head_kv = None  # the batch's forward of a head form (ChunkReuse.queue_head_forms), made for its first one
    token_bytes = 2 * pool.layer_num * pool.get_key_buffer(0)[0].numel() * pool.get_key_buffer(0).element_size()
    for row in batch_rows(model_runner, forward_batch, reqs):
        request = records[row.index]
        if request is None or request.segments is None or row.seq_len != len(row.req.origin_input_ids) or row.decode:
            continue
        hinted = request.hint is not None and getattr(row.req, "to_finish", None) is None
        computed = torch.zeros(row.seq_len, dtype=torch.bool)
        computed[row.matched if hinted else 0:] = True
        segments = request.segments
        todo = pipeline.segments_to_learn(reuse.store, reuse.auto, request, computed, token_bytes)
        # a prompt nobody marked (served as stock or detected); a client's chunks, hinted or exact, need no head forms
        if request.exact is None and (request.hint is None or request.hint.auto):
            if forms := reuse.auto.head_forms(segments, row.token_ids):
                if head_kv is None:
                    head_kv = functools.partial(_head_kv, model_runner, copy.copy(forward_batch))
                reuse.queue_head_forms(forms, head_kv)
        tokens = sum(e - s for (s, e), _ in todo)
        learning = {"segments": len(todo), "tokens": tokens, "bytes": tokens * token_bytes}
        if todo:
            slots = row.slots[torch.cat([torch.arange(s, e) for (s, e), _ in todo]).to(row.slots.device)]
            work = functools.partial(_store, reuse, pool, todo, row.token_ids, slots)
            if reuse.after_outputs is None:
                work()
            else:
                reuse.after_outputs.append(work)
        if not hinted and request.exact is None:
            report.auto_stock(request, radix=row.matched, computed=row.seq_len - row.matched, learned=learning)
        else:
            request.add_learned(learning)


def defer_learning(result, scheduler, *args, **kwargs) -> None:
    """AFTER hook on Scheduler.init_chunked_prefill: a scheduler that runs a batch's forward, then sends its outputs
    (no overlap) lets `learn` store after them. An overlapping one launches the next forward first, whose learning
    would be read before its KV is computed: there, learning stays in the forward."""
    reuse = reuse_of(scheduler.tree_cache)
    if reuse is not None and not scheduler.enable_overlap:
        reuse.after_outputs = []


def store_learned(result, scheduler, *args, **kwargs) -> None:
    """AFTER hook on Scheduler.process_batch_result: store what the batch's prompts taught (`learn`), now that its
    outputs are sent. This runs before the scheduler allocates the pool again: a finished request's slots are free
    by now, and still hold its KV until then."""
    reuse = reuse_of(scheduler.tree_cache)
    while reuse is not None and reuse.after_outputs:
        work = reuse.after_outputs.pop(0)
        try:
            work()
        except Exception:  # noqa: BLE001 - learning is an optimisation: the requests' outputs are already sent
            log.exception("chunkcache: storing a prompt's learned segments failed; they are not stored")


def _store(reuse: ChunkReuse, pool, todo, token_ids: torch.Tensor, slots: torch.Tensor) -> None:
    learned = pipeline.store_segments(reuse.store, todo, token_ids, lambda _positions: _read_kv(pool, slots),
                                      reuse.fingerprint)
    metrics.record_auto_learned(learned["segments"], learned["bytes"], learned["seconds"])


def _head_kv(model_runner, forward_batch, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [layers, tokens, heads, dim] on the host of `token_ids` from position 0 through every layer, kept
    aside: nothing of the pool read or written (`forward_batch`, a copy of the batch that taught the store the
    passage, is only the template of a one-row batch: that batch is long gone when an idle turn runs this)."""
    runner = Runner(model_runner, one_row(forward_batch, len(token_ids)))
    p = Pass()
    seg = p.add_aside(token_ids, torch.arange(len(token_ids)), torch.zeros(0, dtype=torch.long, device=runner.device))
    with torch.no_grad():
        runner.run(p)
    return torch.stack([k for k, _ in seg.kept_kv]).cpu(), torch.stack([v for _, v in seg.kept_kv]).cpu()


def _read_kv(pool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `slots`, every layer, copied to host memory (the pool's slots are SGLang's to free)."""
    k = torch.stack([pool.get_key_buffer(layer)[slots] for layer in range(pool.layer_num)]).cpu()
    v = torch.stack([pool.get_value_buffer(layer)[slots] for layer in range(pool.layer_num)]).cpu()
    return k, v
