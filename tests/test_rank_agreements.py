"""Every decision a tensor-parallel rank takes from its own facts is agreed over the ranks: each case below runs in
two gloo processes whose facts differ (a drifted store, another clock, a failure on one rank, another estimator) and
asserts that both ranks take the same decision, the one-rank oracle's for the agreed facts. Removing the agreement a
case guards makes it fail or hang; a hang is bounded (`TIMEOUT_S`) and fails the case, so ranks with drifted state
never hang the suite. tests/test_ranks.py has the pipeline's lookup hits and selection; tests/test_tensor_parallel.py
runs SGLang's own engine with --tp-size 2."""

import socket
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_blend_pipeline import FP, CountingStore, FakeEngine, entry

pytestmark = pytest.mark.slow
TIMEOUT_S = 120


def gathered(value):
    """Every rank's `value`, in rank order."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, value)
    return parts


def lookup_positions(rank, ranks):
    """Lookup: an entry computed at another position on one rank is a miss on both (its K would move otherwise)."""
    from chunkcache.blend import pipeline
    from chunkcache.blend.plan import plan_request
    from test_ranks import RankLocal

    ids = torch.arange(3, 15)
    store = CountingStore()
    store.put(entry("x", ids[2:4], 2))
    store.put(entry("y", ids[4:6], 4 if rank == 0 else 7))
    plans = [plan_request(ids, [(2, 4), (4, 6)], ["x", "y"], 0, "rank-local", 0.1)]
    engine = FakeEngine(plans)
    run = pipeline.run(engine, store, plans, lambda name: RankLocal(seen=[]), ranks=ranks)
    assert engine.steps[0] == ("fill", ["y"]), engine.steps
    assert run.requests[0].hits == 1


def detection_positions(rank, ranks):
    """Detection: a segment one rank holds computed at another position is not found on either rank."""
    from chunkcache.blend import pipeline
    from chunkcache.blend.auto import AutoChunks
    from chunkcache.config import AutoConfig
    from chunkcache.store import ChunkEntry, ChunkStore

    auto = AutoChunks(AutoConfig(enabled=True, segment_min_tokens=8, segment_mean_tokens=1 << 20, min_reuse_tokens=8),
                      frozenset({0}), FP, head=[1])
    ids = torch.tensor([0] + list(range(10, 20)) + [0] + list(range(30, 40)) + [0, 99])
    segments = auto.segments(ids, "ns", None)
    store = ChunkStore(model_fingerprint=FP)
    kv = torch.zeros(2, 10, 1, 4)
    for i, (s, e) in enumerate(segments.spans):
        start = s if rank == 0 or i == 0 else s + 5
        store.put(ChunkEntry(segments.keys[i], ids[s:e], kv, kv, start, FP))
    found = pipeline.detect(store, auto, ids, segments, 0, pipeline.Defaults("epic", 0.15, "ns"), ranks=ranks)
    spans = None if found.hint is None else found.hint.spans
    assert gathered(spans) == [spans, spans]
    assert spans == (segments.spans[0],), spans


def learning(rank, ranks):
    """What a prompt teaches: a segment one rank holds is encoded by both; a store failing on one rank queues
    nothing on either (RanksFailed on both)."""
    from chunkcache.blend import pipeline
    from chunkcache.blend.auto import AutoChunks
    from chunkcache.blend.request import ChunkRequest
    from chunkcache.config import AutoConfig
    from chunkcache.ranks import RanksFailed
    from chunkcache.store import ChunkEntry, ChunkStore

    auto = AutoChunks(AutoConfig(enabled=True, segment_min_tokens=8, segment_mean_tokens=1 << 20), frozenset({0}), FP,
                      head=[1])
    ids = torch.tensor([0] + list(range(10, 20)) + [0] + list(range(30, 40)) + [0, 99])
    segments = auto.segments(ids, "ns", None)
    store = ChunkStore(model_fingerprint=FP)
    if rank == 1:
        s, e = segments.spans[0]
        store.put(ChunkEntry(segments.keys[0], ids[s:e], torch.zeros(2, e - s, 1, 4), torch.zeros(2, e - s, 1, 4), 1,
                             FP, tenant=segments.tenant, context=segments.contexts[0]))
    (encodes,) = pipeline.to_encode_many(store, auto, [(ChunkRequest("r", segments=segments), ids)], ranks=ranks)
    keys = [e.keys for e in encodes]
    assert gathered(keys) == [keys, keys] and len(keys) == 2, keys

    class Failing(ChunkStore):
        def __contains__(self, key):
            raise OSError("disk gone")

    broken = Failing(model_fingerprint=FP) if rank == 1 else ChunkStore(model_fingerprint=FP)
    with pytest.raises(RanksFailed, match="rank 1: OSError: disk gone"):
        pipeline.to_encode_many(broken, auto, [(ChunkRequest("r", segments=auto.segments(ids, "ns", None)), ids)],
                                ranks=ranks)


def idle_choice(rank, ranks):
    """The idle job: rank 0's choice over equal queues, the same job on both; a job failing on one rank is dropped by
    both; queues that differ (a bug) are emptied on both, and nothing runs."""
    from chunkcache.blend.idle import IdleWork

    ran = []
    work = IdleWork(ranks, {"deviation": 4, "encode": 4, "audit": 4})
    work.put("encode", lambda: ran.append("encode"))
    work.put("deviation", lambda: ran.append("deviation"))
    assert work.run_one() == ("deviation", True) and work.run_one() == ("encode", True)
    assert ran == ["deviation", "encode"]

    def fails_here():
        if rank == 1:
            raise RuntimeError("only on rank 1")
        return "done"

    work.put("encode", fails_here)
    work.put("audit", lambda: ran.append("audit"))
    assert work.run_one() is None  # dropped on both
    assert work.run_one() == ("audit", True) and ran[-1] == "audit"

    work.put("encode", lambda: ran.append("same"))
    if rank == 1:
        work.put("deviation", lambda: ran.append("drifted"))
    assert work.run_one() is None and work.waiting() == 0
    assert "drifted" not in ran and "same" not in ran


def idle_clock(rank, ranks):
    """The idle gate: rank 0's clock decides whether an idle job starts, so both ranks run it (the rank whose own
    clock says "busy" enters the job's collectives too)."""
    from sglang_patch.scheduler import server as glue

    from chunkcache.blend.idle import IdleWork
    from chunkcache.config import Config

    ran = []
    server = types.SimpleNamespace(reuse=types.SimpleNamespace(ranks=ranks, config=Config()),
                                   idle=IdleWork(ranks, {"deviation": 1}),
                                   last_forward=0.0 if rank == 0 else float("inf"))
    server.run_idle = server.idle.run_one
    server.idle.put("deviation", lambda: ran.append(ranks.agree(lambda: rank)))  # a collective, as a forward is
    scheduler = types.SimpleNamespace(tree_cache=types.SimpleNamespace(chunk_server=server), is_fully_idle=lambda: True)
    glue.on_idle(scheduler)
    assert ran == [0]


