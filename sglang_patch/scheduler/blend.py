"""The blended prefill of one extend batch, run in place of SGLang's model forward when a request carries chunks.

`run` sorts the batch's rows, runs chunkcache.blend.pipeline on the ones that blend, and reports every hinted
request's round (the pipeline's record, through sglang_patch.scheduler.report):
  * a hinted request's whole-prompt prefill blends: its plan (ChunkRequest.plan) starts after the radix match, a
    chunk the match reaches into keeping its exact head;
  * one whose chunks the radix tree holds entirely is computed exactly (reported, nothing to blend);
  * one prefilled in part (chunked prefill, a retracted request), or one that asked for input logprobs over its
    prompt, is computed in full (a fallback, with its reason); output logprobs come from the blend's own last-token
    logits, as SGLang's sampler takes them from its own forward's;
  * plain requests and the decode rows of a mixed batch are computed exactly, in the blend's last forward.
`BatchEngine` is the pipeline's Engine on SGLang's model runner: every step is one forward of SGLang's own model over
a Pass (sglang_patch.forward.forward_pass) for the whole batch, the fill split into forwards of at most the prefill
budget.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from chunkcache.blend import fidelity, pipeline
from chunkcache.blend.cost import Prediction, predict
from chunkcache.blend.layer_copy import LayerCopy
from chunkcache.blend.plan import Placement, RequestPlan
from chunkcache.blend.request import ChunkRequest
from chunkcache.blend.reuse import ChunkReuse
from chunkcache.rope import Rotation
from chunkcache.store import ChunkEntry

from . import report, request_hint
from .server import ChunkServer
from ..forward.forward_pass import Aside, Pass, Row, Runner, batch_rows, input_logprob_tokens
from ..forward.sparse_attention import pool_index


def run(server: ChunkServer, model_runner, forward_batch, reqs):
    """The batch's logits output, or None when nothing blends (SGLang's own forward then computes the batch)."""
    reuse = server.reuse
    t0 = time.perf_counter()
    rows = batch_rows(model_runner, forward_batch, reqs)
    hinted = [(row, request_hint.record(row.req)) for row in rows
              if not row.decode and request_hint.of(row.req) is not None]
    if not hinted:
        return None
    blending: dict[int, tuple[ChunkRequest, RequestPlan]] = {}  # batch row -> its record and plan
    predictions: dict[int, Prediction | None] = {}  # calibrated (reported); at_rates: as the rates alone predict
    at_rates: dict[int, Prediction | None] = {}
    candidates = []
    scored = input_logprob_tokens(forward_batch)
    for row, request in hinted:
        prompt = len(row.req.origin_input_ids)
        if scored[row.index]:
            report.fallback(request, "input_logprobs", f"input logprobs of the last {scored[row.index]} prompt tokens "
                            f"(logprob_start_len) need those tokens' logits, which a blend does not compute: this "
                            f"round is computed in full (output logprobs alone are served blended)")
        elif request.hint.max_kl is not None and fidelity.bounding(server.estimator, request.hint.kl_over) is None:
            report.fallback(request, "uncalibrated", pipeline.UNCALIBRATED_FIRST
                            if request.hint.kl_over == "first_token" else pipeline.UNCALIBRATED)
        elif row.seq_len != prompt:
            report.fallback(request, "partial_prefill", f"tokens [{row.matched}, {row.seq_len}) of "
                            f"{prompt} (chunked prefill or a retracted request): this round is computed in full")
        elif (plan := request.plan(row.matched)).blends:
            candidates.append((row, request, plan))
        else:  # the radix tree holds every chunk: computed exactly, and said so
            report.blended(request, pipeline.record_held(request, plan, row.seq_len - row.matched))
    for (row, request, plan), (raw, predicted) in zip(candidates, priced(reuse, [c[2] for c in candidates])):
        if predicted is not None and not predicted.blend:
            report.fallback(request, "predicted_slower", f"blending ({predicted.tokens} tokens computed, "
                            f"{predicted.pairs} pairs attended, {predicted.reused} copied) predicted "
                            f"{predicted.blend_s:.3f} s against {predicted.stock_s:.3f} s computed in full, less the "
                            f"{predicted.margin:.0%} margin "
                            f"({row.seq_len - row.matched} tokens; rates of this host)", predicted.report())
            continue
        blending[row.index] = request, plan
        predictions[row.index] = predicted
        at_rates[row.index] = raw
    if not blending:
        return None
    planned = time.perf_counter()
    plans = [plan for _, plan in blending.values()]
    engine = BatchEngine(reuse, Runner(model_runner, forward_batch), rows, plans, list(blending), server.prefill_budget)
    try:
        done = pipeline.run(engine, reuse.store, plans, reuse.selector, floor_cap=reuse.config.select.max_kl_cap,
                            compute=reuse.compute, prefetched=[p for request, _ in blending.values()
                                                               if (p := request.prefetched()) is not None],
                            estimator=server.estimator, ranks=reuse.ranks)
    finally:  # whatever runs next on these slots (the next batch, a fallback's prefill) follows the whole copy
        if engine.runner.copied is not None:
            engine.runner.copied.wait_all()
    server.defer(done.deferred)  # measured when the scheduler is idle
    stages = {**done.seconds, "plan": planned - t0}
    decodes = sum(row.decode for row in rows)
    batch = {"requests": len(blending), "plain": len(rows) - len(blending) - decodes, "decodes": decodes,
             "forwards": engine.runner.forwards}
    if batch["plain"] == batch["decodes"] == 0:  # its forwards are its blends' alone
        _observe(reuse, list(at_rates.values()), done, stages)
    feature_s = stages["features"] / len(blending)  # a batched feature pass is shared evenly by its requests
    blend_s = time.perf_counter() - t0 - stages["features"] - stages["select"]
    for (index, (request, _)), b in zip(blending.items(), done.requests):
        report.blended(request, pipeline.record(request, b, stages=stages, blend_s=blend_s,
                                                select_s=feature_s + b.select_s, batch=batch,
                                                prediction=predictions[index]))
        if server.audit is not None:  # a sample, recomputed when idle
            server.audit.offer(engine.runner, index, request.rid, b, done.output)
    return done.output


def _observe(reuse: ChunkReuse, priced: list[Prediction | None], done: pipeline.BatchBlend,
             seconds: dict[str, float]) -> None:
    """The batch's query pass (a probe of the fixed time per forward, when the feature stage ran it alone) and its
    recompute pass, each one forward, against the rates' prices (chunkcache.blend.cost.Calibration)."""
    if not priced or any(p is None for p in priced):
        return
    if all(b.passes == ("query_attention",) for b in done.requests):
        reuse.calibration.observe("probe", sum(p.stages["query"] for p in priced), seconds["features"])
    reuse.calibration.observe("blend", sum(p.stages["recompute"] for p in priced), seconds["recompute"])


