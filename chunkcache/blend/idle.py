"""The server's one queue of idle work: what requests left to do after they were served, run while nothing waits.

Three kinds of job, run in this order when several wait (`KINDS`):
  * "deviation": a chunk deviation a blend estimated, measured (chunkcache.blend.features.DeviationJob);
  * "encode": a paragraph a prompt taught, encoded alone after the canonical head and stored (auto detection);
  * "audit": a sampled blended request's prompt recomputed in full and judged against what it was served.
Each kind keeps at most its bound of jobs (the oldest dropped past it: its work is queued again by the next request
that needs it); a job whose `key` already waits is not queued twice. Every job keeps only what it needs to run (for a
forward: sglang_patch.forward.forward_pass.Aside, the model runner and a one-row template of its batch), never the
batch's engine.

One failure rule: a job that raises is logged and dropped (its work is redone by the next request that needs it);
nothing of it reaches a request.

A job runs a step at a time: `run` may return a generator, each step of which is one forward of at most
idle.slice_tokens tokens (sglang_patch.forward.forward_pass.Aside), and it stays at the head of its queue until its
last step; a started job goes on before any other starts. `run_one` runs one step, so a request that arrives while a
job is under way waits for one slice of it at most, then is served before the next step.

Under tensor parallelism a job's forward is a collective every rank must enter with the same inputs. The queues are
equal by construction: only decisions every rank took alike enqueue (a blend's agreed selections, a prompt's agreed
paragraphs, never a rank's own exception), so `run_one` takes rank 0's choice and checks that every rank's queue
offers the same job; one that does not (a bug) empties every rank's queue, so no rank waits in a forward another never
enters. A step's failure is agreed too (chunkcache.ranks: RanksFailed on every rank), so all drop the job together;
the slicing is a function of the job's prompt alone, so every rank's steps are the same forwards.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Generator, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from ..ranks import Ranks, RanksFailed

log = logging.getLogger(__name__)
T = TypeVar("T")
KINDS = ("deviation", "encode", "audit")  # the order in which waiting kinds run


class QueuesDiffer(RuntimeError):
    """The ranks' idle queues offered different jobs: a decision that enqueued was not agreed."""


@dataclass
class Job:
    kind: str
    run: Callable[[], object]  # the work: done when it returns, or a generator of its steps
    key: Hashable  # what it works on: a job whose key already waits is not queued twice
    queued: float  # when it was queued (the queue's clock)
    seq: int  # its place in the order of everything this queue took (the same on every rank)
    tenant: str = ""  # hashing.tenant_key of the tenant whose entries it stores ("": none), which a purge drops
    steps: Iterator | None = None  # once started: its remaining steps

    def step(self) -> bool:
        """One step; whether the job is done."""
        if self.steps is None:
            made = self.run()
            if not inspect.isgenerator(made):
                return True
            self.steps = made
        try:
            next(self.steps)
        except StopIteration:
            return True
        return False


@dataclass
class IdleWork:
    ranks: Ranks
    bounds: Mapping[str, int]  # per kind, the jobs kept at most
    clock: Callable[[], float] = time.monotonic
    _queues: dict[str, deque[Job]] = field(init=False)
    _seq: itertools.count = field(init=False, default_factory=itertools.count)

    def __post_init__(self):
        unknown = set(self.bounds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown idle job kinds {sorted(unknown)}; known: {KINDS}")
        self._queues = {kind: deque(maxlen=max(self.bounds.get(kind, 0), 0)) for kind in KINDS}

    def put(self, kind: str, run: Callable[[], object], key: Hashable = None, tenant: str = "") -> bool:
        """Queue `run` as a `kind` job (`tenant`: whose entries it stores); False when a job of the same kind and key
        already waits or the kind keeps none. The oldest job of the kind is dropped when it is full."""
        queue = self._queues[kind]
        if queue.maxlen == 0 or (key is not None and any(j.key == key for j in queue)):
            return False
        queue.append(Job(kind, run, key, self.clock(), next(self._seq), tenant))
        return True

    def drop(self, kinds: tuple[str, ...], tenant: str | None = None) -> int:
        """Remove the waiting jobs of `kinds` (of `tenant` only, when given), a started one too, and say how many:
        what they would store was flushed or purged. The same on every rank, whose queues are equal."""
        n = 0
        for kind in kinds:
            queue = self._queues[kind]
            kept = [job for job in queue if tenant is not None and job.tenant != tenant]
            n += len(queue) - len(kept)
            queue.clear()
            queue.extend(kept)
        return n

    def waiting(self, kind: str | None = None) -> int:
        return sum(len(self._queues[k]) for k in KINDS) if kind is None else len(self._queues[kind])

    def waited(self, kind: str) -> float:
        """Seconds the oldest `kind` job has waited (0 when none waits), by this rank's clock."""
        queue = self._queues[kind]
        return self.clock() - queue[0].queued if queue else 0.0

    def run_one(self, kinds: tuple[str, ...] = KINDS) -> tuple[str, bool] | None:
        """One step of the first waiting job of the first of `kinds` that has one: (its kind, whether it is done),
        or None when none waits or it failed. Under tensor parallelism every rank must call it at the same point (the
        caller's gate is agreed) and runs the same step."""
        heads = [self._queues[k][0] for k in kinds if self._queues[k]]
        # a started job first (it holds what its earlier steps computed), else the first kind's oldest
        head = next((j for j in heads if j.steps is not None), heads[0] if heads else None)
        try:
            chosen = self.ranks.agree(lambda: None if head is None else (head.kind, head.seq), _same)
        except (QueuesDiffer, RanksFailed) as exc:
            dropped = self.waiting()
            for queue in self._queues.values():
                queue.clear()
            log.error("chunkcache: the ranks' idle queues differ (%s): every rank drops its %d waiting jobs", exc,
                      dropped)
            return None
        if chosen is None:
            return None
        queue = self._queues[head.kind]
        try:
            done = self.ranks.decide(head.step, lambda _: None)[0]  # only a failure is shared
        except Exception:  # noqa: BLE001 - idle work only ever improves later requests: never the server's failure
            queue.popleft()
            log.exception("chunkcache: an idle %s job failed on %s; it is dropped", head.kind,
                          f"rank {self.ranks.rank}" if self.ranks.many else "this server")
            return None
        if done:
            queue.popleft()
        return head.kind, done

    def state(self) -> dict[str, int]:
        """Jobs waiting per kind (/server_info)."""
        return {kind: len(queue) for kind, queue in self._queues.items()}


def run_through(steps: Generator[None, None, T]) -> T:
    """Every step of `steps` at once: its value (a job's work where nothing waits to be served between steps)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def timed(steps: Generator[None, None, T]) -> Generator[None, None, tuple[T, float]]:
    """`steps`, passed on step by step; returns (its value, the seconds its steps took, not counting the time
    between them)."""
    seconds = 0.0
    while True:
        t0 = time.perf_counter()
        try:
            next(steps)
        except StopIteration as done:
            return done.value, seconds + time.perf_counter() - t0
        seconds += time.perf_counter() - t0
        yield


def _same(parts: list) -> object:
    """The one job every rank's queue offers."""
    if any(p != parts[0] for p in parts):
        raise QueuesDiffer(", ".join(f"rank {r}: {p}" for r, p in enumerate(parts)))
    return parts[0]