def carry(rank, ranks):
    """The exact prefix carried into the auto partition: a copy that fails on one rank is inserted on neither (each
    frees its slots), so the ranks' radix trees stay the same."""
    from sglang_patch.scheduler import auto_chunks

    tree = FakeTree(fail=rank == 1)
    req = types.SimpleNamespace(origin_input_ids=list(range(8)), extra_key="auto", cache_salt=None)
    if rank == 1:
        with pytest.raises(RuntimeError, match="copy failed"):
            auto_chunks.carry_exact_prefix(tree, req, "plain", ranks)
    else:
        assert auto_chunks.carry_exact_prefix(tree, req, "plain", ranks) == 0
    assert tree.inserted == [] and tree.free_slots == 16 and tree.locked == 0


class FakeTree:
    """A radix tree whose plain partition holds 6 tokens and auto partition 2, over a 16-slot pool."""

    def __init__(self, fail: bool):
        self.fail, self.inserted, self.free_slots, self.locked = fail, [], 16, 0
        self.token_to_kv_pool_allocator = self

    def supports_swa(self):
        return False

    def supports_mamba(self):
        return False

    def match_prefix(self, params):
        held = 6 if params.key.extra_key == "plain" else 2
        return types.SimpleNamespace(device_prefix_len=held, last_device_node=params.key.extra_key)

    def lock(self, node):
        self.locked += 1
        return node

    def unlock(self, node):
        self.locked -= 1

    def path_device_indices(self, node):
        return torch.arange(6 if node == "plain" else 2)

    def available_size(self):
        return self.free_slots

    def alloc(self, n):
        self.free_slots -= n
        return torch.arange(n) + 8

    def free(self, slots):
        self.free_slots += len(slots)

    def get_kvcache(self):
        if self.fail:
            raise RuntimeError("copy failed")
        return types.SimpleNamespace(layer_num=0)

    def insert(self, params):
        self.inserted.append(params)


