"""The online audit's arithmetic, no model and no server (the scheduler's side: sglang_patch/scheduler/audit.py).

A server with `audit.rate` > 0 keeps a sample of its blended requests (`Sampler`) and, while it is idle, recomputes
each one's prompt in full and teacher-forces the answer it served: `over_answer` compares full recompute's logits at
each of the answer's first `covers` tokens (the estimator's) with those the request was served from. The promise it checks is the fidelity estimate's (chunkcache/blend/fidelity.py): at most `promise`
(0.1) of the blends exceed their bound, the request's max_kl or, without one, its own estimate (an upper quantile of
its KL, Model.quantile 0.9). `Margin` judges the promise over the last `window` audited requests; a window that
breaks it widens the safety factor every later estimate is multiplied by (`with_margin`), so that a quality floor
picks a larger rho and the report promises what the audit measures.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, replace

import torch

from .fidelity import Model

# a window's factor grows at least this much when it breaks the promise: one widening must outgrow the noise of the
# estimate, which is fitted on log KL
WIDEN_AT_LEAST = 2.0


class Sampler:
    """Which blended requests are audited: each with probability `rate`, from a seeded stream, so a run is
    repeatable."""

    def __init__(self, rate: float, seed: int = 0):
        self.rate = rate
        self._draws = random.Random(seed)

    def take(self) -> bool:
        return self._draws.random() < self.rate


def over_answer(full: torch.Tensor, served: torch.Tensor) -> tuple[float, bool]:
    """(the largest KL(full || served) in nats over the answer's steps, whether the greedy first tokens agree) of two
    [steps, V] logit rows: row i the distribution of the answer's token i, both scored on the served answer's first i
    tokens (teacher-forced). The divergence chunkbench measures blends by (quality.reference_path.kl_logits), in
    float64; an estimator covering `covers` tokens bounds the largest over that many (fidelity.Model.covers)."""
    p, q = full.double().log_softmax(-1), served.double().log_softmax(-1)
    kls = (p.exp() * (p - q)).sum(-1)
    return max(float(kls.max()), 0.0), int(full[0].argmax()) == int(served[0].argmax())


@dataclass(frozen=True)
class Outcome:
    """One audited request."""

    estimated: float  # the fidelity estimate it was served with (margin applied), nats
    max_kl: float | None  # its quality floor, if it had one
    kl: float  # measured KL against full recompute, the largest over the served answer's audited tokens, nats
    agree: bool  # its greedy first token is full recompute's

    @property
    def bound(self) -> float:
        """What it was promised: its max_kl, else its own estimate."""
        return self.estimated if self.max_kl is None else self.max_kl

    @property
    def unsafe(self) -> bool:
        return self.kl > self.bound

    @property
    def error(self) -> float:
        """The estimate's error: measured minus estimated KL (positive: the estimate promised too little)."""
        return self.kl - self.estimated


@dataclass(frozen=True)
class Judged:
    over: int  # the window's requests over their bound, this one included
    audited: int  # the window's requests
    broke: bool  # the window broke the promise: the factor widened (unless at the cap) and the window starts over

    @property
    def share(self) -> float:
        return self.over / self.audited


class Margin:
    """The safety factor every fidelity estimate is multiplied by, and the window of audits that judges it."""

    def __init__(self, factor: float, window: int, promise: float, cap: float):
        self.factor, self.size, self.promise, self.cap = factor, window, promise, cap
        self.window: deque[Outcome] = deque(maxlen=window)

    def observe(self, outcome: Outcome) -> Judged:
        """Adds one audited request. The window breaks the promise once more than `promise` of `window` requests in
        it are over their bound: a window not yet full breaks it already when no later audit could bring it back.
        The factor then grows to what would have kept all but that share of the window within their bounds (each
        bound scaled with it: exact for a request without max_kl, whose bound is its own estimate), at least
        WIDEN_AT_LEAST times, at most to the cap; the window starts over, since it judged the old factor."""
        self.window.append(outcome)
        over, audited = sum(o.unsafe for o in self.window), len(self.window)
        allowed = math.floor(self.promise * self.size + 1e-9)  # 0.29 * 100 is 28.999999999999996
        if over <= allowed:
            return Judged(over, audited, False)
        needed = sorted((o.kl / o.bound for o in self.window), reverse=True)[allowed]
        self.factor = min(self.cap, self.factor * max(WIDEN_AT_LEAST, needed))
        self.window.clear()
        return Judged(over, audited, True)


def with_margin(model: Model, factor: float) -> Model:
    """`model` whose KL estimates are `factor` times its own: the factor's log added to its log-KL margin, so that
    fidelity.estimate (the report) and fidelity.smallest_ratio (a quality floor's rho) both read it."""
    return replace(model, margin=model.margin + math.log(factor))
