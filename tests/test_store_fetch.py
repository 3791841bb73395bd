"""Fetch or compute: the remote tier asks a server only for the chunks its measured link delivers faster than this
server computes them (chunkcache/store/link.py, remote.py's `choose`), against a real Valkey behind a loopback proxy
that makes the link slow or fast (tests/slow_link.py)."""

import math
from types import SimpleNamespace

import pytest
import torch
from store_server import StoreServer, store_secret  # noqa: F401 - store_secret is an autouse fixture
from test_store import FP, key, make_entry
from test_store_remote import drain, remote_store

from chunkbench.serving.slow_link import SlowLink
from chunkcache.store import link, remote
from chunkcache.store.link import LinkCost, worth_fetching

TOKENS, LAYERS = 500, 4  # an entry of 128 KiB of KV (float32, 2 KV heads of 4 dims)
COMPUTE_S = 0.05  # what computing one chunk costs "here", as the server's measurement would say
SLOW = dict(latency_s=0.02, bytes_per_s=1 << 20)  # 1 MiB/s: a chunk's 128 KiB take ~0.13 s, more than COMPUTE_S
# 256 KiB/s: a chunk in ~0.5 s, so a fast probe is far more than PROBE_MISS times faster even on a loaded host
SLOWER = dict(latency_s=0.02, bytes_per_s=256 << 10)


@pytest.fixture
def clock(monkeypatch):
    """The links' clock, moved by the test: a probe interval passes when the test says so."""
    clock = SimpleNamespace(now=1000.0)
    clock.monotonic = lambda: clock.now
    monkeypatch.setattr(link, "time", clock)
    return clock


def on_line(latency_s: float, bytes_per_s: float, sizes) -> LinkCost:
    cost = LinkCost()
    for size in sizes:
        cost.observe(size, latency_s + size / bytes_per_s)
    return cost


def test_the_link_fit_is_the_line_through_its_round_trips_whatever_one_stalled_one_says():
    cost = on_line(0.01, 1e7, [1_000, 50_000, 100_000, 300_000, 600_000, 1_000_000, 2_000_000])
    cost.observe(500_000, 5.0)  # one round trip held up by a busy host
    est = cost.estimate()
    assert est.latency_s == pytest.approx(0.01, rel=1e-6) and est.bytes_per_s == pytest.approx(1e7, rel=1e-6)
    assert LinkCost().estimate() is None  # unmeasured: the caller fetches
    misses = LinkCost()
    misses.observe(0, 0.001)
    misses.observe(0, 0.002)
    assert misses.estimate() is None  # latency alone says nothing of bandwidth
    same = on_line(0.0, 1e6, [1000, 1000])  # one size: all of the cost per byte
    assert same.estimate().latency_s == 0 and same.estimate().bytes_per_s == pytest.approx(1e6)


def test_only_a_probe_far_faster_than_the_fit_restarts_the_link():
    cost = on_line(0.0, 1e6, [1_000_000, 2_000_000])  # 1 s and 2 s: 1 MB/s
    cost.probing()
    cost.observe(500_000, 1.0)  # twice the fit's 0.5 s: a sample like any other
    assert cost.estimate().samples == 3
    cost.observe(500_000, 0.01)  # 50x faster, but not a probe: a sample like any other
    assert cost.estimate().samples == 4
    cost.probing()
    cost.observe(500_000, 0.05)  # a probe 10x faster than the fit: the link changed, measured anew from it
    assert cost.estimate() is None


def test_the_rule_fetches_what_arrives_faster_than_it_computes(clock):
    fast = on_line(0.01, 1e7, [1_000, 1_000_000])  # 10 ms + 0.1 us per byte
    assert worth_fetching(fast, [("a", 1_000_000, 0.5)], probe_s=60) == (["a"], False)  # 0.11 s < 0.5 s
    assert worth_fetching(fast, [("a", 1_000_000, 0.05)], probe_s=60) == ([], False)  # 0.11 s > 0.05 s
    # each arrives in 10 ms against 15 ms computed, but the round trip's own 10 ms makes the pair 30 ms: not faster
    assert worth_fetching(fast, [("a", 100_000, 0.015), ("b", 100_000, 0.015)], probe_s=60) == ([], False)
    # of a mixed request only the chunks worth it are fetched: b's 1 MB (0.1 s) computes in 0.01 s
    assert worth_fetching(fast, [("a", 100_000, 0.5), ("b", 1_000_000, 0.01)], probe_s=60) == (["a"], False)
    assert worth_fetching(LinkCost(), [("a", 10**9, 0.0)], probe_s=60) == (["a"], False)  # unmeasured: fetch
    clock.now += 60  # from a link judged slow the smallest chunk is fetched once its measurement is probe_s old
    assert worth_fetching(fast, [("a", 1_000_000, 0.05), ("b", 900_000, 0.04)], probe_s=60) == (["b"], True)


@pytest.fixture
def valkey(tmp_path):
    srv = StoreServer(tmp_path)
    yield srv
    srv.kill()


@pytest.fixture
def stored(valkey):
    """Three chunks in the shared store, written by another server."""
    writer = remote_store(valkey.url)
    entries = [make_entry(key(i), tokens=TOKENS, layers=LAYERS, seed=i) for i in range(3)]
    for e in entries:
        writer.put(e)
    drain(writer)
    return [e.key for e in entries]


