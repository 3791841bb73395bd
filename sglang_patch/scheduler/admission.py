"""Chunk-aware prefill admission: SGLang's PrefillAdder, charging a hinted request what its blend computes.

SGLang charges every request its whole extend length against the prefill budgets (`rem_chunk_tokens`, the
chunked-prefill size; `rem_input_tokens`, max_prefill_tokens) and splits the one that does not fit. A blended request
computes a fraction of its extend (`compute_tokens`), so charged in full it is split for nothing, and a split round
cannot be blended (the selection needs the whole prompt). Here:
  * a hinted request is charged its compute estimate; its KV slots are still reserved in full (the memory budget is
    SGLang's, untouched: the reused KV is copied into those slots);
  * a hinted request that fits the remaining budget by compute is admitted whole, never split;
  * one that does not fit waits for the next batch; if its compute alone exceeds the whole budget (e.g. a long
    prompt of chunks never seen), it is admitted alone, whole, and the blend splits its fill into forwards of at
    most the budget (blend.BatchEngine.fill), so no forward computes more than a chunked prefill would.
Plain requests are admitted exactly as SGLang admits them. Installed through the plugin hook on
`Scheduler.get_prefill_adder_class` (plugin.hooks).
"""

from __future__ import annotations

import logging

from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

from chunkcache.blend.cost import work
from chunkcache.blend.reuse import ChunkReuse

from . import request_hint
from .server import reuse_of

log = logging.getLogger(__name__)


def compute_tokens(reuse: ChunkReuse, req, prefix_len: int) -> int | None:
    """Tokens the blend computes for `req` when the radix tree holds its first `prefix_len` tokens
    (chunkcache.blend.cost.work: the count its blend-or-full choice prices). None for a request that is not blended
    as a whole (no chunks, a retracted request that re-prefills its output)."""
    if request_hint.of(req) is None or req.output_ids:
        return None
    plan = request_hint.record(req).plan(prefix_len)
    if not plan.blends:
        return plan.n - prefix_len
    held = reuse.held([c.key for c in plan.chunks])  # every rank admits the same batch
    return work(plan, reuse.selector(plan.selector), reuse.layout.num_layers, held).tokens


class ChunkAwarePrefillAdder(PrefillAdder):
    def _select_prefill_admission(self, req, **kwargs):
        prefix_len = req.prefix_len + kwargs["host_hit_length"]
        compute = compute_tokens(reuse_of(self.tree_cache), req, prefix_len)
        request = request_hint.record(req)
        if request is not None:
            request.charged = compute
        if compute is None:
            return super()._select_prefill_admission(req, **kwargs)
        budgets = [b for b in (self.rem_chunk_tokens, self.rem_input_tokens) if b is not None]
        if self.can_run_list and compute > min(budgets):
            return AddReqResult.OTHER  # the next batch takes it (alone, if it needs the whole budget)
        if compute > min(budgets):
            log.info("chunkcache: request %s computes %d tokens, more than the prefill budget %d: admitted alone, "
                     "whole; its fill runs in forwards of at most the budget", req.rid, compute, min(budgets))
        extend = self.ceil_paged_tokens(len(req.full_untruncated_fill_ids) - prefix_len)
        saved = self.rem_chunk_tokens, self.rem_input_tokens
        # lift the compute budgets past the extend while SGLang decides: the request must not be split
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens = max(self.rem_chunk_tokens, extend)
        self.rem_input_tokens = max(self.rem_input_tokens, extend + 1)
        try:
            return super()._select_prefill_admission(req, **kwargs)
        finally:
            self.rem_chunk_tokens, self.rem_input_tokens = saved

    def _commit_prefill_admission(self, req, admission, mamba_gap_reserve: int) -> None:
        saved = self.rem_chunk_tokens, self.rem_input_tokens
        super()._commit_prefill_admission(req, admission, mamba_gap_reserve)
        request = request_hint.record(req)
        compute = None if request is None else request.charged
        if compute is not None and not admission.is_chunked:
            # SGLang charged the whole extend; charge the compute instead (its KV reservation stays in full)
            chunk, tokens = saved
            self.rem_chunk_tokens = None if chunk is None else chunk - compute
            self.rem_input_tokens = tokens - compute


def adder_class(result, scheduler, *args, **kwargs):
    """AFTER hook on Scheduler.get_prefill_adder_class: ours when the scheduler's tree cache is chunkcache's."""
    if reuse_of(scheduler.tree_cache) is not None and result is PrefillAdder:
        return ChunkAwarePrefillAdder
    return None
