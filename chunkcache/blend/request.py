"""One request's chunk reuse, from its arrival to its last prefill round: `ChunkRequest`, the only state a request
carries (the server attaches one to SGLang's `Req` when it is created; the reference blender makes one per call).

What the request is: its resolved `hint` (marked by the client, or found by automatic detection), or why it is
computed exactly (`exact`), and the prompt's `segments` still to learn. What happened to it: one report per prefill
round (`rounds`), each a dict the engine's glue serialises from the pipeline's records (chunkcache.blend.pipeline);
`report` is what the response carries. Stage names (`STAGES`) are the pipeline's, in the order a request meets them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..store import Lookup
from .auto import Segments
from .plan import RequestPlan, plan_request

# a request's stages in order; every report of seconds per stage (stages_s, the reference's timings) uses these names
STAGES = ("detect", "plan", "lookup", "fill", "learn", "copy", "features", "select", "recompute")


@dataclass(frozen=True)
class RequestHint:
    token_ids: torch.Tensor  # [N] int64, the prompt the hint was resolved against
    spans: tuple[tuple[int, int], ...]  # the chunks' token spans in the prompt (end exclusive)
    keys: tuple[str, ...]  # chunk-store key of each span
    selector: str
    ratio: float
    namespace: str
    auto: bool = False  # found by automatic chunk detection (chunkcache.blend.auto), not marked by the client
    max_kl: float | None = None  # the quality floor (RequestPlan.max_kl)
    kl_over: str = "answer"  # what it bounds (RequestPlan.kl_over)
    tenant: str = ""  # hashing.tenant_key the keys were made for
    context: str | None = None  # what every key names as its context, for a client's chunks (RequestPlan.context)

    def plan(self, matched: int) -> RequestPlan:
        """The blend plan of a prefill round that finds the prompt's first `matched` tokens already exact."""
        return plan_request(self.token_ids, self.spans, self.keys, matched, self.selector, self.ratio,
                            max_kl=self.max_kl, tenant=self.tenant, context=self.context, kl_over=self.kl_over)


@dataclass(frozen=True)
class Detection:
    """What automatic detection found for a prompt (chunkcache.blend.pipeline.detect)."""

    hint: RequestHint | None  # None: too few stored segments, served as stock
    found: Lookup  # the store's answer for the hint's chunks, reused by the blend's lookup
    looked_up: int  # segments looked up that end past the radix match (whole; their other forms not counted)
    seconds: float
    carried: int = 0  # exact prefix tokens the engine copied into the partition blended requests match in


@dataclass
class ChunkRequest:
    rid: str
    hint: RequestHint | None = None  # None: no chunks to blend (a plain request, an exact one, or a bad hint)
    exact: str | None = None  # why the model's own prefill computes it ("exact", "selector_full"), else None
    segments: Segments | None = None  # the prompt's segments, until its prefill has taught the store (auto on)
    learn: bool = True  # whether the prompt may teach the store (False: `exact`, `learn: false`, no tenant)
    detection: Detection | None = None  # automatic detection's answer, if it ran
    charged: int | None = None  # the tokens admission charged its prefill (None: SGLang's own charge)
    rounds: list[dict] = field(default_factory=list)  # one serialised report per prefill round
    # what the response carries: the last round's report, with all rounds listed when there were several, and a
    # round computed in full kept visible as the top-level `fallback` after a later round blends; None before any
    # round. Kept merged here (add_round, add_learned): the scheduler reads it on every output step
    report: dict | None = None
    _plan: RequestPlan | None = field(default=None, repr=False)

    def plan(self, matched: int) -> RequestPlan:
        """The blend plan for a round whose first `matched` tokens are exact, built once per match (admission and
        the blend ask for the same round)."""
        assert self.hint is not None, "only a hinted request has a plan"
        if self._plan is None or self._plan.matched != matched:
            self._plan = self.hint.plan(matched)
        return self._plan

    def prefetched(self) -> Lookup | None:
        """What detection already fetched for this request's chunks, handed over once (the blend then holds the
        entries; a later round looks them up again)."""
        d = self.detection
        if d is None or not d.found.entries:
            return None
        self.detection = replace(d, found=Lookup({}, frozenset(), frozenset()))
        return d.found

    def add_round(self, info: dict) -> None:
        self.rounds.append(info)
        self._merge()

    def add_learned(self, learned: dict) -> None:
        """The segments the request's prefill taught the store, added to its last round."""
        if self.rounds:
            self.rounds[-1]["learned"] = learned
            self._merge()

    def _merge(self) -> None:
        merged = dict(self.rounds[-1])
        if len(self.rounds) > 1:
            merged["rounds"] = list(self.rounds)
            full = next((r for r in self.rounds if "fallback" in r), None)
            if full is not None and "fallback" not in merged:
                merged["fallback"], merged["detail"] = full["fallback"], full["detail"]
        self.report = merged
