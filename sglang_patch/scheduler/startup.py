"""A chunkcache scheduler's start, once its tree cache exists and its chunked-prefill size is resolved: the
ChunkServer's prefill budget, its audit (when audit.rate > 0) and the ranks' agreement on what every blend reads
(sglang_patch.scheduler.server.ChunkServer.start)."""

from __future__ import annotations

from . import audit
from .server import server_of


def start(result, scheduler, *args, **kwargs) -> None:
    """AFTER hook on Scheduler.init_chunked_prefill."""
    server = server_of(scheduler.tree_cache)
    if server is not None:
        server.start(scheduler.chunked_prefill_size, audit.for_server(server))
