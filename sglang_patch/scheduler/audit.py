"""The online audit in the scheduler (config `audit`; the arithmetic: chunkcache.blend.audit).

`offer` runs in the blended forward (sglang_patch.scheduler.blend.run): a sampled request's prompt ids and the
logits it was served from (its last prompt token's, copied to float32 on the host before SGLang samples from them)
wait, at most `audit.keep` of them, with a one-row template of their forward batch. `run_one` runs from the idle hook
(sglang_patch.plugin, the deferred deviations' gate: the scheduler fully idle 0.5 s after its last extend forward,
one job per idle turn, so a request that arrives waits for one audit forward at most): the whole prompt through every
layer of SGLang's model as a segment kept aside, attending nothing of the KV pool and writing none of it (the
request's slots are freed or another request's by then), its last-token logits against the served ones. Its outcome
goes to /metrics, to the margin (whose widening replaces the estimator the blends read, `ChunkReuse.fidelity`, and is
logged at WARNING) and, with `audit.cases`, to a JSONL file (with `audit.keep_prompts`, the prompt too, tagged
with its tenant, `tenant_of`: `chunkcache calibrate --served` fits on it).

Under tensor parallelism the audit is refused at start-up: its forward would be a collective every rank must enter
with the same prompt, and nothing here agrees the sample, the queue and the outcome over the ranks.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from chunkcache.blend import audit, fidelity
from chunkcache.blend.pipeline import Blended
from chunkcache.blend.reuse import ChunkReuse
from chunkcache.config import AuditConfig

from . import metrics, request_hint
from .cache import reuse_of
from ..forward.forward_pass import Pass, Runner, one_row

log = logging.getLogger(__name__)
_audit: Audit | None = None  # this process's scheduler's, when its audit.rate > 0 (one scheduler per process)


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
    runner: Runner  # over a one-row copy of its forward batch (`one_row`)
    tenant: dict | None = None  # whose prompt it is (`tenant_of`; kept with audit.keep_prompts)


class Audit:
    def __init__(self, reuse: ChunkReuse, config: AuditConfig):
        self.reuse, self.config = reuse, config
        self.sampler = audit.Sampler(config.rate)
        self.margin = audit.Margin(config.margin, config.window, config.promise, config.max_margin)
        self.fitted = reuse.fidelity  # the estimator as fitted; the blends read it with the margin applied
        self.waiting: deque[Sampled] = deque()
        self._serve_margin()

    def offer(self, runner: Runner, row: int, rid: str, b: Blended, output) -> None:
        """Keep batch row `row`'s blend for an audit, if it is sampled and there is room. A blend without an
        estimate (a selector other than mix, a model without an estimator) has no bound to judge."""
        if b.estimate is None or len(self.waiting) >= self.config.keep or not self.sampler.take():
            return
        spans = tuple(b.plan.layout().chunk_spans) if self.config.keep_prompts else ()
        tenant = tenant_of(self.reuse, runner.forward_batch.chunkcache_reqs[row]) if self.config.keep_prompts else None
        self.waiting.append(Sampled(
            rid, b.plan.token_ids.detach().cpu().clone(), spans,
            output.next_token_logits[row].detach().float().cpu().clone(),
            b.estimate, b.plan.max_kl, b.ratio, b.plan.selector,
            Runner(runner.model_runner, one_row(runner.forward_batch, b.plan.n)), tenant))

    def run_one(self) -> None:
        """Audit the oldest kept request. A failed recompute is logged and the request dropped uncounted."""
        s = self.waiting.popleft()
        t0 = time.perf_counter()
        try:
            full = _full_logits(s)
        except Exception:  # noqa: BLE001 - a measurement of past requests: never the server's failure
            log.exception("chunkcache: the audit's full recompute of request %s failed; it is not counted", s.rid)
            return
        seconds = time.perf_counter() - t0
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
        self._serve_margin()

    def _serve_margin(self) -> None:
        if self.fitted is not None:
            self.reuse.fidelity = audit.with_margin(self.fitted, self.margin.factor)
        metrics.set_audit_margin(self.margin.factor)

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


def _full_logits(s: Sampled) -> torch.Tensor:
    """[V] float32: the last prompt token's logits of the whole prompt computed exactly, kept aside."""
    runner = s.runner
    p = Pass()
    p.add_aside(s.prompt, torch.arange(len(s.prompt)), torch.zeros(0, dtype=torch.long, device=runner.device))
    with torch.no_grad():
        out = runner.run(p, logits=True)
    return out.next_token_logits[0].detach().float().cpu()


def start(result, scheduler, *args, **kwargs) -> None:
    """AFTER hook on Scheduler.init_chunked_prefill (the tree cache exists): this scheduler's audit, when
    audit.rate > 0. This scheduler has one rank: under tensor parallelism the radix-cache factory that built its tree
    cache has already refused the audit (sglang_patch.serve.launcher.audit_problems, which `chunkcache serve` runs
    before launching too)."""
    reuse = reuse_of(scheduler.tree_cache)
    if reuse is None or reuse.config.audit.rate == 0:
        return
    global _audit
    _audit = Audit(reuse, reuse.config.audit)
    log.info("chunkcache: auditing %g of the blended requests while idle (window %d, promise %g, margin %g)",
             reuse.config.audit.rate, reuse.config.audit.window, reuse.config.audit.promise, reuse.config.audit.margin)


def of(reuse: ChunkReuse | None) -> Audit | None:
    """The scheduler's audit; None when it audits nothing."""
    return _audit if _audit is not None and _audit.reuse is reuse else None


def offer(reuse: ChunkReuse, runner: Runner, row: int, rid: str, b: Blended, output) -> None:
    """sglang_patch.scheduler.blend.run's hand-over: batch row `row`'s blend `b`, served from `output`."""
    a = of(reuse)
    if a is not None:
        a.offer(runner, row, rid, b, output)


def pending(reuse: ChunkReuse | None) -> bool:
    """Whether an audit waits for an idle turn."""
    a = of(reuse)
    return a is not None and bool(a.waiting)
