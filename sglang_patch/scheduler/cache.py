"""The `chunkcache` radix-cache backend (`--radix-cache-backend chunkcache`).

Exact-prefix matching, locking and eviction stay SGLang's UnifiedRadixCache. The scheduler process's tree cache is
where SGLang hands a backend its model and pools, so this class builds the one engine-agnostic object chunk reuse
needs there (`chunk_server`, a sglang_patch.scheduler.server.ChunkServer around a
chunkcache.blend.reuse.ChunkReuse: config, chunk store, selectors, models, and the state that changes while serving).
Chunk KV lives in the store's host/disk tiers (never aliased into the KV pool: blends copy it into each request's own
slots), so the pool's allocation and eviction contract is SGLang's, unchanged. Requests
that carry chunks are namespaced in the radix tree (request_hint.radix_partition) so their approximate KV can never
be matched as an exact prefix by other requests.
"""

from __future__ import annotations

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
from .server import ChunkServer
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
        # rank 0's rates on every rank (measured once per host, or read from its file): the blend-or-full choice
        # prices with them on every rank
        rates = ranks.agree(lambda: host_rates(_shape(model_config.hf_config, pool)) if ranks.rank == 0 else None) \
            if config.select.full_when_slower and torch.device(pool.device).type == "cpu" else None
        self.chunk_server = ChunkServer(ChunkReuse(config, store, layout, rope, model_path, pool.device, ranks, rates))
        log.info("chunkcache: radix cache backend %r active in scheduler pid %d", BACKEND_NAME, os.getpid())


def _shape(hf_config, pool) -> ModelShape:
    c = getattr(hf_config, "text_config", hf_config)
    _, kv_heads, head_dim = pool.get_key_buffer(0).shape
    return ModelShape(pool.layer_num, c.hidden_size, c.intermediate_size, c.num_attention_heads, kv_heads, head_dim,
                      str(pool.get_key_buffer(0).dtype).removeprefix("torch."))


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
