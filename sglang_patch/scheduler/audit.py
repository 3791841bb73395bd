"""The online audit in the scheduler (config `audit`; the arithmetic: chunkcache.blend.audit).

`offer` runs in the blended forward (sglang_patch.scheduler.blend.run): a sampled request's prompt ids and the
logits its first token was served from (its last prompt token's, copied to float32 on the host before SGLang samples
from them) are kept with an Aside of their batch. The audit measures what the estimate promised: the largest KL over
the first `covers` tokens of the answer (fidelity.Model.covers), so with `covers` > 1 the request stays `pending`
while it decodes: `after_batch` (every batch's result, sglang_patch.scheduler.server) keeps the logits each of its
next tokens was sampled from, until it has `covers` of them or finishes. It then waits in the server's idle queue
(chunkcache.blend.idle, at most `audit.keep` kept and pending together). `judge` runs as an idle job (the scheduler
fully idle a moment after its last extend forward, one slice per idle turn, so a request that arrives waits for one
slice at most): the whole prompt through every layer of SGLang's model as a segment kept aside, attending nothing of
the KV pool and writing none of it (the request's slots are freed or another request's by then), then the served
answer teacher-forced a token at a time; its logits at each answer token against the served ones (the largest KL:
audit.over_answer). Its outcome goes to /metrics, to the
margin (whose widening changes `served`, the estimator the blends read through ChunkServer.estimator, and is logged at
WARNING) and, with `audit.cases`, to a JSONL file (with `audit.keep_prompts`, the prompt too, tagged with its tenant,
`tenant_of`: `chunkcache calibrate --served` fits on it).

Under tensor parallelism the audit is refused at start-up: its forward would be a collective every rank must enter
with the same prompt, and nothing here agrees the sample, the queue and the outcome over the ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass

import torch

from chunkcache.blend import audit, fidelity
from chunkcache.blend.pipeline import Blended
from chunkcache.blend.idle import timed
from chunkcache.blend.reuse import ChunkReuse
from chunkcache.config import AuditConfig

from . import metrics, request_hint
from ..forward.forward_pass import Aside, Runner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampled:
    """A blended request kept for its audit."""

    rid: str
    prompt: torch.Tensor  # [N] int64 on the host: the whole prompt
    chunk_spans: tuple[tuple[int, int], ...]  # the reused chunks' token ranges in it (kept with audit.keep_prompts)
    served: torch.Tensor  # [k, V] float32 on the host: the logits its answer's first k tokens were sampled from
    answer: torch.Tensor  # [k - 1] int64: the answer's first k - 1 tokens, teacher-forced in the full recompute
    estimate: fidelity.Estimate  # what its report promised (the margin of its time applied)
    max_kl: float | None
    ratio: float
    selector: str
    aside: Aside  # the forward of its full recompute (the model runner, a one-row template of its batch)
    tenant: dict | None = None  # whose prompt it is (`tenant_of`; kept with audit.keep_prompts)


class Audit:
    def __init__(self, server, config: AuditConfig):
        """`server`: the scheduler's ChunkServer (its reuse, idle queue)."""
        self.server, self.reuse, self.config = server, server.reuse, config
        self.sampler = audit.Sampler(config.rate)
        self.margin = audit.Margin(config.margin, config.window, config.promise, config.max_margin)
        self.fitted = self.reuse.fidelity  # the estimator as fitted
        # rid -> (the sampled request, the logits of its answer's tokens so far): blends whose estimate covers more
        # than the first token, decoding
        self.pending: dict[str, tuple[Sampled, list[torch.Tensor]]] = {}
        self.served = self._with_margin()  # what the blends read (ChunkServer.estimator)

    def offer(self, runner: Runner, row: int, rid: str, b: Blended, output) -> None:
        """Keep batch row `row`'s blend for an audit, if it is sampled and there is room: at once when its estimate
        covers the first token only, else once it has decoded the tokens it covers (`after_batch`). A blend without
        an estimate (a selector other than mix, a model without an estimator) has no bound to judge; one whose floor
        bounds the first token only (kl_over: first_token) is not judged either: the margin the audit keeps widens the
        answer's estimator, which that blend did not read."""
        if (b.estimate is None or b.plan.kl_over == "first_token"
                or self.server.idle.waiting("audit") + len(self.pending) >= self.config.keep
                or not self.sampler.take()):
            return
        spans = tuple(b.plan.layout().chunk_spans) if self.config.keep_prompts else ()
        tenant = tenant_of(self.reuse, runner.forward_batch.chunkcache_reqs[row]) if self.config.keep_prompts else None
        sampled = Sampled(
            rid, b.plan.token_ids.detach().cpu().clone(), spans,
            output.next_token_logits[row].detach().float().cpu().clone()[None], torch.zeros(0, dtype=torch.long),
            b.estimate, b.plan.max_kl, b.ratio, b.plan.selector,
            self.server.aside(runner.model_runner, runner.forward_batch), tenant)
        if b.estimate.covers == 1:
            self._queue(sampled)
        else:
            self.pending[rid] = (sampled, [sampled.served[0]])

    def after_batch(self, batch, result) -> None:
        """After a batch's outputs (the scheduler's process_batch_result): a pending request's next served
        distribution kept from a decode step, and the request queued for its audit once it has its estimate's
        `covers` of them or has finished (an answer shorter than that is audited over the tokens it has)."""
        if not self.pending:
            return
        logits = getattr(getattr(result, "logits_output", None), "next_token_logits", None)
        decode = batch.forward_mode.is_decode()
        for row, req in enumerate(batch.reqs):
            kept = self.pending.get(req.rid)
            if kept is None:
                continue
            sampled, rows = kept
            if decode and len(rows) < sampled.estimate.covers:
                if logits is None:  # SGLang dropped them (delayed sampling): nothing to audit the answer against
                    log.info("chunkcache: audit: request %s's decode logits were not kept; not audited", req.rid)
                    del self.pending[req.rid]
                    continue
                rows.append(logits[row].detach().float().cpu().clone())
            if len(rows) >= sampled.estimate.covers or req.finished():
                del self.pending[req.rid]
                k = min(len(rows), len(req.output_ids))
                answer = torch.tensor(req.output_ids[:k - 1], dtype=torch.long)
                self._queue(dataclasses.replace(sampled, served=torch.stack(rows[:k]), answer=answer))

    def _queue(self, sampled: Sampled) -> None:
        self.server.idle.put("audit", functools.partial(self.judge, sampled))

    def judge(self, s: Sampled):
        """Audit a kept request: its prompt recomputed in full and its served answer teacher-forced, a slice per
        step (an idle job; a failure drops it uncounted)."""
        full, seconds = yield from timed(s.aside.logits(s.prompt, s.answer))
        kl, agree = audit.over_answer(full, s.served)
        outcome = audit.Outcome(s.estimate.kl, s.max_kl, kl, agree)
        was = self.margin.factor
        judged = self.margin.observe(outcome)
        metrics.record_audit(outcome.error, outcome.unsafe, agree, seconds, judged.share)
        if judged.broke:
            self._widened(was, judged)
        if self.config.cases:
            self._write(s, outcome, was)

    def _widened(self, was: float, judged: audit.Judged) -> None:
        window = (f"{judged.over} of the last {judged.audited} audited requests exceeded their KL bound "
                  f"(promise: at most {self.config.promise:.0%} of {self.margin.size})")
        if self.margin.factor == was:
            log.warning("chunkcache: audit: %s, and the fidelity margin is already at audit.max_margin %g", window,
                        was)
            return
        log.warning("chunkcache: audit: %s: the fidelity margin widens from %g to %g (every estimate, and the rho "
                    "a max_kl picks, follows)", window, was, self.margin.factor)
        self.served = self._with_margin()

    def _with_margin(self) -> fidelity.Model | None:
        metrics.set_audit_margin(self.margin.factor)
        return None if self.fitted is None else audit.with_margin(self.fitted, self.margin.factor)

    def _write(self, s: Sampled, outcome: audit.Outcome, margin: float) -> None:
        case = {"rid": s.rid, "fitted_for": s.estimate.fitted_for, "prompt_tokens": len(s.prompt),
                "selector": s.selector, "ratio": s.ratio, "max_kl": s.max_kl, "bound": outcome.bound,
                "estimated_kl": outcome.estimated, "estimated_agree": s.estimate.agree, "margin": margin,
                "kl": outcome.kl, "answer_tokens": len(s.served), "covers": s.estimate.covers,
                "agree": outcome.agree, "unsafe": outcome.unsafe}
        if self.config.keep_prompts:  # what `chunkcache calibrate --served` measures again, and whose it is
            case |= {"tenant": s.tenant, "prompt_ids": s.prompt.tolist(),
                     "chunk_spans": [list(span) for span in s.chunk_spans]}
        try:
            with open(self.config.cases, "a") as f:
                f.write(json.dumps(case) + "\n")
        except OSError:
            log.exception("chunkcache: writing the audited case to %s failed", self.config.cases)


def tenant_of(reuse: ChunkReuse, req) -> dict:
    """Whose prompt a kept case holds: `namespace`, the request's (its chunkcache payload's, resolved into its hint)
    or else the server's `store.namespace`, and `salted`, whether it carried a `cache_salt` (never the salt itself:
    the file would hand it to whoever reads it), so that one tenant's prompts can be told apart, exported or
    deleted."""
    request = request_hint.record(req)
    hint = None if request is None else request.hint
    namespace = hint.namespace if hint is not None else reuse.config.store.namespace
    return {"namespace": namespace, "salted": bool(getattr(req, "cache_salt", None))}


def for_server(server) -> Audit | None:
    """The audit of `server` (a ChunkServer, at its start), when audit.rate > 0. Under tensor parallelism the
    radix-cache factory that built its tree cache has already refused the audit
    (sglang_patch.serve.launcher.audit_problems, which `chunkcache serve` runs before launching too)."""
    config = server.reuse.config.audit
    if config.rate == 0:
        return None
    log.info("chunkcache: auditing %g of the blended requests while idle (window %d, promise %g, margin %g)",
             config.rate, config.window, config.promise, config.margin)
    return Audit(server, config)
