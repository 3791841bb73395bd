"""The `chunkcache` radix-cache backend (`--radix-cache-backend chunkcache`).

Exact-prefix matching stays SGLang's UnifiedRadixCache; chunk reuse is layered on top of it in this class.
"""

from __future__ import annotations

import logging
import os

from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

log = logging.getLogger(__name__)
BACKEND_NAME = "chunkcache"


class ChunkRadixCache(UnifiedRadixCache):
    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        log.info("chunkcache: radix cache backend %r active in scheduler pid %d", BACKEND_NAME, os.getpid())

    def chunkcache_state(self) -> dict:
        """What /server_info reports under internal_states[i]['chunkcache']."""
        return {"backend": BACKEND_NAME, "tree_cache": type(self).__name__, "scheduler_pid": os.getpid()}


def factory(ctx: TreeCacheBuildContext) -> ChunkRadixCache:
    return create_unified_radix_cache(ctx, cache_class=ChunkRadixCache)
