"""Automatic chunk detection in the scheduler (config `auto.enabled`; chunkcache.blend.auto has the contract).

  * `detect`, when a request without a chunk hint becomes a `Req` (request_hint.attach): its content-defined
    segments are cut and kept on its record; the radix tree's exact match is found in the request's own partition;
    chunkcache.blend.pipeline.detect turns the stored segments past it into an auto hint, and the request moves to
    the auto radix partition (its KV will be approximate), taking the exact match along (`carry_exact_prefix`).
    Too few stored tokens: the request stays a plain one, served exactly as stock.
  * `learn`, after every extend forward: for each request whose prompt prefill finished in it and that may teach
    (request_hint.teaches), the paragraphs holding segments no tier holds (chunkcache.blend.pipeline.to_encode_many)
    are queued as idle jobs (ChunkServer.teach) with the forward that computes them (an Aside: the canonical head and
    the paragraph, one row from position 0, nothing of the pool read or written). Nothing of a request's own KV is
    ever stored: what it attended to is not what a segment's key names (chunkcache.store.entry). The server's idle
    turns encode them one at a time, and a server never idle one after a batch's outputs once the oldest has waited
    auto.encode_starved_s (sglang_patch.scheduler.server).
A request with input logprobs over its prompt is never detected (the blend does not compute those tokens' logits);
one with output logprobs alone is.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from array import array
from collections.abc import Callable

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from chunkcache.blend import pipeline
from chunkcache.blend.request import ChunkRequest
from chunkcache.ranks import Ranks
from chunkcache.blend.reuse import ChunkReuse

from . import metrics, report
from ..forward.forward_pass import batch_rows

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


def carry_exact_prefix(tree_cache, req, plain_extra_key: str | None, ranks: Ranks = Ranks()) -> int:
    """Give the auto partition (the request's extra_key now) the exact prefix the plain partition holds beyond its
    own match: those tokens' KV copied into new slots and inserted under the auto key, so SGLang's own match finds
    them instead of the blend's fill computing them again. Exact KV is right in every partition. A pool without free
    room for them makes it by evicting the tree's least recently used KV, as SGLang's own allocation does (in a
    server's steady state the pool is full of cached prefixes), both partitions' matched paths locked meanwhile. The
    inserted node is unlocked, SGLang's to evict like any other. Returns the tokens carried: 0 when the auto
    partition matches as far, the tree cannot free enough room, or it keeps more than full-attention KV
    (sliding-window or state components, whose slots this copy does not carry).
    Under tensor parallelism every rank's tree must stay the same: the copy is inserted only where every rank made it
    (`ranks` agree before the insert); otherwise each rank frees its copy and carries nothing, and a rank whose copy
    raised raises it after the agreement."""
    if tree_cache.supports_swa() or tree_cache.supports_mamba():
        return 0
    allocator, locks = tree_cache.token_to_kv_pool_allocator, []

    def copy() -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """(new slots, the auto path's slots with them, tokens the auto partition had, tokens to hold)."""
        plain = tree_cache.match_prefix(MatchPrefixParams(key=_key(req, plain_extra_key)))
        auto = tree_cache.match_prefix(MatchPrefixParams(key=_key(req, req.extra_key)))
        held, have = int(plain.device_prefix_len), int(auto.device_prefix_len)
        if held <= have:
            return None
        locks.extend([tree_cache.lock(plain.last_device_node), tree_cache.lock(auto.last_device_node)])
        if allocator.available_size() < held - have:
            tree_cache.evict(EvictParams(num_tokens=held - have - allocator.available_size()))
        source = tree_cache.path_device_indices(plain.last_device_node)[have:held]
        own = tree_cache.path_device_indices(auto.last_device_node)[:have]
        if len(source) != held - have or len(own) != have:  # a match not all on its tree path (loaded, unpublished)
            return None
        if allocator.available_size() < held - have:
            return None
        slots = allocator.alloc(held - have)
        try:
            _copy_kv(allocator.get_kvcache(), slots, source)  # the plain partition keeps its own
            return slots, torch.cat([own.to(torch.int64), slots.to(torch.int64)]), have, held
        except BaseException:
            allocator.free(slots)
            raise

    def attempt():
        try:
            return copy(), None
        except Exception as exc:  # noqa: BLE001 - raised after every rank knows
            return None, exc

    try:
        (made, error), everywhere = ranks.decide(attempt, lambda mine: mine[0] is not None, all)
        if not everywhere:
            if made is not None:
                allocator.free(made[0])
            if error is not None:
                raise error
            return 0
        _, value, have, held = made
        # the tree's own slots below `have` are not duplicates (prev_prefix_len); from there on it owns the new ones
        tree_cache.insert(InsertParams(key=_key(req, req.extra_key, held), value=value, prev_prefix_len=have))
        return held - have
    finally:
        for lock in locks:
            tree_cache.unlock(lock)


def _copy_kv(pool, dst: torch.Tensor, src: torch.Tensor) -> None:
    """K and V of slots `src` written to slots `dst`, every layer."""
    for layer in range(pool.layer_num):
        for buffer in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            buffer[dst] = buffer[src]


def _key(req, extra_key: str | None, n: int | None = None) -> RadixKey:
    ids = req.origin_input_ids if n is None else req.origin_input_ids[:n]
    return RadixKey(token_ids=array("q", ids), extra_key=extra_key, cache_salt=getattr(req, "cache_salt", None))


def learn(reuse: ChunkReuse, teach: Callable, model_runner, forward_batch, reqs, record_of) -> None:
    """For every request whose prompt prefill finished in this forward (`record_of(req)`: its ChunkRequest), the
    paragraphs it teaches (agreed over the ranks, for the whole batch at once), handed to `teach` (ChunkServer.teach:
    queued as idle jobs) with this batch's model runner and forward batch, and said in its report."""
    records = [record_of(r) for r in reqs]
    if not any(r is not None and r.segments is not None for r in records):
        return  # decode rows and prompts already learned: nothing to do
    pool = model_runner.token_to_kv_pool
    token_bytes = 2 * pool.layer_num * pool.get_key_buffer(0)[0].numel() * pool.get_key_buffer(0).element_size()
    rows = [row for row in batch_rows(model_runner, forward_batch, reqs)
            if (request := records[row.index]) is not None and request.segments is not None
            and row.seq_len == len(row.req.origin_input_ids) and not row.decode]
    taught = pipeline.to_encode_many(reuse.store, reuse.auto, [(records[row.index], row.token_ids) for row in rows],
                                     token_bytes, reuse.ranks)
    if any(taught):
        teach([encode for encodes in taught for encode in encodes], model_runner, forward_batch)
    for row, encodes in zip(rows, taught):
        request = records[row.index]
        hinted = request.hint is not None and getattr(row.req, "to_finish", None) is None
        tokens = sum(e - s for encode in encodes for (s, e), _, _ in encode.entries)
        learning = {"segments": sum(len(encode.entries) for encode in encodes), "tokens": tokens,
                    "bytes": tokens * token_bytes}
        if not hinted and request.exact is None:
            report.auto_stock(request, radix=row.matched, computed=row.seq_len - row.matched, learned=learning)
        else:
            request.add_learned(learning)
