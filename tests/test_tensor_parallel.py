"""Chunk reuse under tensor parallelism: SGLang's CPU engine with --tp-size 2 over gloo, on a tiny random-weight
model whose heads split evenly, against the same model on one rank. The oracle is the one-rank server: with every
decision that fixes a forward's rows agreed over the ranks and the selection features reduced over all heads, two
ranks blend as one does (a rank that picked other tokens than its peer would all-reduce rows of different tokens).

Each server runs the same script (`_serve`): every selector on three prompts, then a chunk one rank's store lost
(rank drift), then unmarked prompts found by automatic detection, then the deviations mix estimated, measured by the
idle scheduler. Stores are disk-only (host tier off), so the test can read and change what each rank holds."""

import json
import time

import pytest
import torch
import transformers
from conftest import Rag, gen, hints, sglang_engine

from chunkcache.hashing import chunk_key, model_fingerprint, prefix_key, shard_fingerprint
from chunkcache.models import tiny_model
from chunkcache.store import ChunkStore

pytestmark = pytest.mark.slow
SELECTORS = ["epic", "prophet", "cacheblend", "mix"]
ORDERS = ([1, 4, 3, 2], [4, 0, 2, 3], [3, 2, 4, 0])  # documents of each prompt
PROMPTS = len(ORDERS)
DEVIATION = "deviation@"  # the prefix of a remembered deviation's feature name (chunkcache.blend.features)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.1, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def rag(default_model):
    return Rag(transformers.AutoTokenizer.from_pretrained(default_model), n_docs=5, words=60)


@pytest.fixture(scope="module")
def prompts(rag):
    return [rag.build(order, f"What is the code of document {order[1]}?") for order in ORDERS]


class RankStores:
    """What each rank's disk tier holds, read and changed from outside the server."""

    def __init__(self, root, model, tp_size):
        self.dirs = [root / f"tp{r}of{tp_size}" for r in range(tp_size)] if tp_size > 1 else [root]
        base = model_fingerprint(model)
        self.fingerprints = [shard_fingerprint(base, r, tp_size) for r in range(tp_size)]

    def key(self, rank, namespace, ids, spans, i):
        """Chunk i's key on `rank` (its KV computed after the prompt's shared prefix)."""
        s, e = spans[i]
        return chunk_key(self.fingerprints[rank], namespace, prefix_key(ids[: spans[0][0]]), ids[s:e])

    def entry(self, rank, namespace, ids, spans, i):
        return ChunkStore(host_bytes=0, disk_dir=str(self.dirs[rank])).get(self.key(rank, namespace, ids, spans, i))

    def drop(self, rank, namespace, ids, spans, i):
        store = ChunkStore(host_bytes=0, disk_dir=str(self.dirs[rank]))
        path = store.disk.path(self.key(rank, namespace, ids, spans, i))
        assert path.is_file(), path
        path.unlink()

    def deviations(self, namespace, ids, spans):
        """Per rank, each chunk's remembered deviations (None until the idle scheduler measured it)."""
        out = []
        for rank in range(len(self.dirs)):
            entries = [self.entry(rank, namespace, ids, spans, i) for i in range(len(spans))]
            out.append([None if e is None else {k: v for k, v in e.features.items() if k.startswith(DEVIATION)}
                        or None for e in entries])
        return out


def _serve(model, rag, prompts, tmp_path_factory, tp_size):
    store_dir = tmp_path_factory.mktemp(f"store-tp{tp_size}")
    config = (f"select:\n  ratio: 0.15\nstore:\n  host_bytes: 0\n  compress: none\n  disk_dir: {store_dir}\n"
              f"auto:\n  enabled: true\n  admit_after: 1\n  min_reuse_tokens: 32\n")
    stores, out = RankStores(store_dir, model, tp_size), {}
    with sglang_engine(model, tmp_path_factory.mktemp(f"cfg-tp{tp_size}"), config, max_total_tokens=4000,
                       dtype="float32", tp_size=tp_size, watchdog_timeout=60) as engine:
        for k, (ids, spans) in enumerate(prompts):
            out["stock", k] = gen(engine, ids, hints(spans, exact=True, namespace=f"exact-{k}"))
            for selector in SELECTORS:
                out[selector, k] = gen(engine, ids, hints(spans, selector=selector, namespace=f"{selector}-{k}"))
            out["full", k] = gen(engine, ids, hints(spans, selector="epic", ratio=1.0, namespace=f"full-{k}"))
        # rank drift: the last rank's store loses a chunk the others keep (on one rank: a plain miss); then the
        # first prompt's documents in another order
        (ids, spans), (again, again_spans) = prompts[0], rag.build([3, 4, 2, 1], "Which code comes first?")
        stores.drop(tp_size - 1, "epic-0", ids, spans, ORDERS[0].index(4))
        out["drift"] = gen(engine, again, hints(again_spans, selector="epic", namespace="epic-0"))
        # automatic detection: an unmarked prompt teaches the default tenant its paragraphs, the idle scheduler
        # encodes them (a forward of every rank each), then the same documents in another order are found; every
        # request waits for the encodes the one before it queued, so both servers hold the same entries
        from chunkbench.serving.http_client import wait_measured

        for k, (taught, order) in enumerate((([0, 2, 4], [4, 2, 0]), ([4, 3, 1], [1, 3, 4]))):
            wait_measured(engine.get_server_info, 300)
            gen(engine, rag.build(taught, "Which code comes first?")[0])
            wait_measured(engine.get_server_info, 300)
            out["auto", k] = gen(engine, rag.build(order, f"What is the code of document {order[0]}?")[0])
        # the deviations mix estimated on its first reuses, measured by the idle scheduler (a forward of every rank)
        deadline = time.monotonic() + 120
        while True:
            remembered = stores.deviations("mix-0", *prompts[0])
            if all(d is not None for rank in remembered for d in rank[1:]) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        out["remembered"] = remembered
        out["after"] = gen(engine, ids, hints(spans, selector="mix", namespace="mix-0"))  # served after measuring
    return out


