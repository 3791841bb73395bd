"""The tensor-parallel ranks of one serving model, over which every blend decision that fixes a forward's rows agrees.

Under tensor parallelism each rank runs the whole blend on its slice of the attention heads, and every forward
all-reduces rows between the ranks: the ranks must compute the same rows, token for token, or the reduced KV is
wrong (same row count, other tokens) or the collectives mismatch (another count: a crash or a hang). A decision
taken from rank-local facts (a rank's heads, its store, its clock, its exceptions) is therefore agreed here before
it reaches a forward:

  * `agree(local, combine)`: every rank computes its own part, the parts are gathered in rank order and combined
    the same way on every rank (`first`: rank 0's choice; `all_hold`: what every rank holds); `decide` keeps what a
    rank computed and shares only a summary of it. A rank whose part raised makes every rank raise `RanksFailed` at
    that point, so all take the same fallback;
  * `sum_(tensor)`: a per-head feature summed over the ranks' heads, so every rank scores with all of them;
  * `check_alike(facts)`: what every rank must start from alike (its config, fidelity estimator, host rates), by
    fingerprint: a difference stops every rank with a ValueError naming it.

Every call is a collective: every rank must make the same calls in the same order, which holds because SGLang's
schedulers are replicas of one state machine (rank 0 broadcasts the requests). One rank (`Ranks()`) agrees with
itself at no cost, and a local exception propagates as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T, S, R = TypeVar("T"), TypeVar("S"), TypeVar("R")


class RanksFailed(RuntimeError):
    """A rank's part of an agreed decision raised: raised on every rank, so all fall back together."""


class Ranks:
    def __init__(self, group: Any = None):
        """`group`: a torch.distributed process group on the CPU (gloo) holding the ranks; None: one rank."""
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    @property
    def many(self) -> bool:
        return self.size > 1

    def agree(self, local: Callable[[], T], combine: Callable[[list[T]], R] | None = None) -> R:
        """`combine` (default: `first`) of every rank's `local()`, the same value on every rank."""
        return self.decide(local, lambda part: part, combine)[1]

    def decide(self, local: Callable[[], T], share: Callable[[T], S],
               combine: Callable[[list[S]], R] | None = None) -> tuple[T, R]:
        """(this rank's `local()`, `combine` of every rank's `share(local())`): the ranks exchange only what they
        must agree on (a hit mask, not the entries it came from). A rank whose `local` raised makes every rank raise
        RanksFailed here; one rank raises its own exception."""
        combine = combine or first
        if not self.many:
            mine = local()
            return mine, combine([share(mine)])
        try:
            mine = local()
            part = (True, share(mine))
        except Exception as exc:  # noqa: BLE001 - carried to every rank, raised there as RanksFailed
            part = (False, f"{type(exc).__name__}: {exc}")
        parts: list = [None] * self.size
        dist.all_gather_object(parts, part, group=self.group)
        failed = [(r, detail) for r, (ok, detail) in enumerate(parts) if not ok]
        if failed:
            raise RanksFailed("; ".join(f"rank {r}: {detail}" for r, detail in failed))
        return mine, combine([shared for _, shared in parts])

    def check_alike(self, facts: Mapping[str, str]) -> None:
        """Refuses ranks that start from different facts: `facts` names each fact every rank must hold alike by a
        short fingerprint of it (the config's, chunkcache.config.Config.fingerprint; the fidelity estimator's,
        chunkcache.blend.fidelity.estimator_fingerprint; the host rates', chunkcache.blend.cost.rates_fingerprint).
        The ranks gather them; where one differs, or a rank lacks it, every rank raises the same ValueError naming
        each such fact and every rank's value, so all stop together instead of blending apart. A collective: every
        rank calls it with the same names, once it has its facts (one rank holds its facts alike at no cost)."""
        held = self.agree(lambda: dict(facts), list)
        unlike = [name for name in sorted(set().union(*held)) if len({part.get(name) for part in held}) > 1]
        if unlike:
            raise ValueError("chunkcache: tensor-parallel ranks differ in " + "; in ".join(
                f"{name}: " + ", ".join(f"rank {r} {part.get(name, 'missing')}" for r, part in enumerate(held))
                for name in unlike) + "; every rank must load the same (the same files and CHUNKCACHE_* variables "
                "on every node)")

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, in place (through the host: the group is the CPU one)."""
        if not self.many:
            return tensor
        host = tensor.detach().cpu() if tensor.device.type != "cpu" else tensor
        dist.all_reduce(host, op=dist.ReduceOp.SUM, group=self.group)
        if host is not tensor:
            tensor.copy_(host)
        return tensor


def first(parts: list[T]) -> T:
    """Rank 0's part: a choice only one rank should make (from its clock, its calibration, its float order)."""
    return parts[0]


def all_hold(parts: list[Sequence[bool]]) -> list[bool]:
    """Per item, whether every rank holds it (a chunk counts as stored only where every rank has its shard)."""
    return [all(held) for held in zip(*parts, strict=True)]
