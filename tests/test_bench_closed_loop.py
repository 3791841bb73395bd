"""The closed-loop summary's arithmetic on hand-computed records (no server): pooled throughput over the blocks'
wall time, TTFT percentiles, fallbacks counted from the raw report, ratios per client count, the table and plot."""

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from chunkbench import commands
from chunkbench.serving import closed_loop, closed_report, load, servers
from chunkbench.serving.http_client import Outcome, fell_back
from chunkbench.workloads import WorkloadConfig, chunk_warmup, fresh, items


def row(side, clients, block, arrival, finish, ttft, hits=0, misses=0, report=None, tokens=8):
    return {"side": side, "arm": "stock" if side == "stock" else "prophet@0.15", "clients": clients, "block": block,
            "arrival_s": arrival, "finish_s": finish, "ttft_s": ttft, "output_tokens": tokens, "prompt_tokens": 100,
            "chunk_hits": hits, "chunk_misses": misses, "report": report}


RECORDS = [
    # 2 clients, two blocks a side: stock blocks last 4 s and 6 s, chunkcache blocks 2 s and 3 s
    row("stock", 2, 0, 0.0, 3.0, 1.0), row("stock", 2, 0, 0.5, 4.0, 2.0),
    row("chunkcache", 2, 0, 0.0, 1.0, 0.5, hits=3, report={"chunk_hits": 3}),
    row("chunkcache", 2, 0, 0.2, 2.0, 0.7, hits=1, misses=2, report={"fallback": "chunked_prefill"}),
    row("stock", 2, 1, 0.0, 6.0, 3.0), row("stock", 2, 1, 1.0, 5.0, 4.0),
    row("chunkcache", 2, 1, 0.0, 3.0, 0.9, hits=2, misses=1, report={"rounds": [{}, {"fallback": "x"}]}),
    row("chunkcache", 2, 1, 1.0, 2.0, 1.1, hits=2, report={"fallbacks": []}),
]


def test_cell_pools_blocks_over_their_summed_wall_time():
    cells = closed_report.cells(RECORDS)
    stock, cc = cells[2]["stock"], cells[2]["chunkcache"]
    assert (stock.requests, stock.seconds, stock.output_tokens) == (4, 10.0, 32)
    assert stock.req_s == pytest.approx(0.4) and stock.tok_s == pytest.approx(3.2)
    assert cc.seconds == 5.0 and cc.req_s == pytest.approx(0.8)
    assert stock.ttft_p50 == pytest.approx(2.5) and stock.ttft_p90 == pytest.approx(3.7)  # numpy linear percentile
    assert (cc.fallbacks, cc.chunk_hits, cc.chunk_misses) == (2, 2.0, 0.75)
    assert closed_report.ratios(cells[2]) == pytest.approx((2.0, 0.8 / 2.5))


@pytest.mark.parametrize("report, expected", [
    (None, False), ({"chunk_hits": 2}, False), ({"fallback": "logprobs", "detail": "..."}, True),
    ({"fallbacks": ["selector"]}, True), ({"fallbacks": []}, False),
    ({"rounds": [{"chunk_hits": 1}]}, False), ({"rounds": [{"chunk_hits": 1}, {"fallback": "draft"}]}, True),
])
def test_fell_back(report, expected):
    assert fell_back(report) is expected


def test_markdown_and_plot(tmp_path: Path):
    config = closed_loop.ClosedConfig(workload=WorkloadConfig(docs=3, words=50), requests=2, blocks=2, clients=(2,),
                                      out=tmp_path)
    summary = closed_report.write(config, RECORDS)
    assert "| 2 | stock | 4 | 0.400 | 3.20 | 2.500 | 3.700 | 0 |" in summary
    assert "| 2 | prophet@0.15 | 4 | 0.800 | 6.40 | 0.800 | 1.040 | 2 | 2.00 | 0.75 | 2.000 | 0.320 |" in summary
    assert (tmp_path / "closed_loop.md").read_text() == summary
    assert (tmp_path / "closed_loop.png").read_bytes().startswith(b"\x89PNG")


