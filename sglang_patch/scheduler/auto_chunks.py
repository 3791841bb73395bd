"""Automatic chunk detection in the scheduler (config `auto.enabled`; chunkcache.blend.auto has the contract).

  * `detect`, when a request without a chunk hint becomes a `Req` (request_hint.attach): its content-defined
    segments are cut and kept on the Req; the radix tree's exact match is found in the request's own partition; the
    stored segments past it become an auto hint, and the request moves to the auto radix partition (its KV will be
    approximate). Too few stored tokens: the request stays a plain one, served exactly as stock.
  * `learn`, after every extend forward: for each request whose prompt prefill finished in it, the KV of its
    segments that this prefill computed and no tier holds is copied out of the pool into the store (their K at the
    positions they had here: the entry's start_pos). A plain request's whole prompt is exact (its radix match is in
    the exact partition); a hinted or auto request's tokens past its radix match count as computed (chunk tokens
    hold their stored KV re-rotated, which the selector already corrected where it mattered).
A request with input logprobs is never detected (the blend cannot give every prompt token's logits).
"""

from __future__ import annotations

import logging
import time
from array import array

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from chunkcache.blend.reuse import ChunkReuse
from chunkcache.store import ChunkEntry

from . import metrics, report
from ..forward.forward_pass import batch_rows

log = logging.getLogger(__name__)
SEGMENTS = "chunkcache_segments"  # Req attribute: the prompt's chunkcache.blend.auto.Segments


def detect(reuse: ChunkReuse, tree_cache, req):
    """The request's auto hint, or None (served as stock); its segments are kept on it for `learn`."""
    t0 = time.perf_counter()
    ids = req.origin_input_ids
    segments = reuse.segments(ids, getattr(req, "cache_salt", None))
    req.__dict__[SEGMENTS] = segments
    if getattr(req, "return_logprob", False) or not segments.spans:
        return None
    matched = exact_prefix(tree_cache, req)
    hint = reuse.auto_hint(ids, segments, matched)
    looked_up = sum(s >= matched for s, _ in segments.spans)
    req.__dict__[report.AUTO_SEGMENTS] = looked_up
    seconds = time.perf_counter() - t0
    req.__dict__[report.AUTO_DETECT_S] = seconds
    metrics.record_auto_lookup(hits=len(hint.spans) if hint else 0,
                               misses=looked_up - (len(hint.spans) if hint else 0), seconds=seconds)
    return hint


def exact_prefix(tree_cache, req) -> int:
    """Tokens of the prompt the radix tree holds exactly in the request's (plain) partition."""
    key = RadixKey(token_ids=array("q", req.origin_input_ids), extra_key=req.extra_key,
                   cache_salt=getattr(req, "cache_salt", None))
    return int(tree_cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len)


def learn(reuse: ChunkReuse, model_runner, forward_batch, reqs, hint_of) -> None:
    """Store the new segments of every request whose prompt prefill finished in this forward."""
    if not any(SEGMENTS in r.__dict__ for r in reqs):  # decode rows and prompts already learned: nothing to read
        return
    pool = model_runner.token_to_kv_pool
    per_token = 2 * pool.layer_num * pool.get_key_buffer(0)[0].numel() * pool.get_key_buffer(0).element_size()
    for row in batch_rows(model_runner, forward_batch, reqs):
        segments = row.req.__dict__.get(SEGMENTS)
        if segments is None or row.seq_len != len(row.req.origin_input_ids) or row.decode:
            continue
        hint = hint_of(row.req)
        computed = torch.zeros(row.seq_len, dtype=torch.bool)
        computed[0 if hint is None else row.matched:] = True
        crowded = reuse.store.room() < int(computed.sum()) * per_token
        todo = reuse.auto.to_learn(segments, computed, reuse.store, crowded)
        row.req.__dict__.pop(SEGMENTS)  # learned once per prompt, whatever later rounds do
        learned = _store(reuse, pool, row, todo)
        if hint is None and report.EXACT not in row.req.__dict__:
            report.auto_stock(row.req, radix=row.matched, computed=row.seq_len - row.matched, learned=learned)
        elif learned:
            report.add_learned(row.req, learned)


def _store(reuse: ChunkReuse, pool, row, todo) -> dict:
    """The segments' KV copied (not aliased: the pool's slots are SGLang's to free) into store entries."""
    learned = {"segments": 0, "tokens": 0, "bytes": 0, "seconds": 0.0}
    if not todo:
        return learned
    t0 = time.perf_counter()
    slots = torch.cat([row.slots[s:e] for (s, e), _ in todo])
    k = torch.stack([pool.get_key_buffer(layer)[slots] for layer in range(pool.layer_num)]).cpu()
    v = torch.stack([pool.get_value_buffer(layer)[slots] for layer in range(pool.layer_num)]).cpu()
    at = 0
    for (s, e), key in todo:
        n = e - s
        entry = ChunkEntry(key=key, token_ids=row.token_ids[s:e].clone(), k=k[:, at: at + n].clone(),
                           v=v[:, at: at + n].clone(), start_pos=s, model_fingerprint=reuse.fingerprint)
        at += n
        if reuse.store.put(entry):
            learned["segments"] += 1
            learned["tokens"] += n
            learned["bytes"] += entry.nbytes
    metrics.record_auto_learned(learned["segments"], learned["bytes"])
    learned["seconds"] = round(time.perf_counter() - t0, 6)
    return learned
