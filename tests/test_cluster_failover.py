"""Two chunkcache servers behind SGLang's router (examples/cluster.py, tests/test_cluster.py) sharing a Valkey Cluster
of 3 primaries with a replica each (chunkbench/serving/valkey_cluster.py): a chunk one server computed is a hit on
the other, and a primary SIGKILLed in the middle of 8 requests fails none of them and changes no answer; hits resume
once its replica takes over, with no server restarted."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from test_cluster import Cluster, documents

from chunkbench.serving.valkey_cluster import ValkeyCluster, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def valkey(tmp_path_factory):
    # the killed primary's replica takes over at valkey.promote below: the late requests read before it does
    c = ValkeyCluster(tmp_path_factory.mktemp("valkey"), auto_failover=False)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, valkey):
    c = Cluster(tmp_path_factory.mktemp("servers"), valkey)  # the servers' remote tier: valkey.url, redis+cluster://
    yield c
    c.stop()


def ask(url: str, docs: list[str], question: str, selector: str = "none", ratio: float | None = None
        ) -> tuple[str, dict]:
    """A chat request with documents, `chunkcache` in `chat_template_kwargs` (what the router forwards)."""
    options = {"documents": docs, "selector": selector, **({} if ratio is None else {"ratio": ratio})}
    r = requests.post(url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0,
        "chat_template_kwargs": {"chunkcache": options}})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["metadata"]["chunkcache"]


def test_chunks_computed_on_one_server_are_hits_on_the_other_through_the_cluster(servers, valkey):
    docs = documents(3, seed=21)
    _, first = ask(servers.router, docs, "What is the code of document 21-1?")
    assert (first["chunk_hits"], first["chunk_misses"]) == (0, 3)
    servers.drain()
    _, report = ask(servers.router, [docs[2], docs[0], docs[1]], "What is the code of document 21-2?")
    assert (report["chunk_hits"], report["chunk_misses"]) == (3, 0) and "fallback" not in report
    stores = servers.stores()
    reader = next(s for s in stores if s["remote"]["writes"] == 0)  # round robin: the server that wrote nothing
    assert reader["remote_hits"] == reader["remote"]["hits"] == 3
    primaries = {node.name for node in valkey.primaries()}
    for store in stores:  # every server lists the cluster's primaries, each serving and up
        assert {n["node"] for n in store["remote"]["nodes"] if n["serving"] and n["up"]} == primaries


def test_a_primary_killed_under_load_fails_no_request_and_hits_resume_after_failover(servers, valkey):
    early, late = documents(12, seed=22), documents(12, seed=23)
    # 8 requests: 6 of two early documents each, then 2 of six late ones each, which start after the kill below
    loads = [([early[2 * i], early[2 * i + 1]], f"What is the code of document 22-{2 * i}?") for i in range(6)]
    loads += [(late[6 * i:6 * i + 6], f"What is the code of document 23-{6 * i + 1}?") for i in range(2)]
    # server A computes every chunk and writes it to the cluster; a blend at ratio 1 recomputes every token, so its
    # answers are stock's, and so must server B's be, whatever the cluster holds, returns or fails to return
    a, b = servers.workers
    expected = [ask(a, docs, question, "epic", 1.0)[0] for docs, question in loads]
    servers.drain()
    for primary in valkey.primaries():  # the replicas hold what was written (replication is asynchronous)
        replica = valkey.replica_of(primary)
        wait_until("replicas caught up", lambda: replica.client().dbsize() == primary.client().dbsize())
    victim = max(valkey.primaries(), key=lambda n: n.client().dbsize())  # the primary holding most chunks
    replica = valkey.replica_of(victim)

    with ThreadPoolExecutor(4) as pool:  # server B has none of these chunks in memory: it asks the cluster
        futures = [pool.submit(ask, b, docs, question, "epic", 1.0) for docs, question in loads[:6]]
        wait_until("2 requests answered", lambda: sum(f.done() for f in futures) >= 2, timeout=600)
        valkey.kill(victim)  # mid-load: requests in flight, puts queued
        # the late ones are sent only now: B batches concurrent requests, so early ones answered together would
        # otherwise free the threads that send the late ones before the kill
        futures += [pool.submit(ask, b, docs, question, "epic", 1.0) for docs, question in loads[6:]]
        answers = [f.result() for f in futures]  # ask() asserts HTTP 200
    assert [text for text, _ in answers] == expected
    assert not any("fallback" in report for _, report in answers)
    nodes = {n["node"]: n for n in servers.stores()[1]["remote"]["nodes"]}
    # 12 late documents: the dead primary held some of them (all on others: a chance of (2/3)^12, under 1 %), and B
    # computed those: it either asked the dead node (an error, its breaker open) or, when a slot-map read after the
    # cluster marked the node failed came first, found its slots unserved (the node no longer serving)
    assert sum(report["chunk_misses"] for _, report in answers[6:]) >= 1, [r for _, r in answers[6:]]
    dead = nodes[victim.name]
    assert (dead["errors"] >= 1 and not dead["up"]) or not dead["serving"], dead
    assert all(n["up"] for name, n in nodes.items() if name != victim.name and n["serving"])

    valkey.promote(replica)
    seed = 30

    def fresh_documents_hit_on_the_other_server() -> bool:
        nonlocal seed
        seed += 1
        fresh = documents(6, seed=seed)
        _, first = ask(a, fresh, f"What is the code of document {seed}-0?")
        servers.drain()
        _, second = ask(b, fresh[::-1], f"What is the code of document {seed}-1?")
        return first["chunk_misses"] == 6 and second["chunk_hits"] == 6

    wait_until("hits through the promoted replica", fresh_documents_hit_on_the_other_server, timeout=120)
    # the server's per-node view after the failover: the promoted replica's name as the cluster announces it may
    # differ from the address the fixture started it on, so its hits are read as "a node other than the victim"
    nodes = {n["node"]: n for n in servers.stores()[1]["remote"]["nodes"]}
    assert any(n["serving"] and n["up"] and n["hits"] > 0 for name, n in nodes.items() if name != victim.name)
    print(f"primary {victim.name} killed under 8 requests: all 200, answers unchanged; hits resumed through "
          f"{replica.name} after {seed - 30} round(s) of fresh documents, no restart")