def test_fresh_never_repeats_a_document_order():
    shuffled = WorkloadConfig("shuffled", requests=3, docs=2, words=5, pool=3)
    drawn = fresh(shuffled, items(shuffled), 6)  # all 6 orders of 2 out of 3 documents
    assert len({it.documents for it in drawn}) == 6 and len({it.id for it in drawn}) == 6
    with pytest.raises(ValueError, match="distinct document orders"):
        fresh(shuffled, items(shuffled), 7)
    rotated = WorkloadConfig("synthetic:single", requests=2, docs=3, words=20)
    assert len(fresh(rotated, items(rotated), 6)) == 6  # 3 rotations of 2 cases
    with pytest.raises(ValueError):
        fresh(rotated, items(rotated), 7)


def test_chunk_warmup_stores_every_document_and_blends_each_away_from_home():
    """A measured batch must find what selectors learn per chunk away from its home (mix's stored deviation) in
    place: every pool document is sent, and each sits after another document in some warm-up request."""
    pool = items(WorkloadConfig("shuffled", requests=1, docs=3, words=5, pool=7))
    warm = chunk_warmup(pool, 3)
    docs = set(pool[0].documents)
    assert {d for it in warm for d in it.documents} == docs and all(len(it.documents) <= 3 for it in warm)
    assert {d for it in warm for d in it.documents[1:]} == docs
    assert len({it.id for it in warm}) == len(warm) == 6  # groups of 3, 3, 1: each also in an order away from home


def test_closed_clients_take_the_next_request_when_theirs_finished(monkeypatch):
    """N clients over one queue: never more than N in flight, every request once, records in request order."""
    in_flight, peak, calls, lock = 0, 0, 0, threading.Lock()
    # the first three requests wait for each other: three clients are in flight at once however busy the host is
    # (a sleep of 10 ms did not make them overlap on a loaded 2-core one); with fewer clients the barrier breaks
    first_three = threading.Barrier(3, timeout=60)

    def generate(url, ids, max_new_tokens, hints, *, ignore_eos):
        nonlocal in_flight, peak, calls
        assert ignore_eos
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
            calls += 1
            wait = calls <= 3
        if wait:
            first_three.wait()
        with lock:
            in_flight -= 1
        return Outcome(0.005, 0.01, str(ids[0]), len(ids), max_new_tokens, 0, None)

    monkeypatch.setattr(load, "generate", generate)
    requests = [SimpleNamespace(id=f"r{i}", prompt=SimpleNamespace(input_ids=[i])) for i in range(9)]
    rows = load.closed("http://x", requests, lambda r: None, 4, clients=3)
    assert peak == 3 and [r["answer"] for r in rows] == [str(i) for i in range(9)]
    assert {r["client"] for r in rows} == {0, 1, 2} and all(r["output_tokens"] == 4 for r in rows)


