"""The `chunkcache` radix-cache backend (`--radix-cache-backend chunkcache`).

Exact-prefix matching, locking and eviction stay SGLang's UnifiedRadixCache. The scheduler process's tree cache is
where SGLang hands a backend its model and pools, so this class builds the one engine-agnostic object chunk reuse
needs there (`reuse`, a chunkcache.blend.reuse.ChunkReuse: config, chunk store, selectors, models) and reports
it in /server_info. Chunk KV lives in the store's host/disk tiers (never aliased into the KV pool: blends copy it
into each request's own slots), so the pool's allocation and eviction contract is SGLang's, unchanged. Requests
that carry chunks are namespaced in the radix tree (request_hint.radix_partition) so their approximate KV can never
be matched as an exact prefix by other requests.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

import torch

from chunkcache.blend.cost import ModelShape, host_rates
from chunkcache.blend.reuse import ChunkReuse
from chunkcache.hashing import model_fingerprint, shard_fingerprint
from chunkcache.ranks import Ranks
from chunkcache import architectures
from chunkcache.store import ChunkStore, EntryLayout

from . import metrics
from ..serve.launcher import BACKEND_NAME, load_server_config, serving_problems

log = logging.getLogger(__name__)


class ChunkRadixCache(UnifiedRadixCache):
    def __init__(self, params, *, model_config, model_path: str, ranks: Ranks = Ranks(), **kwargs):
        super().__init__(params, **kwargs)
        config = load_server_config()
        # a model the blend would serve wrong stops the server here (`chunkcache serve` refuses it before launching)
        rope = architectures.check(model_config.hf_config, "sglang", model_config.context_len)
        pool = params.token_to_kv_pool_allocator.get_kvcache()
        fingerprint = shard_fingerprint(model_fingerprint(model_path), ranks.rank, ranks.size)
        if ranks.many and config.store.disk_dir:  # each rank scans and evicts its own directory under its budget
            config.store.disk_dir = os.path.join(config.store.disk_dir, f"tp{ranks.rank}of{ranks.size}")
        # disk and remote entries are checked against this model's KV layout when read (a misfit is dropped, not used)
        _, kv_heads, head_dim = pool.get_key_buffer(0).shape
        layout = EntryLayout(fingerprint, pool.layer_num, kv_heads, head_dim)
        store = ChunkStore.from_config(config.store, fingerprint, layout, on_change=metrics.set_store_stats)
        self.reuse = ChunkReuse(config, store, layout, rope, model_path, pool.device, ranks)
        if config.select.full_when_slower and torch.device(pool.device).type == "cpu":
            self.reuse.rates = host_rates(_shape(model_config.hf_config, pool))
        log.info("chunkcache: radix cache backend %r active in scheduler pid %d", BACKEND_NAME, os.getpid())

    def chunkcache_state(self) -> dict:
        """What /server_info reports under internal_states[i]['chunkcache']: under `report.to_clients: private`
        (`private_state`) the backend alone."""
        if self.reuse.config.report.to_clients == "private":
            return private_state(type(self).__name__)
        return {"backend": BACKEND_NAME, "tree_cache": type(self).__name__, "scheduler_pid": os.getpid(),
                "store": dataclasses.asdict(self.reuse.store.stats()),
                "deferred_deviations": len(self.reuse.deferred),  # estimated, to be measured when idle
                "encodes_waiting": len(self.reuse.encodes),  # paragraphs prompts taught, encoded when idle
                # the blend-or-full choice's fit to this server's forwards: a fixed time per forward, a scale per side
                "calibration": self.reuse.calibration.state(),
                # a chunk's measured compute cost, priced against a remote fetch (store.remote_fetch)
                "compute_s_per_token": self.reuse.compute.per_token_s,
                "kv_pool": {"available": int(self.token_to_kv_pool_allocator.available_size()),
                            "evictable": int(self.evictable_size()), "protected": int(self.protected_size())}}


def private_state(tree_cache: str) -> dict:
    """/server_info's chunkcache state for clients that must not learn each other's traffic: which backend
    serves, nothing that moves with what requests sent. Dropped: the store's counters (entries, bytes, hits,
    misses, remote fetches and writes), the deviations and paragraphs waiting for an idle turn (queued by blends and
    by the prompts that teach), the blend-or-full calibration and the measured compute cost (refitted by each blend,
    each chunk computed) and the KV pool's evictable and protected tokens (the radix tree's contents). /metrics
    keeps the store's and the blends' counters (chunkcache_store_*, chunkcache_remote_*, chunkcache_chunk_*, ...);
    the rest is /server_info's alone, so a private server does not show it."""
    return {"backend": BACKEND_NAME, "tree_cache": tree_cache, "scheduler_pid": os.getpid(), "private": True}


def _shape(hf_config, pool) -> ModelShape:
    c = getattr(hf_config, "text_config", hf_config)
    _, kv_heads, head_dim = pool.get_key_buffer(0).shape
    return ModelShape(pool.layer_num, c.hidden_size, c.intermediate_size, c.num_attention_heads, kv_heads, head_dim,
                      str(pool.get_key_buffer(0).dtype).removeprefix("torch."))


def reuse_of(tree_cache) -> ChunkReuse | None:
    """The scheduler's chunk reuse, None when its tree cache is not chunkcache's (a stock server)."""
    return tree_cache.reuse if isinstance(tree_cache, ChunkRadixCache) else None


def factory(ctx: TreeCacheBuildContext) -> ChunkRadixCache:
    refused = serving_problems(ctx.server_args, ctx.model_config.hf_config, load_server_config())
    if refused:
        raise ValueError(f"chunkcache: chunk reuse cannot be served with {refused}; serve without it or without "
                         f"--radix-cache-backend chunkcache")
    # the scheduler's attention-TP group (SGLang's GroupCoordinator): its gloo group carries the agreements
    ranks = Ranks(ctx.tp_group.cpu_group if ctx.tp_size > 1 else None)

    def build(params):
        return ChunkRadixCache(params, model_config=ctx.model_config, model_path=ctx.server_args.model_path,
                               ranks=ranks)

    return create_unified_radix_cache(ctx, cache_class=build)
