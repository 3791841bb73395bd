"""Automatic chunk detection in the scheduler (config `auto.enabled`; chunkcache.blend.auto has the contract).

  * `detect`, when a request without a chunk hint becomes a `Req` (request_hint.attach): its content-defined
    segments are cut and kept on its record; the radix tree's exact match is found in the request's own partition;
    chunkcache.blend.pipeline.detect turns the stored segments past it into an auto hint, and the request moves to
    the auto radix partition (its KV will be approximate). Too few stored tokens: the request stays a plain one,
    served exactly as stock.
  * `learn`, after every extend forward: for each request whose prompt prefill finished in it, the KV of its
    segments that this prefill computed and no tier holds is read once out of the pool and stored
    (chunkcache.blend.pipeline.learn_segments; their K at the positions they had here: the entry's start_pos). A
    plain request's whole prompt is exact (its radix match is in the exact partition); a hinted or auto request's
    tokens past its radix match count as computed (chunk tokens hold their stored KV re-rotated, which the selector
    already corrected where it mattered).
A request with input logprobs is never detected (the blend cannot give every prompt token's logits).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from array import array

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from chunkcache.blend import pipeline
from chunkcache.blend.request import ChunkRequest
from chunkcache.blend.reuse import ChunkReuse

from . import metrics, report
from ..forward.forward_pass import batch_rows

log = logging.getLogger(__name__)


def detect(reuse: ChunkReuse, tree_cache, req, request: ChunkRequest) -> None:
    """The request's auto hint (on `request`; none: served as stock); its segments are kept for learning."""
    t0 = time.perf_counter()
    ids = req.origin_input_ids
    request.segments = reuse.segments(ids, getattr(req, "cache_salt", None))
    if getattr(req, "return_logprob", False) or not request.segments.spans:
        return
    matched = exact_prefix(tree_cache, req)
    found = pipeline.detect(reuse.store, reuse.auto, ids, request.segments, matched, reuse.defaults, reuse.compute)
    request.detection = dataclasses.replace(found, seconds=time.perf_counter() - t0)  # segmenting and matching too
    request.hint = found.hint
    hits = len(found.hint.spans) if found.hint else 0
    metrics.record_auto_lookup(hits=hits, misses=found.looked_up - hits, seconds=request.detection.seconds)


def exact_prefix(tree_cache, req) -> int:
    """Tokens of the prompt the radix tree holds exactly in the request's (plain) partition."""
    key = RadixKey(token_ids=array("q", req.origin_input_ids), extra_key=req.extra_key,
                   cache_salt=getattr(req, "cache_salt", None))
    return int(tree_cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len)


def learn(reuse: ChunkReuse, model_runner, forward_batch, reqs, record_of) -> None:
    """Store the new segments of every request whose prompt prefill finished in this forward (`record_of(req)`: its
    ChunkRequest)."""
    records = [record_of(r) for r in reqs]
    if not any(r is not None and r.segments is not None for r in records):
        return  # decode rows and prompts already learned: nothing to read
    pool = model_runner.token_to_kv_pool
    token_bytes = 2 * pool.layer_num * pool.get_key_buffer(0)[0].numel() * pool.get_key_buffer(0).element_size()
    for row in batch_rows(model_runner, forward_batch, reqs):
        request = records[row.index]
        if request is None or request.segments is None or row.seq_len != len(row.req.origin_input_ids) or row.decode:
            continue
        hinted = request.hint is not None and getattr(row.req, "to_finish", None) is None
        computed = torch.zeros(row.seq_len, dtype=torch.bool)
        computed[row.matched if hinted else 0:] = True
        learned = pipeline.learn_segments(reuse.store, reuse.auto, request, row.token_ids, computed,
                                          lambda positions, row=row: _read_kv(pool, row.slots[positions]),
                                          reuse.fingerprint, token_bytes)
        metrics.record_auto_learned(learned["segments"], learned["bytes"])
        if not hinted and request.exact is None:
            report.auto_stock(request, radix=row.matched, computed=row.seq_len - row.matched, learned=learned)
        else:
            request.add_learned(learned)


def _read_kv(pool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `slots`, every layer, copied to host memory (the pool's slots are SGLang's to free)."""
    k = torch.stack([pool.get_key_buffer(layer)[slots] for layer in range(pool.layer_num)]).cpu()
    v = torch.stack([pool.get_value_buffer(layer)[slots] for layer in range(pool.layer_num)]).cpu()
    return k, v
