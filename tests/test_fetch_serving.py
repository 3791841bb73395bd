"""Fetch or compute in a live server: a server whose only chunk store is a shared Valkey behind a slow link computes
the chunks it lacks (reported `computed_instead`); once the link is fast again it probes it and fetches them
(`fetched`); either way the answer is the same (the stored KV is what its fill computes)."""

import itertools
import random
import time

import pytest
import requests
import yaml
from conftest import WORDS, metric, start_server, with_test_defaults
from store_server import SECRET_ENV, StoreServer

from chunkbench.serving.slow_link import SlowLink
from chunkcache.config import config_file

pytestmark = pytest.mark.slow

PROBE_S = 20.0  # longer than a slow-link request takes (~11 s), so the slow phase is not probed
# a chunk's ~0.7 MB (int8, the default store.compress) in ~2.6 s; it computes in a fraction of that, even on a loaded
# host (23 ms a token: 1.2 s)
SLOW = dict(latency_s=0.02, bytes_per_s=256 << 10)


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    store = StoreServer(tmp_path_factory.mktemp("store"))
    proxy = SlowLink(store.port, **SLOW)
    yield proxy
    proxy.close()
    store.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory, link):
    tmp = tmp_path_factory.mktemp("fetch")
    config = yaml.safe_load(config_file("default").read_text())
    # no host tier: every request's chunks come from the shared store or are computed
    config["store"].update(host_bytes=0, remote_url=link.url(), remote_timeout_s=5.0, remote_probe_s=PROBE_S)
    path = tmp / "fetch.yaml"
    path.write_text(with_test_defaults(yaml.safe_dump(config)))
    srv = start_server(tmp / "server.log", "--enable-metrics", "--chunkcache-config", str(path), env=SECRET_ENV)
    yield srv
    srv.stop()


DOCS = [f"Record {i}: " + " ".join(random.Random(i).choice(WORDS) for _ in range(40)) + f". Its code is {900 + i}."
        for i in range(4)]
ORDERS = list(itertools.permutations(range(4)))


def flush(server) -> None:
    """Empty the radix tree; SGLang refuses (400) while the scheduler still holds a request, e.g. the one just
    answered, so it is asked again until it has none."""
    deadline = time.monotonic() + 60
    while requests.post(server.url + "/flush_cache", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the server kept refusing /flush_cache"
        time.sleep(0.1)


def ask(server, order) -> tuple[str, dict]:
    flush(server)  # no radix prefix from an earlier ask
    r = requests.post(server.url + "/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": "What is the code of record 2?"}], "max_tokens": 8, "temperature": 0,
        "chunkcache": {"documents": [DOCS[i] for i in order], "selector": "none"}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["metadata"]["chunkcache"]


def state(server) -> dict:
    return requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["chunkcache"]


def decided(server) -> str:
    """What the rule weighed, for a failure's message."""
    s = state(server)
    r = s["store"]["remote"]
    return (f"compute {s['compute_s_per_token']} s/token; link {r['link']}; {r['bytes_per_token']} B/token; "
            f"decode {r['decode_s_per_mb']} s/MB; {r['probes']} probes")


def remote(server) -> dict:
    return state(server)["store"]["remote"]


def test_a_slow_link_makes_the_server_compute_and_a_fast_one_fetch(server, link):
    _, first = ask(server, ORDERS[0])
    assert (first["chunk_misses"], first["fetched"]) == (4, 0)  # computed here, written to the shared store
    deadline = time.monotonic() + 120
    while remote(server)["pending"]:
        assert time.monotonic() < deadline, remote(server)
        time.sleep(0.1)
    # the first ask's misses measured the link's latency only: the next ask fetches, which measures its bandwidth
    _, report = ask(server, ORDERS[1])
    assert (report["chunk_hits"], report["fetched"], report["computed_instead"]) == (4, 4, 0), decided(server)
    computed, report = ask(server, ORDERS[2])
    assert (report["chunk_hits"], report["fetched"], report["computed_instead"]) == (0, 0, 4), decided(server)
    tier = remote(server)
    assert tier["computed_instead"] == 4 and tier["link"]["bytes_per_s"] < 2 * SLOW["bytes_per_s"]
    assert metric(server, "chunkcache_remote_computed_instead_total") == 4
    assert 0 < metric(server, "chunkcache_remote_fetch_bytes_per_second") < 2 * SLOW["bytes_per_s"]
    assert tier["decode_s_per_mb"] > 0  # what decoding the fetched entries cost, the rule's third input
    assert metric(server, "chunkcache_remote_decode_seconds_per_mb") == pytest.approx(tier["decode_s_per_mb"])

    link.set()  # fast from now on: probed once remote_probe_s has passed, then fetched from
    for probes in range(1, 4):
        time.sleep(PROBE_S)  # the probe interval passes (monotonic time: not a race)
        _, report = ask(server, ORDERS[2])
        assert (report["fetched"], remote(server)["probes"]) == (1, probes), report  # a probe: one chunk fetched
        fetched, report = ask(server, ORDERS[2])
        if report["fetched"] == 4:
            break
    assert (report["fetched"], report["computed_instead"]) == (4, 0) and remote(server)["probes"] == probes == 1
    assert fetched == computed  # the stored KV is what the fill computes: the same answer either way
