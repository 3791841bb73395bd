"""Two chunkcache servers behind SGLang's router with one shared store (examples/cluster.py), and a store outage
in the middle of a load of hinted requests."""

import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from conftest import ROOT, WORDS
from store_server import SECRET_ENV, StoreServer

from sglang_patch.serve.server_process import ServerProcess, free_ports

pytestmark = pytest.mark.slow


class Cluster:
    def __init__(self, tmp, store: StoreServer):
        self.port = free_ports(3)
        self.router = f"http://127.0.0.1:{self.port}"
        self.workers = [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(2)]
        config = tmp / "cluster.yaml"
        # a small KV pool: two servers share the 2-core CI box, where a busy core can also hold up a read of the
        # store for longer than the default timeout (the hit test would see a miss); a killed store is refused at
        # once whatever the timeout. A short retry so that the restart test is quick.
        config.write_text("serve:\n  max_total_tokens: 8192\nstore:\n  remote_timeout_s: 2.0\n  remote_retry_s: 1.0\n")
        self.log_dir = tmp / "logs"
        self.proc = ServerProcess(
            [sys.executable, str(ROOT / "examples" / "cluster.py"), "--remote-url", store.url, "--workers", "2",
             "--port", str(self.port), "--policy", "round_robin", "--config", str(config), "--log-dir",
             str(self.log_dir), "--enable-metrics", "--skip-server-warmup"],  # the rest goes to `chunkcache serve`
            url=self.router, log_path=tmp / "cluster.log", env=SECRET_ENV)  # the servers inherit the store's secret
        deadline = time.time() + 600
        while f"router {self.router}" not in self.proc.log():  # the script's "ready" line
            if not self.proc.alive() or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"cluster did not start: {tmp / 'cluster.log'}, {self.log_dir}")
            time.sleep(1)

    def stores(self) -> list[dict]:
        return [requests.get(w + "/server_info", timeout=30).json()["internal_states"][0]["chunkcache"]["store"]
                for w in self.workers]

    def drain(self) -> None:
        """Wait until no server has a put on its way to the store."""
        deadline = time.time() + 30
        while any(s["remote"]["pending"] for s in self.stores()):
            assert time.time() < deadline
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.stop(grace=90)  # on SIGTERM the script stops the router and the servers


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    srv = StoreServer(tmp_path_factory.mktemp("store"))
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, store):
    c = Cluster(tmp_path_factory.mktemp("cluster"), store)
    yield c
    c.stop()


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Document {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(50))
            + f". The code of document {seed}-{i} is {4000 + 7 * i + seed}." for i in range(n)]


def ask(url: str, docs: list[str], question: str) -> tuple[str, dict]:
    """A chat request with documents; through the router the `chunkcache` object rides in `chat_template_kwargs`,
    the one field the router forwards as arbitrary JSON (it drops `kv_hints` and unknown fields)."""
    r = requests.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0,
        "chat_template_kwargs": {"chunkcache": {"documents": docs, "selector": "none"}}})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["metadata"]["chunkcache"]


def test_chunks_computed_on_one_server_are_full_hits_on_the_other(cluster):
    docs = documents(3, seed=11)
    _, first = ask(cluster.router, docs, "What is the code of document 11-1?")
    assert (first["chunk_hits"], first["chunk_misses"]) == (0, 3)
    cluster.drain()
    reordered = [docs[2], docs[0], docs[1]]
    text, report = ask(cluster.router, reordered, "What is the code of document 11-2?")
    assert (report["chunk_hits"], report["chunk_misses"]) == (3, 0) and "fallback" not in report
    # round robin: one server computed and wrote the chunks, the other found all three in the shared store
    stores = cluster.stores()
    writer = next(i for i, s in enumerate(stores) if s["remote"]["writes"] == 3)
    reader = stores[1 - writer]
    assert (reader["remote_hits"], reader["remote"]["hits"], reader["remote"]["writes"]) == (3, 3, 0)
    # oracle: the server that computed the chunks, asked the same, reuses its own KV from memory; the store's copy
    # is the same bytes, so greedy decoding gives the same answer
    again, again_report = ask(cluster.workers[writer], reordered, "What is the code of document 11-2?")
    assert again_report["chunk_hits"] == 3 and cluster.stores()[writer]["remote_hits"] == 0
    assert again == text
    print(f"two servers behind the router: first use {first['chunk_misses']} misses on server {writer}, "
          f"then {report['chunk_hits']}/3 hits on server {1 - writer} ({reader['remote']['hits']} from the store)")


def test_store_outage_under_load_fails_no_request_and_hits_resume_after_restart(cluster, store):
    docs = documents(6, seed=12)
    orders = [[i % 6, (i + 1) % 6] for i in range(8)]
    before = sum(s["remote"]["errors"] for s in cluster.stores())
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, cluster.router, [docs[i] for i in o], f"What is the code of document 12-{o[1]}?")
                   for o in orders]
        while sum(f.done() for f in futures) < 2:
            time.sleep(0.05)
        store.kill()  # mid-load: requests in flight, puts queued
        reports = [f.result()[1] for f in futures]  # ask() asserts HTTP 200
    assert len(reports) == 8 and not any("fallback" in r for r in reports)
    stores = cluster.stores()
    errors = sum(s["remote"]["errors"] for s in stores) - before
    assert errors >= 1 and sum(s["remote"]["outages"] for s in stores) >= 1
    print(f"outage under load: {len(reports)} requests, all 200, no fallback; remote errors {errors}, "
          f"skipped {sum(s['remote']['skipped'] for s in stores)}")
    metrics = "".join(requests.get(w + "/metrics", timeout=30).text for w in cluster.workers)
    assert "chunkcache_remote_errors_total" in metrics and "chunkcache_remote_outages_total" in metrics

    store.start()  # same port, empty; chunkcache keeps running
    time.sleep(1.5)  # the servers' retry interval (remote_retry_s: 1.0)
    fresh = documents(2, seed=13)
    hits = sum(s["remote_hits"] for s in cluster.stores())
    _, first = ask(cluster.router, fresh, "What is the code of document 13-0?")
    assert first["chunk_misses"] == 2
    cluster.drain()
    assert store.client().dbsize() == 2
    _, second = ask(cluster.router, fresh[::-1], "What is the code of document 13-1?")
    assert second["chunk_hits"] == 2
    stores = cluster.stores()
    assert sum(s["remote_hits"] for s in stores) - hits == 2 and all(s["remote"]["up"] for s in stores)