def reader(url: str, **config):
    """A server's store with no host tier of its own: every lookup goes to the shared store or is computed."""
    return remote_store(url, host_bytes=0, **config)


def costs(keys, compute_s=COMPUTE_S):
    return {k: (TOKENS, compute_s) for k in keys}


def test_a_slow_link_makes_the_server_compute_and_a_fast_one_fetch(valkey, stored, clock):
    slow = SlowLink(valkey.port, **SLOW)
    fast = SlowLink(valkey.port)
    try:
        on_slow, on_fast = reader(slow.url()), reader(fast.url())
        for store in (on_slow, on_fast):
            for _ in range(2):  # unmeasured: fetched, which measures the link
                looked = store.lookup(stored, costs(stored))
                assert looked.fetched == set(stored) and not looked.computed_instead
        looked = on_slow.lookup(stored, costs(stored))
        assert (looked.entries, looked.fetched, looked.computed_instead) == ({}, set(), set(stored))
        est = on_slow.stats().remote.link
        assert (128 << 10) / est.bytes_per_s > COMPUTE_S  # what it decided on: a chunk arrives slower than it computes
        looked = on_fast.lookup(stored, costs(stored))
        assert looked.fetched == set(stored) and not looked.computed_instead
        # a chunk whose compute cost is unknown is fetched whatever the link
        looked = on_slow.lookup(stored, {k: (TOKENS, None) for k in stored})
        assert looked.fetched == set(stored)
        assert (on_slow.stats().remote.computed_instead, on_fast.stats().remote.computed_instead) == (3, 0)
        assert on_slow.stats().remote.bytes_per_token == pytest.approx(
            (valkey.client().strlen(f"cc:v1:{FP}:{stored[0]}")) / TOKENS, rel=0.01)
    finally:
        slow.close()
        fast.close()


@pytest.mark.parametrize("decode_s, fetched", [(4 * COMPUTE_S, False), (COMPUTE_S / 10, True)])
def test_what_a_fetch_costs_includes_decoding_what_it_brings(valkey, stored, monkeypatch, decode_s, fetched):
    """A link that delivers at once still loses to computing when decoding the entry takes longer than computing
    it (a compressed entry dequantised on the host, next to an accelerator computing): the rule charges the decode
    seconds per byte it measured on the fetches so far. The tier's clock is the test's: only decoding moves it."""
    clock = SimpleNamespace(now=0.0)
    clock.perf_counter = lambda: clock.now
    real = remote.decode

    def decode(data):
        clock.now += decode_s
        return real(data)

    monkeypatch.setattr(remote, "time", clock)
    monkeypatch.setattr(remote, "decode", decode)
    store = reader(valkey.url)
    for _ in range(2):  # unmeasured: fetched, which measures
        assert store.lookup(stored, costs(stored)).fetched == set(stored)
    looked = store.lookup(stored, costs(stored))
    assert looked.fetched == (set(stored) if fetched else set())
    assert looked.computed_instead == (set() if fetched else set(stored))
    size = valkey.client().strlen(f"cc:v1:{FP}:{stored[0]}")
    assert store.stats().remote.decode_s_per_mb == pytest.approx(decode_s / size * 1e6)
    assert store.stats().remote.link.bytes_per_s == math.inf  # the link itself took no time


def test_a_link_that_got_faster_is_probed_and_then_fetched_from(valkey, stored, clock):
    proxy = SlowLink(valkey.port, **SLOWER)
    try:
        store = reader(proxy.url(), remote_probe_s=30.0)
        for _ in range(2):
            store.lookup(stored, costs(stored))
        assert store.lookup(stored, costs(stored)).computed_instead == set(stored)  # judged slow
        proxy.set()  # the link is fast from now on
        assert store.lookup(stored, costs(stored)).computed_instead == set(stored)  # not measured again yet
        for interval in range(1, 6):
            clock.now += 30.0
            looked = store.lookup(stored, costs(stored))
            # a probe each interval, of one chunk
            assert len(looked.fetched) == 1 and store.stats().remote.probes == interval
            looked = store.lookup(stored, costs(stored))  # without waiting for the next probe
            if looked.fetched == set(stored):
                break
        assert looked.fetched == set(stored) and store.stats().remote.probes == interval
        assert interval == 1  # the probe, far faster than the fit, restarted the window: the link is measured anew
    finally:
        proxy.close()


def test_always_fetches_on_a_slow_link_and_never_fetches_nothing(valkey, stored):
    proxy = SlowLink(valkey.port, **SLOW)
    try:
        always, never = reader(proxy.url(), remote_fetch="always"), reader(proxy.url(), remote_fetch="never")
        for _ in range(3):
            assert always.lookup(stored, costs(stored)).fetched == set(stored)
            looked = never.lookup(stored, costs(stored))
            assert (looked.fetched, looked.computed_instead) == (set(), set(stored))
        assert never.stats().remote.hits == 0 and never.stats().remote.computed_instead == 9
        assert always.stats().remote.computed_instead == 0
    finally:
        proxy.close()


def test_get_many_is_a_lookup_without_costs_and_fetches_every_key(valkey, stored):
    proxy = SlowLink(valkey.port, **SLOW)
    try:
        store = reader(proxy.url())
        for _ in range(3):
            assert set(store.get_many(stored)) == set(stored)
    finally:
        proxy.close()
