"""The online audit in the scheduler (config `audit`; the arithmetic: chunkcache.blend.audit).

`offer` runs in the blended forward (sglang_patch.scheduler.blend.run): a sampled request's prompt ids and the
logits it was served from (its last prompt token's, copied to float32 on the host before SGLang samples from them)
wait in the server's idle queue (chunkcache.blend.idle, at most `audit.keep` of them) with an Aside of their batch.
`judge` runs as an idle job (the scheduler fully idle a moment after its last extend forward, one job per idle turn,
so a request that arrives waits for one audit forward at most): the whole prompt through every layer of SGLang's
model as a segment kept aside, attending nothing of the KV pool and writing none of it (the request's slots are freed
or another request's by then), its last-token logits against the served ones. Its outcome goes to /metrics, to the
margin (whose widening changes `served`, the estimator the blends read through ChunkServer.estimator, and is logged at
WARNING) and, with `audit.cases`, to a JSONL file (with `audit.keep_prompts`, the prompt too, tagged with its tenant,
`tenant_of`: `chunkcache calibrate --served` fits on it).

Under tensor parallelism the audit is refused at start-up: its forward would be a collective every rank must enter
with the same prompt, and nothing here agrees the sample, the queue and the outcome over the ranks.
"""

from __future__ import annotations

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
    served: torch.Tensor  # [V] float32 on the host: the logits its first token was sampled from
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
        self.served = self._with_margin()  # what the blends read (ChunkServer.estimator)

    def offer(self, runner: Runner, row: int, rid: str, b: Blended, output) -> None:
        """Keep batch row `row`'s blend for an audit when idle, if it is sampled and there is room. A blend without
        an estimate (a selector other than mix, a model without an estimator) has no bound to judge."""
        if b.estimate is None or self.server.idle.waiting("audit") >= self.config.keep or not self.sampler.take():
            return
        spans = tuple(b.plan.layout().chunk_spans) if self.config.keep_prompts else ()
        tenant = tenant_of(self.reuse, runner.forward_batch.chunkcache_reqs[row]) if self.config.keep_prompts else None
        sampled = Sampled(
            rid, b.plan.token_ids.detach().cpu().clone(), spans,
            output.next_token_logits[row].detach().float().cpu().clone(),
            b.estimate, b.plan.max_kl, b.ratio, b.plan.selector,
            self.server.aside(runner.model_runner, runner.forward_batch), tenant)
        self.server.idle.put("audit", functools.partial(self.judge, sampled))

    def judge(self, s: Sampled):
        """Audit a kept request: its prompt recomputed in full, a slice per step (an idle job; a failure drops it
        uncounted)."""
        full, seconds = yield from timed(s.aside.logits(s.prompt))
        kl, agree = audit.first_token(full, s.served)
        outcome = audit.Outcome(s.estimate.kl, s.max_kl, kl, agree)
        was = self.margin.factor
        judged = self.margin.observe(outcome)
        metrics.record_audit(outcome.error, outcome.unsafe, agree, seconds, judged.share)
        if judged.broke:
            self._widened(was, judged)
        if self.config.cases:
            self._write(s, outcome, was)

    def _widened(self, was: float, judged: audit.Judged) -> None:
        window = (f"{judged.over} of the last {judged.audited} audited requests exceeded their first-token KL bound "
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
                "kl": outcome.kl, "agree": outcome.agree, "unsafe": outcome.unsafe}
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
