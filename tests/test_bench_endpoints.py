"""`chunkcache bench --base-url URL --stock-url URL`: the bench measures deployed servers and starts none. Every
server the project starts is a ServerProcess (tests/conftest.py relies on the same), so a ServerProcess that fails
on construction proves the bench started nothing; each record and the summary name the endpoint it came from."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from chunkbench import commands
from chunkbench.serving import closed_loop, servers
from chunkbench.workloads import WorkloadConfig
from sglang_patch.serve import server_process


@pytest.fixture
def no_server_starts(monkeypatch):
    """Any server start fails the test, naming the command."""
    def refuse(self, argv, *args, **kwargs):
        pytest.fail(f"the bench started a server: {' '.join(map(str, argv))[:200]}")

    monkeypatch.setattr(server_process.ServerProcess, "__init__", refuse)


@pytest.fixture
def fake_sglang():
    """An HTTP server answering /health, /model_info and /server_info as a `--no-chunk-reuse` server does (its
    chunkcache state names no backend)."""
    answers = {"/health": {}, "/model_info": {"model_path": "/models/m"},
               "/server_info": {"internal_states": [{"chunkcache": {"backend": None, "tree_cache": "RadixCache"}}]}}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answers[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def test_a_deployed_endpoint_is_checked_before_any_request(fake_sglang):
    stock = servers.deployed(fake_sglang, chunk_reuse=False)
    assert stock == servers.Endpoint(fake_sglang.rstrip("/"), "/models/m")
    with pytest.raises(ValueError, match="serves no chunk reuse"):
        servers.deployed(fake_sglang, chunk_reuse=True)
    with pytest.raises(ValueError, match="no healthy SGLang server answers there"):
        servers.deployed(f"http://127.0.0.1:{server_process.free_port()}", chunk_reuse=False)


def test_the_endpoint_flags_go_together_and_not_with_the_auto_workload(capsys):
    with pytest.raises(SystemExit) as exit_:
        commands.bench(["--base-url", "http://cc:30000"])
    assert exit_.value.code == 2 and "--base-url and --stock-url go together" in capsys.readouterr().err
    assert commands.bench(["--workload", "auto", "--base-url", "http://cc:30000"]) == 2
    assert "--workload auto starts servers" in capsys.readouterr().err


def test_closed_loop_sends_each_side_to_its_endpoint(tmp_path, monkeypatch, no_server_starts, default_model):
    """--mode closed with endpoints: blocks alternate between the two URLs, no floor is timed on this host, and the
    records and closed_loop.md name each side's endpoint."""
    urls = {"stock": "http://stock:1", "chunkcache": "http://cc:2"}
    blocks = []

    def fake_closed(url, requests, hints, max_new_tokens, clients, desc=""):
        blocks.append(url)
        return [{"request": r.id, "arrival_s": 0.0, "finish_s": 1.0, "ttft_s": 0.5, "output_tokens": max_new_tokens,
                 "prompt_tokens": len(r.prompt.input_ids), "cached_tokens": 0, "chunk_hits": 0, "chunk_misses": 0,
                 "report": None} for r in requests]

    monkeypatch.setattr(servers, "deployed", lambda url, chunk_reuse: servers.Endpoint(url, "m"))
    monkeypatch.setattr(closed_loop, "host_rates", lambda *a: pytest.fail("timed a floor for deployed servers"))
    monkeypatch.setattr(closed_loop, "warm", lambda url, requests, hinted: None)
    monkeypatch.setattr(closed_loop, "drain", lambda url: None)
    monkeypatch.setattr(closed_loop, "closed", fake_closed)
    config = closed_loop.ClosedConfig(workload=WorkloadConfig(requests=3, docs=2, words=20, pool=5), clients=(1,),
                                      requests=2, blocks=2, out=tmp_path, endpoints=urls)
    closed_loop.run(config)

    assert blocks == ["http://stock:1", "http://cc:2"] * 2
    records = [json.loads(line) for line in (tmp_path / closed_loop.RECORDS).read_text().splitlines()]
    assert {(r["side"], r["endpoint"]) for r in records} == {("stock", "http://stock:1"), ("chunkcache", "http://cc:2")}
    summary = (tmp_path / "closed_loop.md").read_text()
    assert ("Endpoints (deployed: not started by the bench): stock from `http://stock:1`; prophet@0.15 from "
            "`http://cc:2`") in summary
    assert not (tmp_path / closed_loop.HOST).exists() and "Floor at stock's rates" not in summary


@pytest.mark.slow
def test_bench_measures_a_deployed_server_and_starts_none(server, tmp_path, no_server_starts):
    """`bench --smoke` with both sides on the tests' live chunkcache server: the hinted side blends every request
    from the store, the stock side's unhinted requests are served as stock (no report, no chunk hit), and the
    summary says both came from that endpoint."""
    out = tmp_path / "bench"
    argv = ["--smoke", "--base-url", server.url, "--stock-url", server.url, "--out", str(out)]
    assert commands.bench(argv) == 0
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert {r["side"] for r in records} == {"stock", "chunkcache"}
    assert {r["endpoint"] for r in records} == {server.url}
    assert {r["phase"] for r in records} == {"sequential", "poisson@0.5"}
    for r in records:
        assert r["ttft_s"] > 0 and r["output_tokens"] > 0, r
    assert all(r["blended"] and r["chunk_hits"] > 0 for r in records if r["side"] == "chunkcache")
    assert all(not r["blended"] and r["chunk_hits"] == 0 for r in records if r["side"] == "stock")
    summary = (out / "summary.md").read_text()
    assert f"Endpoints (deployed: not started by the bench): stock, mix@0.15 from `{server.url}`" in summary
    assert "| stock |" in summary and "| mix@0.15 |" in summary and "nan" not in summary.lower()
    assert json.loads((out / "config.json").read_text())["endpoints"] == {"stock": server.url,
                                                                          "chunkcache": server.url}


@pytest.mark.slow
def test_rag_bench_measures_a_deployed_server_and_starts_none(server, tmp_path, no_server_starts):
    """`bench --workload rag` against the live server: the layout arm (the hinted and documents arms' oracle) goes
    to --stock-url, the others to --base-url, every row and the summary name that endpoint. Three passages from a
    pool of six: no measured prompt holds its passages in a warm-up request's order (with two of four, both did, and
    the radix tree held their whole prompt, leaving nothing to blend)."""
    out = tmp_path / "rag"
    argv = ["--workload", "rag", "--arms", "hinted,documents", "--sizes", "500:3", "--requests", "2", "--pool", "6",
            "--max-new-tokens", "4", "--base-url", server.url, "--stock-url", server.url, "--out", str(out)]
    assert commands.bench(argv) == 0
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert sorted(r["arm"] for r in rows) == ["documents", "documents", "hinted", "hinted", "layout", "layout"]
    assert {r["endpoint"] for r in rows} == {server.url}
    assert all(r["report"] and r["report"]["chunk_hits"] > 0 for r in rows if r["arm"] != "layout")
    summary = (out / "summary.txt").read_text()
    assert f"Endpoints: layout, hinted, documents from `{server.url}`" in summary