@pytest.fixture(scope="module")
def served(model, rag, prompts, tmp_path_factory):
    return {tp: _serve(model, rag, prompts, tmp_path_factory, tp) for tp in (2, 1)}


def report(answer):
    return answer["meta_info"]["chunkcache"]


def test_a_blend_recomputing_every_token_on_two_ranks_equals_stock_on_two_ranks(served):
    two = served[2]
    for k in range(PROMPTS):
        assert report(two["stock", k])["reason"] == "exact"  # SGLang's own prefill
        info = report(two["full", k])
        assert "fallback" not in info and info["reused_tokens"] == 0, info
        assert two["full", k]["output_ids"] == two["stock", k]["output_ids"], k
    assert len({json.dumps(two["stock", k]["output_ids"]) for k in range(PROMPTS)}) > 1  # answers differ


@pytest.mark.parametrize("selector", SELECTORS)
def test_two_ranks_blend_as_one_rank_does(served, prompts, selector):
    """The same count of tokens recomputed and reused, and the same greedy answer as the one-rank server."""
    for k in range(PROMPTS):
        one, two = served[1][selector, k], served[2][selector, k]
        info1, info2 = report(one), report(two)
        assert "fallback" not in info2 and info2["selector"] == selector, info2
        assert 0 < info2["recomputed_tokens"] < len(prompts[k][0]), info2
        for field in ("recomputed_tokens", "reused_tokens", "chunk_hits", "ratio"):
            assert info2[field] == info1[field], (field, info1, info2)
        assert two["output_ids"] == one["output_ids"], (selector, k)


def test_a_chunk_one_rank_lost_is_computed_by_every_rank(served):
    """Rank 0 still holds the chunk, rank 1 does not: both compute it (rank 0 reports the miss), as one rank does
    whose store lost it."""
    one, two = served[1]["drift"], served[2]["drift"]
    assert "fallback" not in report(two) and report(two)["chunk_misses"] == 1, report(two)
    assert report(two)["chunk_hits"] == report(one)["chunk_hits"] == 3
    assert two["output_ids"] == one["output_ids"]


def test_automatic_detection_on_two_ranks_finds_and_blends_as_one_rank_does(served):
    for k in range(2):
        one, two = served[1]["auto", k], served[2]["auto", k]
        assert report(two).get("auto") and "fallback" not in report(two), report(two)
        assert report(one)["chunk_hits"] >= 3, report(one)  # every document was taught before
        for field in ("chunk_hits", "reused_tokens", "recomputed_tokens"):
            assert report(two)[field] == report(one)[field], (field, report(one), report(two))
        assert two["output_ids"] == one["output_ids"], k


def test_the_idle_measurement_runs_on_every_rank_and_remembers_the_deviation_over_all_heads(served):
    """Each rank measures its own heads; both remember the norm over all four (the same tensor on both), which is
    the one-rank server's up to float32 rounding; the server keeps serving after it (no rank left waiting)."""
    two, one = served[2]["remembered"], served[1]["remembered"][0]
    for rank0, rank1, single in zip(two[0][1:], two[1][1:], one[1:]):  # the first chunk sits at home: exact
        assert rank0 is not None and rank1 is not None and single is not None, (rank0, rank1, single)
        assert rank0.keys() == rank1.keys() == single.keys()
        for name in rank0:
            assert torch.equal(rank0[name], rank1[name]), name
            assert torch.allclose(rank0[name], single[name], rtol=1e-3, atol=1e-5), name
    assert served[2]["after"]["output_ids"] == served[1]["after"]["output_ids"]


def test_sglangs_own_command_with_pipeline_parallelism_stops_at_start_with_the_reason(model, tmp_path):
    """The scheduler's radix-cache factory refuses it (`chunkcache serve` refuses it before launching:
    tests/test_launcher.py)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
                           "--radix-cache-backend", "chunkcache", "--pp-size", "2", "--max-total-tokens", "2000",
                           "--port", "0"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          start_new_session=True)
    assert proc.returncode != 0
    assert "chunk reuse cannot be served with pipeline parallelism (--pp-size)" in proc.stderr, proc.stderr[-3000:]
