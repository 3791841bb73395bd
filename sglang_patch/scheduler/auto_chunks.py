"""Automatic chunk detection in the scheduler (config `auto.enabled`; chunkcache.blend.auto has the contract).

  * `detect`, when a request without a chunk hint becomes a `Req` (request_hint.attach): its content-defined
    segments are cut and kept on its record; the radix tree's exact match is found in the request's own partition;
    chunkcache.blend.pipeline.detect turns the stored segments past it into an auto hint, and the request moves to
    the auto radix partition (its KV will be approximate), taking the exact match along (`carry_exact_prefix`).
    Too few stored tokens: the request stays a plain one, served exactly as stock.
  * `learn`, after every extend forward: for each request whose prompt prefill finished in it and that may teach
    (request_hint.teaches), the paragraphs holding segments no tier holds (chunkcache.blend.pipeline.to_encode) are
    queued with the forward that computes them (`_alone_kv`: the canonical head and the paragraph, one row from
    position 0, nothing of the pool read or written). Nothing of a request's own KV is ever stored: what it attended
    to is not what a segment's key names (chunkcache.store.entry). The plugin's idle hook encodes them one at a time;
    `encode_when_starved`, after a batch's outputs are sent, encodes one when the oldest has waited
    auto.encode_starved_s (a server that is never idle still learns).
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


def detect(reuse: ChunkReuse, tree_cache, req, request: ChunkRequest, payload: dict | None = None,
           input_logprobs: bool = False) -> None:
    """The request's auto hint (on `request`; none: served as stock, as is one that asked for `input_logprobs`), in
    its tenant and with its options (`payload`: a chunkcache payload without spans, or None); its segments are kept
    for learning."""
    t0 = time.perf_counter()
    ids = req.origin_input_ids
    defaults = reuse.defaults(payload)
    request.segments = reuse.segments(ids, defaults.namespace, getattr(req, "cache_salt", None))
    if input_logprobs or not request.segments.spans:
        return
    matched = exact_prefix(tree_cache, req)
    found = pipeline.detect(reuse.store, reuse.auto, ids, request.segments, matched, defaults, reuse.compute,
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
    """For every request whose prompt prefill finished in this forward (`record_of(req)`: its ChunkRequest), the
    paragraphs it teaches, queued for the idle (or starved) turns that encode them, and said in its report."""
    records = [record_of(r) for r in reqs]
    if not any(r is not None and r.segments is not None for r in records):
        return  # decode rows and prompts already learned: nothing to do
    pool = model_runner.token_to_kv_pool
    token_bytes = 2 * pool.layer_num * pool.get_key_buffer(0)[0].numel() * pool.get_key_buffer(0).element_size()
    kv_of = None  # the forward that encodes a paragraph, made for the batch's first one
    for row in batch_rows(model_runner, forward_batch, reqs):
        request = records[row.index]
        if request is None or request.segments is None or row.seq_len != len(row.req.origin_input_ids) or row.decode:
            continue
        hinted = request.hint is not None and getattr(row.req, "to_finish", None) is None
        encodes = pipeline.to_encode(reuse.store, reuse.auto, request, row.token_ids, token_bytes, reuse.ranks)
        if encodes:
            if kv_of is None:
                kv_of = functools.partial(_alone_kv, model_runner, copy.copy(forward_batch))
            reuse.queue_encodes(encodes, kv_of)
        tokens = sum(e - s for encode in encodes for (s, e), _, _ in encode.entries)
        learning = {"segments": sum(len(encode.entries) for encode in encodes), "tokens": tokens,
                    "bytes": tokens * token_bytes}
        if not hinted and request.exact is None:
            report.auto_stock(request, radix=row.matched, computed=row.seq_len - row.matched, learned=learning)
        else:
            request.add_learned(learning)


def encode_when_starved(result, scheduler, *args, **kwargs) -> None:
    """AFTER hook on Scheduler.process_batch_result: a server that is never idle encodes one waiting paragraph once
    the oldest has waited auto.encode_starved_s (ChunkReuse.starved), now that the batch's outputs are sent: the
    next batch waits one paragraph's forward."""
    reuse = reuse_of(scheduler.tree_cache)
    if reuse is not None and reuse.encodes and reuse.starved():
        if learned := reuse.encode_next():
            metrics.record_auto_learned(learned["segments"], learned["bytes"], learned["seconds"])


def _alone_kv(model_runner, forward_batch, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [layers, tokens, heads, dim] on the host of `token_ids` from position 0 through every layer, one row
    kept aside: nothing of the pool read or written (`forward_batch`, a copy of the batch that taught the store the
    paragraph, is only the template of a one-row batch: that batch is long gone when this runs)."""
    runner = Runner(model_runner, one_row(forward_batch, len(token_ids)))
    p = Pass()
    seg = p.add_aside(token_ids, torch.arange(len(token_ids)), torch.zeros(0, dtype=torch.long, device=runner.device))
    with torch.no_grad():
        runner.run(p)
    return torch.stack([k for k, _ in seg.kept_kv]).cpu(), torch.stack([v for _, v in seg.kept_kv]).cpu()
