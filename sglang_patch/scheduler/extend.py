"""The extend forward of a chunkcache server: blended where requests carry chunks, SGLang's own otherwise, and the
paragraphs its prompts taught queued for learning.

`attach_batch` gives the forward batch its requests and the scheduler's ChunkServer; `blend_extend` (around SGLang's
eager extend) runs the blend (sglang_patch.scheduler.blend) for a batch with hinted requests, falls back to SGLang's
own forward when it fails, reports the prompt rounds that asked for exact KV, stamps the idle gate's clock and has
the batch's prompts teach (sglang_patch.scheduler.auto_chunks.learn). `eager_for_blends` keeps a batch with chunks out
of the prefill CUDA graph, which would bypass the blend.
"""

from __future__ import annotations

import logging
import time

from chunkcache.blend.cost import full_s
from chunkcache.ranks import RanksFailed

from . import auto_chunks, blend, report, request_hint
from .server import ChunkServer, server_of

log = logging.getLogger(__name__)


def attach_batch(result, cls, batch, *args, **kwargs):
    """AFTER hook on ForwardBatch.init_new: the extend forward needs the batch's requests (their hints) and the
    scheduler's chunk server."""
    result.chunkcache_reqs = batch.reqs
    result.chunkcache_server = server_of(batch.tree_cache)
    return result


def eager_for_blends(result, graph_runner, forward_batch, *args, **kwargs) -> bool:
    """AFTER hook on PrefillCudaGraphRunner.can_run_graph: never for a batch with chunks."""
    reqs = getattr(forward_batch, "chunkcache_reqs", None) or ()
    return result and not any(request_hint.of(r) is not None for r in reqs)


def blend_extend(original, runner, forward_batch, pp_proxy_tensors=None):
    """AROUND hook on EagerRunner._execute_extend."""
    server = getattr(forward_batch, "chunkcache_server", None)
    reqs = getattr(forward_batch, "chunkcache_reqs", None)
    out = _extend(original, runner, forward_batch, pp_proxy_tensors, server, reqs)
    if server is None:
        return out
    server.last_forward = time.monotonic()
    _report_exact(forward_batch, reqs or ())
    if reqs and server.reuse.auto is not None and server.reuse.config.auto.learn:
        try:
            auto_chunks.learn(server.reuse, server.teach, runner.model_runner, forward_batch, reqs,
                             request_hint.record)
        except Exception:  # noqa: BLE001 - learning is an optimisation: the request's own output is already computed
            # agreed over the ranks (a store failing on one rank raises RanksFailed on every rank, before anything
            # is queued), so every rank's idle queue stays the same
            log.exception("chunkcache: learning the batch's segments failed; they are not stored")
    return out


def _extend(original, runner, forward_batch, pp_proxy_tensors, server: ChunkServer | None, reqs):
    if server is None or not reqs or pp_proxy_tensors is not None:
        return original(runner, forward_batch, pp_proxy_tensors)
    if all(request_hint.of(r) is None for r in reqs):
        return _stock_forward(original, runner, forward_batch, pp_proxy_tensors, server)
    ranks = server.reuse.ranks
    try:
        out = blend.run(server, runner.model_runner, forward_batch, reqs)
    except Exception as exc:  # noqa: BLE001 - a selector or store failure must not take the scheduler down
        # Safe: the stock forward below rewrites the KV of every extend token, and what the blend stored is valid.
        # Under tensor parallelism only a failure every rank agreed on (RanksFailed, raised on all of them at the
        # same point) is: a rank that fell back alone would leave the others waiting in the blend's all-reduces.
        if ranks.many and not isinstance(exc, RanksFailed):
            log.critical("chunkcache: the blended prefill failed on tensor-parallel rank %d alone; the ranks cannot "
                         "fall back together from here, so the scheduler stops", ranks.rank)
            raise
        log.exception("chunkcache: blended prefill failed; computing the batch in full")
        for r in reqs:
            if request_hint.of(r) is not None:
                report.fallback(request_hint.record(r), "error", f"{type(exc).__name__}: {exc}")
        out = None
    return _stock_forward(original, runner, forward_batch, pp_proxy_tensors, server) if out is None else out


def _report_exact(forward_batch, reqs) -> None:
    """The prompt rounds of requests that asked for exact KV, which SGLang's own forward just computed (a decode
    row of a mixed batch, or a retracted request's re-prefill, is not a prompt round)."""
    for i, req in enumerate(reqs):
        if request_hint.exact(req) is not None and not req.output_ids:
            report.exact(request_hint.record(req), radix=int(forward_batch.extend_prefix_lens_cpu[i]),
                         computed=int(forward_batch.extend_seq_lens_cpu[i]))


def _stock_forward(original, runner, forward_batch, pp_proxy_tensors, server: ChunkServer):
    """SGLang's own extend forward, timed against the rates' prediction of a full prefill of its rows (the
    calibration of the blend-or-full choice, chunkcache.blend.cost) when the server makes that choice."""
    reuse = server.reuse
    if reuse.rates is None:
        return original(runner, forward_batch, pp_proxy_tensors)
    t0 = time.perf_counter()
    out = original(runner, forward_batch, pp_proxy_tensors)
    predicted = sum(full_s(e, p, reuse.rates) for e, p in zip(forward_batch.extend_seq_lens_cpu,
                                                                forward_batch.extend_prefix_lens_cpu))
    reuse.calibration.observe("full", predicted, time.perf_counter() - t0)
    return out