def store_write_fails(rank, ranks):
    """A disk error while storing a computed chunk between the blend's forwards is that rank's alone: both ranks go on
    to the same recompute (nothing reads the write)."""
    from chunkcache.blend import pipeline
    from chunkcache.blend.plan import plan_request
    from test_ranks import RankLocal

    class Failing(CountingStore):
        def put(self, e):
            raise OSError("disk gone")

    ids = torch.arange(3, 15)
    store = Failing() if rank == 1 else CountingStore()
    plans = [plan_request(ids, [(2, 4), (4, 6)], ["x", "y"], 0, "rank-local", 0.1, context="p")]
    engine = FakeEngine(plans)
    run = pipeline.run(engine, store, plans, lambda name: RankLocal(seen=[]), ranks=ranks)
    assert engine.steps[-1] == ("recompute", [run.requests[0].recomputed.tolist()])
    assert gathered(engine.steps) == [engine.steps, engine.steps]


def blend_or_full(rank, ranks):
    """Blend or full: each rank's calibration of its own forwards differs; both take rank 0's prediction."""
    from sglang_patch.scheduler import blend as glue

    from chunkcache.blend.cost import Rates
    from chunkcache.blend.plan import plan_request
    from chunkcache.select import REGISTRY

    ids = torch.arange(3, 400)
    store = CountingStore()
    store.put(entry("x", ids[2:200], 2))
    store.put(entry("y", ids[200:390], 200))
    plan = plan_request(ids, [(2, 200), (200, 390)], ["x", "y"], 0, "epic", 0.15)
    calibration = types.SimpleNamespace(apply=lambda raw: f"as rank {rank} observed")
    reuse = types.SimpleNamespace(ranks=ranks, store=store, rates=Rates(1e-4, 1e-8, 1e-6), calibration=calibration,
                                  selector=lambda name: REGISTRY.create(name), layout=types.SimpleNamespace(num_layers=2),
                                  config=types.SimpleNamespace(select=types.SimpleNamespace(blend_margin=0.1)))
    ((raw, predicted),) = glue.priced(reuse, [plan])
    assert raw is not None and predicted == "as rank 0 observed"


def start_facts(rank, ranks):
    """At start: ranks whose fidelity estimator differs refuse to serve, on both ranks, naming it."""
    from sglang_patch.scheduler.server import ChunkServer
    from test_audit import model

    from chunkcache.config import Config

    reuse = types.SimpleNamespace(ranks=ranks, config=Config(), fidelity=model(), rates=None)
    ChunkServer(reuse).start(None)  # alike: served
    reuse.fidelity = model(margin=0.5) if rank == 1 else model()  # rank 1 read another calibrations file
    with pytest.raises(ValueError, match="fidelity estimator"):
        ChunkServer(reuse).start(None)


CASES = {f.__name__: f for f in (lookup_positions, detection_positions, learning, idle_choice, idle_clock, carry,
                                 store_write_fails, blend_or_full, start_facts)}


def _worker(rank: int, port: int, case: str) -> None:
    from chunkcache.ranks import Ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        CASES[case](rank, Ranks(dist.new_group(backend="gloo")))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_take_one_decision(case):
    context = mp.spawn(_worker, args=(_free_port(), case), nprocs=2, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0)):  # True once every rank ended; raises
            if time.monotonic() >= deadline:  # on a rank's failure
                pytest.fail(f"{case}: the ranks did not finish within {TIMEOUT_S} s (one waits in a collective)")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
