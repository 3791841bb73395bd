"""chunkcache.ranks in two gloo processes: every decision a rank takes from its own facts (its store, its features'
float order, its exceptions) comes out the same on both ranks, through the blend pipeline itself (the engine and
selector are stand-ins; tests/test_tensor_parallel.py runs SGLang's own engine with --tp-size 2)."""

import socket
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_blend_pipeline import FP, CountingStore, FakeEngine, entry

from chunkcache.blend import fidelity, pipeline
from chunkcache.blend.cost import Rates, rates_fingerprint
from chunkcache.blend.plan import plan_request
from chunkcache.config import Config
from chunkcache.ranks import Ranks, RanksFailed, all_hold
from chunkcache.select.base import Selection, finish


@dataclass
class RankLocal:
    """Picks another token on each rank and reports the features it sees (as a selector scoring this rank's heads
    alone would); raises on the rank named by `fail_on`."""

    name: ClassVar[str] = "rank-local"
    needs: ClassVar[tuple] = ()
    fail_on: int | None = None
    seen: list = None

    def select(self, layout, ratio, features) -> Selection:
        if dist.get_rank() == self.fail_on:
            raise RuntimeError("selector broke")
        self.seen.append(sorted(features.chunk_features(0)))
        s, _ = layout.chunk_spans[0]
        return finish(layout, torch.tensor([s + dist.get_rank()]), None)


def _worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ranks = Ranks(dist.new_group(backend="gloo"))
    assert (ranks.rank, ranks.size, ranks.many) == (rank, 2, True)

    # agree: rank 0's choice, what both hold, and one rank's failure raised on both
    assert ranks.agree(lambda: f"rank {rank}") == "rank 0"
    assert ranks.agree(lambda: [True, rank == 0, rank == 1], all_hold) == [True, False, False]
    with pytest.raises(RanksFailed, match="rank 1: ValueError: only here"):
        ranks.agree(lambda: (_ for _ in ()).throw(ValueError("only here")) if rank == 1 else 1)
    assert ranks.sum_(torch.tensor([1.0 + rank, 2.0])).tolist() == [3.0, 4.0]

    # check_alike: facts held alike pass; one that differs, or that a rank lacks, stops both ranks, named
    ranks.check_alike({"config": "ab12", "rates": "none"})
    with pytest.raises(ValueError, match=r"differ in config: rank 0 ab12, rank 1 cd34; every rank must load"):
        ranks.check_alike({"config": "ab12" if rank == 0 else "cd34", "rates": "none"})
    with pytest.raises(ValueError, match=r"in estimator: rank 0 missing, rank 1 ef56; in rates: rank 0 none, rank 1 "):
        ranks.check_alike({"config": "ab12", "rates": "none"} if rank == 0 else
                          {"config": "ab12", "estimator": "ef56", "rates": "9a"})

    # the pipeline: rank 1's store lacks "y" and rank 0's "x" remembers a feature rank 1's does not
    ids = torch.arange(3, 15)
    store = CountingStore()
    store.put(entry("x", ids[2:4], 2))
    if rank == 0:
        store.put(entry("y", ids[4:6], 4))
        store.add_features("x", {"deviation": torch.ones(2)})
    plans = [plan_request(ids, [(2, 4), (4, 6)], ["x", "y"], 0, "rank-local", 0.1)]
    engine, seen = FakeEngine(plans), []
    run = pipeline.run(engine, store, plans, lambda name: RankLocal(seen=seen), ranks=ranks)
    assert engine.steps[0] == ("fill", ["y"]), engine.steps  # both ranks compute it: one forward, same rows
    assert run.requests[0].hits == 1
    assert seen == [[]]  # a feature one rank lacks is unknown to both
    assert run.requests[0].recomputed.tolist() == [2, 6, 7, 8, 9, 10, 11]  # rank 0's pick on both
    assert engine.steps[-1] == ("recompute", [[2, 6, 7, 8, 9, 10, 11]])

    # a selection that fails on one rank fails on both, before the recompute
    engine = FakeEngine(plans)
    with pytest.raises(RanksFailed, match="rank 1: RuntimeError: selector broke"):
        pipeline.run(engine, store, plans, lambda name: RankLocal(fail_on=1, seen=[]), ranks=ranks)
    assert "recompute" not in [s[0] for s in engine.steps]
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_agree_on_every_decision_the_pipeline_takes():
    mp.spawn(_worker, args=(_free_port(),), nprocs=2, join=True)


def test_one_rank_agrees_with_itself_and_raises_its_own_errors():
    ranks = Ranks()
    assert not ranks.many and ranks.agree(lambda: 5) == 5 and ranks.agree(lambda: [True], all_hold) == [True]
    with pytest.raises(ValueError):
        ranks.agree(lambda: int("x"))
    t = torch.ones(2)
    assert ranks.sum_(t) is t
    ranks.check_alike({"config": "ab12"})


def test_the_facts_ranks_compare_fingerprint_what_every_rank_must_hold_alike():
    """The config's fingerprint leaves out the disk directory each rank writes (the scheduler appends tpXofY) but
    not whether there is one, nor any other knob; the estimator's and the rates' follow their numbers."""
    config = Config()
    assert config.fingerprint() == Config().fingerprint() and len(config.fingerprint()) == 16
    config.store.disk_dir = "/cache/tp0of2"
    other_rank = Config()
    other_rank.store.disk_dir = "/cache/tp1of2"
    assert config.fingerprint() == other_rank.fingerprint() != Config().fingerprint()
    other_rank.select.ratio = config.select.ratio / 2
    assert other_rank.fingerprint() != config.fingerprint()

    shipped = fidelity.load().model()
    assert fidelity.estimator_fingerprint(None) == "none"
    assert fidelity.estimator_fingerprint(shipped) == fidelity.estimator_fingerprint(replace(shipped))
    moved = replace(shipped, margin=shipped.margin + 1e-9)
    assert fidelity.estimator_fingerprint(moved) != fidelity.estimator_fingerprint(shipped)
    assert rates_fingerprint(None) == "none"
    assert rates_fingerprint(Rates(1e-4, 1e-9, 1e-7)) == rates_fingerprint(Rates(1e-4, 1e-9, 1e-7))
    assert rates_fingerprint(Rates(1e-4, 1e-9, 1e-7)) != rates_fingerprint(Rates(1e-4, 2e-9, 1e-7))