def priced(reuse: ChunkReuse, plans: Sequence[RequestPlan]) -> list[tuple[Prediction | None, Prediction | None]]:
    """Blend or full for each plan (`_predicted`), from rank 0's timings: each rank's calibration of its own
    forwards would split the ranks' forwards."""
    return reuse.ranks.agree(lambda: [_predicted(reuse, plan) for plan in plans])


def _predicted(reuse: ChunkReuse, plan: RequestPlan) -> tuple[Prediction | None, Prediction | None]:
    """Blend against full compute at the rates alone and scaled by what this server observed, for a request that
    teaches the store nothing (a missing chunk is computed and stored by its blend, for every later request); None
    when the server does not decide (GPU, `full_when_slower` off)."""
    if reuse.rates is None or any(c.key not in reuse.store for c in plan.chunks):
        return None, None
    raw = predict(plan, reuse.selector(plan.selector), reuse.rates, reuse.layout.num_layers,
                  reuse.config.select.blend_margin)
    return raw, reuse.calibration.apply(raw)


class BatchEngine:
    """chunkcache.blend.pipeline's Engine for one extend batch: `plans` are the blending rows' (request i of the
    pipeline is the i-th), the other rows are computed exactly by `recompute`."""

    def __init__(self, reuse: ChunkReuse, runner: Runner, rows: list[Row], plans: list[RequestPlan],
                 plan_rows: list[int], prefill_budget: int | None = None):
        """`plan_rows`: the batch row of each plan; `prefill_budget`: the tokens one fill forward may compute."""
        self.reuse, self.runner, self.rows, self.prefill_budget = reuse, runner, rows, prefill_budget
        self.fingerprint, self.models, self.entry_shape = reuse.fingerprint, reuse.models, reuse.entry_shape
        self.rope = reuse.rope
        self.n_layers = reuse.layout.num_layers
        self.plans = plans
        self.plan_rows = [rows[index] for index in plan_rows]
        self.request_of_row = {index: i for i, index in enumerate(plan_rows)}
        self.pool = runner.model_runner.token_to_kv_pool
        # request -> its unmatched shared-prefix positions, when no chunk of it is computed by the fill (nothing
        # attends them before the blend's next pass): computed exactly inside that pass (`_lead`), not in a forward
        # of their own
        self.leads: dict[int, torch.Tensor] = {}

    def fill(self, chunks: list[tuple[int, Placement]]) -> list[ChunkEntry]:
        """Unmatched shared-prefix tokens (exact, in place) and missing chunks (standalone, kept aside), packed into
        forwards of at most the prefill budget. A request's prefix is added before its chunks, so it runs in the
        same or an earlier forward than the chunks that attend to it. A request with no missing chunk leaves its
        prefix to the next pass it takes part in (`leads`): one forward fewer, a fixed cost on a GPU."""
        budget, passes = self.prefill_budget, [Pass()]

        def room(n: int) -> Pass:
            if passes[-1].n and budget and passes[-1].n + n > budget:
                passes.append(Pass())
            return passes[-1]

        computing = {i for i, _ in chunks}
        for i, (plan, row) in enumerate(zip(self.plans, self.plan_rows)):
            if plan.matched < plan.start:
                lead = torch.arange(plan.matched, plan.start)
                if i in computing:
                    room(len(lead)).add(row, lead, ctx=plan.start)
                else:
                    self.leads[i] = lead
        aside = []
        for i, c in chunks:
            plan, shared = self.plans[i], self.plans[i].shared_prefix_len
            ids = plan.chunk_ids(c)
            seg = room(len(ids)).add_aside(ids, torch.arange(shared, shared + len(ids)), self.plan_rows[i].slots[:shared])
            aside.append((i, c, seg))
        for p in passes:
            if p.n:
                self.runner.run(p)
        return [ChunkEntry(key=c.key, token_ids=self.plans[i].chunk_ids(c).clone(),
                           k=torch.stack([k for k, _ in seg.kept_kv]).cpu(),
                           v=torch.stack([v for _, v in seg.kept_kv]).cpu(),
                           start_pos=self.plans[i].shared_prefix_len, model_fingerprint=self.fingerprint,
                           tenant=self.plans[i].tenant, context=self.plans[i].context or "")
                for i, c, seg in aside]

    def copy(self, entries: list[list[ChunkEntry]]) -> None:
        """Copy (never alias) every chunk's stored KV into its request's slots, K re-rotated to its new positions:
        per layer, the chunks' KV gathered into one tensor on the device, K re-rotated in one call (each token by its
        chunk's move) and one indexed write per buffer, or, when the slots are one run of the pool (a request's
        usually are) and the pool holds the entries' dtype, K re-rotated straight into it and V concatenated into it
        (one pass over the KV fewer each: 16 -> 10 ms for 1,650 tokens of 30 layers read cold, 2-core AMD EPYC). On
        CUDA layer by layer behind the passes that read it (chunkcache.blend.layer_copy: the runner's attention waits
        per layer); from page-locked host memory (store.pin_memory) without blocking the host."""
        device = self.plan_rows[0].slots.device
        keys = [self.pool.get_key_buffer(layer) for layer in range(self.n_layers)]
        values = [self.pool.get_value_buffer(layer) for layer in range(self.n_layers)]
        moves = [(row.slots[slice(*c.span)], c, entry)
                 for plan, row, chunk_entries in zip(self.plans, self.plan_rows, entries)
                 for c, entry in zip(plan.chunks, chunk_entries)]
        dst = torch.cat([slots for slots, _, _ in moves]).to(device)
        # where each token was computed and how far it moves: with the cached positions, re-rotation reproduces the
        # model's own float32 angle rounding (chunkcache.rope)
        at = torch.cat([torch.arange(e.start_pos + c.head, e.start_pos + e.num_tokens) for _, c, e in moves])
        moved = torch.cat([torch.full((e.num_tokens - c.head,), c.chunk[0] - e.start_pos) for _, c, e in moves])
        rotation = Rotation.of(moved, self.rope, at, device)
        run = pool_index(dst)
        in_place = isinstance(run, slice) and {e.k.dtype for _, _, e in moves} == {keys[0].dtype} \
            and {e.v.dtype for _, _, e in moves} == {values[0].dtype}

        def write(layer: int) -> None:
            k, v = ([getattr(e, name)[layer, c.head:].to(device, non_blocking=True) for _, c, e in moves]
                    for name in ("k", "v"))
            if in_place:
                rotation.layer(layer).apply(torch.cat(k), out=keys[layer][run])
                torch.cat(v, out=values[layer][run])
                return
            keys[layer][dst] = rotation.layer(layer).apply(torch.cat(k))
            values[layer][dst] = torch.cat(v)
        self.runner.copied = LayerCopy(self.n_layers, device, write)

    def query_attention(self, requests: Sequence[int]) -> list[torch.Tensor]:
        """ProphetKV's score for each request: the query's last tokens (Layout.query_pass) through all layers
        against its reused KV, their attention to each token recorded. The query's other tokens and the tokens
        between chunks are left to the recompute, and their slots hold no KV of this prompt yet (whatever an
        earlier request left there), so the pass does not attend them. The K/V written here are rewritten by the
        recompute (the query is always recomputed)."""
        p, segments = Pass(), []
        for i in requests:
            plan, row = self.plans[i], self.plan_rows[i]
            self._lead(p, i)
            layout = plan.layout()
            rows = layout.query_pass()
            visible = torch.cat([layout.held(), rows])
            visible = None if len(visible) == plan.n else visible  # no holes: the whole row, one range of slots
            seg = p.add(row, rows, ctx=plan.n, visible=visible)
            seg.attention_sum = torch.zeros(plan.n if visible is None else len(visible), dtype=torch.float32,
                                            device=row.slots.device)
            segments.append((seg, visible, plan.n))
        self.runner.run(p)
        # each rank averaged its own query heads (an even share of them, launcher.parallel_problems): the mean of the
        # ranks' means is the mean over all heads
        sums = self.reuse.ranks.sum_(torch.cat([seg.attention_sum for seg, _, _ in segments]).cpu())
        sums /= self.reuse.ranks.size
        out = []
        for (seg, visible, n), scores in zip(segments, sums.split([len(seg.attention_sum) for seg, _, _ in segments])):
            if visible is not None:  # back to prompt positions: a hole has no attention
                scores = torch.zeros(n, dtype=scores.dtype).index_copy_(0, visible, scores)
            out.append(scores)
        return out

    def kv_deviation(self, requests: Sequence[int], layer: int, which: str) -> list[torch.Tensor]:
        """Each request's tokens after its exact prefix computed exactly through layers 0..`layer` only, their K/V
        kept aside (the pool keeps the reused KV) and compared with the reused K/V at `layer`."""
        leads = Pass()  # this pass stops early: the prefixes it attends are computed through every layer first
        for i in requests:
            self._lead(leads, i)
        if leads.n:
            self.runner.run(leads)
        p, segments = Pass(), []
        for i in requests:
            plan, row = self.plans[i], self.plan_rows[i]
            segments.append(p.add_aside(plan.token_ids[plan.start:], torch.arange(plan.start, plan.n),
                                        row.slots[: plan.start]))
        self.runner.run(p, layers=layer + 1)
        buf = self.pool.get_key_buffer(layer) if which == "k" else self.pool.get_value_buffer(layer)
        squares = []  # per request, over this rank's KV heads; the norm is over every rank's
        for i, seg in zip(requests, segments):
            plan, row = self.plans[i], self.plan_rows[i]
            fresh = seg.kept_kv[layer][0 if which == "k" else 1]
            reused = buf[row.slots[plan.start:].to(buf.device)]
            squares.append((fresh.float() - reused.float()).flatten(1).square().sum(1))
        norms = self.reuse.ranks.sum_(torch.cat(squares).cpu()).sqrt().split([len(q) for q in squares])
        out = []
        for i, norm in zip(requests, norms):
            plan = self.plans[i]
            dev = torch.zeros(plan.n)
            dev[plan.start:] = norm
            out.append(dev * plan.layout().context_mask())
        return out

    def aside(self):
        """The forward of a measurement after the batch (a deferred DeviationJob, when the request may be gone): a
        prompt kept aside, attending nothing of the pool; it keeps the model runner and a one-row batch template."""
        return Aside(self.runner.model_runner, self.runner.forward_batch, self.reuse.config.idle.slice_tokens).kv

    def recompute(self, tokens: list[torch.Tensor]):
        """The selected tokens of every blending request and every extend token of the other rows, in batch order;
        each row's last token comes last, so the logits are the batch's output."""
        p = Pass()
        for row in self.rows:
            i = self.request_of_row.get(row.index)
            if i is None:
                p.add(row, torch.arange(row.matched, row.seq_len), ctx=row.seq_len)
                continue
            lead = self.leads.pop(i, None)  # before every recomputed token: one segment per row, still sorted
            p.add(row, tokens[i] if lead is None else torch.cat([lead, tokens[i]]), ctx=row.seq_len)
        assert not self.leads, f"requests {sorted(self.leads)} left their prefix uncomputed"
        return self.runner.run(p, logits=True)

    def _lead(self, p: Pass, i: int) -> None:
        """Request i's prefix left by the fill, into `p` ahead of its tokens that attend it: a pass writes every
        token's K/V at a layer before any of its tokens attends at that layer, so they see it exact."""
        lead = self.leads.pop(i, None)
        if lead is not None:
            p.add(self.plan_rows[i], lead, ctx=self.plans[i].start)