def test_run_alternates_the_sides_on_two_live_servers_and_report_rerenders(tmp_path, monkeypatch, default_model):
    """closed_loop.run with stand-in servers and clients: both servers up before the first block, warmed once (the
    chunkcache side then drained of its deferred work), blocks stock, chunkcache, stock, ... per client count, a pair
    of blocks sharing its prompts, no prompt twice."""
    up, warmed, blocks, drained = [], [], [], []

    class FakeServer:
        def __init__(self, log_path, *, chunk_reuse, config, model):
            self.side = "chunkcache" if chunk_reuse else "stock"
            self.url = f"fake://{self.side}"

        def __enter__(self):
            up.append(self.side)
            return self

        def __exit__(self, *exc):
            up.remove(self.side)

    def fake_closed(url, requests, hints, max_new_tokens, clients, desc=""):
        assert up == ["stock", "chunkcache"] and len(warmed) == 2
        blocks.append((url, clients, [tuple(r.prompt.input_ids) for r in requests],
                       {hints(r) is None for r in requests}))
        return [{"request": r.id, "arrival_s": 0.0, "finish_s": 2.0, "ttft_s": 0.5, "output_tokens": max_new_tokens,
                 "prompt_tokens": len(r.prompt.input_ids), "cached_tokens": 0, "chunk_hits": 0, "chunk_misses": 0,
                 "report": None}
                for r in requests]

    monkeypatch.setattr(servers, "start_server", FakeServer)
    monkeypatch.setattr(closed_loop, "warm", lambda url, requests, hinted: warmed.append((url, hinted)))
    monkeypatch.setattr(closed_loop, "closed", fake_closed)
    monkeypatch.setattr(closed_loop, "drain", lambda url: drained.append((url, len(warmed))))
    config = closed_loop.ClosedConfig(workload=WorkloadConfig(requests=3, docs=2, words=20, pool=5), clients=(1, 2),
                                      requests=2, blocks=2, out=tmp_path)
    closed_loop.run(config)

    assert warmed == [("fake://stock", False), ("fake://chunkcache", True)] and up == []
    assert drained == [("fake://chunkcache", 2)]  # once, right after its warm-up
    assert [(url, clients) for url, clients, *_ in blocks] == [("fake://stock", 1), ("fake://chunkcache", 1)] * 2 + [
        ("fake://stock", 2), ("fake://chunkcache", 2)] * 2
    assert all(stock[2] == cc[2] for stock, cc in zip(blocks[::2], blocks[1::2]))  # a pair: the same prompts
    assert [b[3] for b in blocks] == [{True}, {False}] * 4  # hints on the chunkcache side only
    prompts = [p for b in blocks[::2] for p in b[2]]
    assert len(set(prompts)) == len(prompts) == 8
    summary = (tmp_path / "closed_loop.md").read_text()
    assert "| 2 | prophet@0.15 | 4 | 1.000 | 16.00 | 0.500 | 0.500 | 0 |" in summary
    (tmp_path / "closed_loop.md").unlink()
    assert commands.bench(["--report", str(tmp_path)]) == 0 and (tmp_path / "closed_loop.md").read_text() == summary


def test_the_floor_prices_each_request_at_stocks_own_rates_in_the_same_run():
    """By hand: stock's block is 1.11 s for two 10-token prompts, nothing cached: 2 x 55 causal pairs at 1 ms = 0.11 s
    of attention, so 1.0 s / 20 tokens = 50 ms per computed token. A blend recomputing 4 tokens that attend 30 pairs
    and copying 100 tokens of 64 B at 64 kB/s: 0.2 + 0.03 + 0.1 = 0.33 s; one computed in full from a 4-token radix
    hit: 6 x 50 ms + (110 - 20) / 2 pairs = 0.345 s. Floor 2 / 0.675 req/s; chunkcache's block took 1 s."""
    host = {"shape": {"layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 4, "dtype": "float32"}, "pair_s": 1e-3,
            "copy_bytes_s": 64e3}
    blend = {"recomputed_tokens": 4, "attended_pairs": 30, "reused_tokens": 100}
    records = [dict(row("stock", 1, 0, 0.0, 0.5, 0.1), prompt_tokens=10, cached_tokens=0),
               dict(row("stock", 1, 0, 0.5, 1.11, 0.1), prompt_tokens=10, cached_tokens=0),
               dict(row("chunkcache", 1, 0, 0.0, 0.4, 0.1, report=blend), prompt_tokens=10, cached_tokens=0,
                    recomputed_tokens=4, reused_tokens=100),
               dict(row("chunkcache", 1, 0, 0.4, 1.0, 0.1, report={"fallback": "predicted_slower"}),
                    prompt_tokens=10, cached_tokens=4, recomputed_tokens=0, reused_tokens=0)]
    line = closed_report.floor_lines(records, host)[-1]
    assert line == f"| 1 | 0.555 | 10% | 50.000 ms | {2 / 0.675:.3f} | 2.000 | **{2 / (2 / 0.675):.2f}** |"
