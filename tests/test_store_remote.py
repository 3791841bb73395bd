"""The remote tier against a real Valkey server (tests/store_server.py): sharing, verification, size limits, and
what a down, stalled, full or restarted server costs."""

import logging
import time
from types import SimpleNamespace

import pytest
import torch
from store_server import SECRET, StoreServer, store_secret  # noqa: F401 - store_secret is an autouse fixture
from test_store import FP, assert_same, key, make_entry

from chunkcache.config import Config, StoreConfig
from chunkcache.hashing import chunk_key, prefix_key
from chunkcache.store import ChunkStore, EntryLayout
from chunkcache.store import endpoint
from chunkcache.store.remote import RemoteTier, key_prefix, seal, unseal
from chunkcache.store.wire import encode

TIMEOUT = 0.2
# Bounds on what a stall or an outage costs: orders of magnitude, so that a loaded 2-core host (a preempted thread,
# a slow fork) cannot fail them, while a retry loop still does (redis-py's default retries turn one command into
# ~2.6 s, and an outage paid per command would be 41 timeouts in the outage test)
AT_MOST_ONE_TIMEOUT = 5 * TIMEOUT


@pytest.fixture
def clock(monkeypatch):
    """The remote tier's clock (its breakers read only time.monotonic), moved by the test: the breaker's retry
    interval passes when the test says so, not when the host's load lets a sleep end."""
    clock = SimpleNamespace(now=1000.0)
    clock.monotonic = lambda: clock.now
    monkeypatch.setattr(endpoint, "time", clock)
    return clock


@pytest.fixture
def valkey(tmp_path):
    srv = StoreServer(tmp_path)
    yield srv
    srv.kill()


def remote_store(url: str, fp: str = FP, retry_s: float = 60.0, compress: str = "none", **config) -> ChunkStore:
    """Uncompressed unless asked (the default is int8): the tier's own tests compare values byte for byte with the
    entry's plain encoding; the codecs on the wire are test_store_compress's."""
    return ChunkStore.from_config(StoreConfig(remote_url=url, remote_timeout_s=TIMEOUT, remote_retry_s=retry_s,
                                              compress=compress, **config), fp)


def sealed(name: str, data: bytes) -> bytes:
    """The value a server holding the tests' secret stores under `name` for the encoding `data`."""
    return seal(SECRET.encode(), name, data)


def stored(client, name: str) -> bytes:
    """The encoding in the value under `name`, its authenticator checked."""
    return bytes(unseal(SECRET.encode(), name, client.get(name)))


def drain(store: ChunkStore, timeout: float = 10) -> None:
    """Wait for the background writer (a put returns before its SET)."""
    deadline = time.time() + timeout
    while store.stats().remote.pending:
        assert time.time() < deadline, store.stats().remote
        time.sleep(0.005)


def test_servers_share_entries_through_the_store(valkey, tmp_path):
    a, b = remote_store(valkey.url), remote_store(valkey.url, disk_dir=str(tmp_path / "disk"))
    e = make_entry(key(1), tokens=16, dtype=torch.bfloat16, features={"scores": torch.rand(16)})
    a.put(e)
    drain(a)
    # one key per entry, named by format version, model and chunk key, holding the disk tier's encoding, sealed
    name = f"cc:v1:{FP}:{key(1)}"
    assert valkey.client().keys("*") == [name.encode()]
    assert valkey.client().get(name) == sealed(name, encode(e)) and stored(valkey.client(), name) == encode(e)
    assert a.stats().remote.writes == 1 and a.stats().remote.bytes_written == len(sealed(name, encode(e)))

    got = b.get(key(1))
    assert_same(got, e)
    st = b.stats()
    assert (st.hits, st.remote_hits, st.remote.hits, st.remote.misses) == (1, 1, 1, 0)
    assert st.memory_entries == 1 and st.disk_entries == 1  # promoted into both tiers in front
    assert b.get(key(1)) is got and b.stats().memory_hits == 1 and b.stats().remote.hits == 1
    # what a put does to a key already holding a value (kept: SET NX), or a forged one: tests/test_store_auth.py
    assert b.get(key(2)) is None and b.stats().remote.misses == 1 and b.stats().misses == 1


def test_a_requests_keys_are_one_round_trip(valkey):
    """get_many (a blend's lookup, automatic detection's segments): the keys the local tiers lack go to the remote
    tier in one MGET, not one GET each; hits are promoted, misses counted."""
    a, b = remote_store(valkey.url), remote_store(valkey.url)
    for i in range(3):
        a.put(make_entry(key(i), tokens=4, seed=i))
    drain(a)
    b.put(make_entry(key(3), tokens=4, seed=3))  # b holds this one locally
    valkey.client().config_resetstat()
    got = b.get_many([key(i) for i in range(6)])
    assert sorted(got) == [key(i) for i in range(4)]
    stats = valkey.client().info("commandstats")
    assert stats["cmdstat_mget"]["calls"] == 1 and "cmdstat_get" not in stats
    st = b.stats()
    assert (st.remote.hits, st.remote.misses, st.memory_entries, st.hits, st.misses) == (3, 2, 4, 4, 2)
    assert b.get_many([key(i) for i in range(3)]).keys() == {key(i) for i in range(3)}
    assert valkey.client().info("commandstats")["cmdstat_mget"]["calls"] == 1  # served from memory now


def test_added_features_reach_other_servers_and_a_put_sends_the_entry_as_it_was(valkey):
    a, b = remote_store(valkey.url), remote_store(valkey.url)
    e = make_entry(key(1), tokens=16)
    a.put(e)
    e.features["spec:imp"] = torch.rand(16)  # a selector writing into the entry while the writer may be encoding it
    drain(a)
    assert stored(valkey.client(), key_prefix(FP) + key(1)) == encode(make_entry(key(1), tokens=16))
    assert a.add_features(key(1), {"spec:imp": e.features["spec:imp"]}) is True
    drain(a)
    assert torch.equal(b.get(key(1)).features["spec:imp"], e.features["spec:imp"])


def test_models_and_tenants_stay_apart_across_servers(valkey):
    tokens = list(range(30, 40))
    prefix = prefix_key([1, 2, 3])
    k_a, k_b = chunk_key(FP, "tenant-a", prefix, tokens), chunk_key(FP, "tenant-b", prefix, tokens)
    a = remote_store(valkey.url)
    a.put(make_entry(k_a, tokens=10))
    drain(a)
    assert remote_store(valkey.url).get(k_b) is None  # same document, other tenant: its own key
    other_model = remote_store(valkey.url, fp="e" * 32)
    assert other_model.get(k_a) is None and other_model.stats().remote.misses == 1
    assert remote_store(valkey.url).get(k_a) is not None


def test_corrupt_or_truncated_values_are_counted_misses_and_deleted(valkey):
    """Authentic values (sealed with the secret: a server's own bug, a torn write) that fail the encoding's checks;
    values without a valid authenticator are tests/test_store_auth.py's."""
    good = encode(make_entry(key(1), tokens=16))
    flipped = bytearray(good)
    flipped[-5] ^= 0x10
    values = {"flipped": bytes(flipped), "truncated": good[: len(good) // 2], "foreign": b"not an entry",
              "other key": encode(make_entry(key(2), tokens=16))}
    store = remote_store(valkey.url)
    name = key_prefix(FP) + key(1)
    for i, value in enumerate(values.values(), 1):
        valkey.client().set(name, sealed(name, value))
        assert store.get(key(1)) is None
        assert store.stats().remote.corrupt == i and store.stats().misses == i and store.stats().remote.forged == 0
        assert not valkey.client().exists(name)  # deleted, so that a good value can take its place
    store.put(make_entry(key(1), tokens=16))
    drain(store)
    assert_same(remote_store(valkey.url).get(key(1)), make_entry(key(1), tokens=16))
    assert store.stats().remote.errors == 0


def test_values_that_do_not_fit_the_model_are_counted_misses(valkey):
    layout = EntryLayout(FP, num_layers=2, num_kv_heads=2, head_dim=4)
    store = ChunkStore.from_config(StoreConfig(remote_url=valkey.url, remote_timeout_s=TIMEOUT), FP, layout)
    name = key_prefix(FP) + key(1)
    # authentic, checksummed and named right, but another model's KV, or another layout: a misconfigured server of
    # the fleet (one holding the secret)
    for i, misfit in enumerate([make_entry(key(1), fp="e" * 32), make_entry(key(1), layers=3)], 1):
        valkey.client().set(name, sealed(name, encode(misfit)))
        assert store.get(key(1)) is None and store.stats().remote.corrupt == i and not valkey.client().exists(name)
    valkey.client().set(name, sealed(name, encode(make_entry(key(1)))))
    assert_same(store.get(key(1)), make_entry(key(1)))


def test_entries_larger_than_the_server_takes_stay_local(tmp_path):
    srv = StoreServer(tmp_path, "--proto-max-bulk-len", "1mb")
    try:
        store = remote_store(srv.url)
        big = make_entry(key(1), tokens=4096, layers=8)  # 2 MiB of KV
        store.put(big)
        store.put(make_entry(key(2), tokens=16))
        drain(store)
        st = store.stats().remote
        assert store.remote.max_value_bytes == 1 << 20  # learned with CONFIG GET: the big one was never sent
        assert (st.oversize, st.writes, st.errors, st.outages, st.up) == (1, 1, 0, 0, True)
        assert srv.client().keys("*") == [(key_prefix(FP) + key(2)).encode()]
        assert_same(store.get(key(1)), big)  # still served from the host tier
    finally:
        srv.kill()


def test_without_config_an_oversize_put_costs_no_request(tmp_path, clock):
    # CONFIG renamed away (as on managed services): the server refuses the value itself, with "invalid bulk length"
    # (oversize) when its reply arrives, or by resetting the connection mid-send (an outage) - a race in the kernel
    srv = StoreServer(tmp_path, "--proto-max-bulk-len", "1mb", "--rename-command", "CONFIG", '""')
    try:
        store = remote_store(srv.url, retry_s=0.2)
        big = make_entry(key(1), tokens=4096, layers=8)
        store.put(big)
        drain(store)
        st = store.stats().remote
        assert st.oversize + st.errors == 1 and st.writes == 0 and not srv.client().keys("*")
        assert_same(store.get(key(1)), big)
        clock.now += 0.2  # past the retry interval, in case the refusal was an outage
        store.put(make_entry(key(2), tokens=16))
        drain(store)
        assert store.stats().remote.writes == 1 and store.stats().remote.up
    finally:
        srv.kill()


def test_oversize_limit_from_config(valkey):
    store = remote_store(valkey.url, remote_max_value_bytes=4096)
    store.put(make_entry(key(1), tokens=64))
    drain(store)
    assert store.stats().remote.oversize == 1 and not valkey.client().keys("*")


def test_down_server_costs_one_timeout_per_outage_and_comes_back(valkey, caplog, clock):
    a = remote_store(valkey.url, retry_s=0.5)
    a.put(make_entry(key(1)))
    drain(a)
    valkey.kill()
    caplog.set_level(logging.INFO, logger="chunkcache.store.remote")
    t = time.perf_counter()
    assert a.get(key(9)) is None  # connection refused: at once
    for i in range(20):
        assert a.get(key(10 + i)) is None
        a.put(make_entry(key(10 + i)))
    elapsed = time.perf_counter() - t
    drain(a)
    assert elapsed < AT_MOST_ONE_TIMEOUT  # 41 operations: refused at once, then skipped without the network
    st = a.stats().remote
    assert (st.up, st.errors, st.outages, st.skipped, st.writes) == (False, 1, 1, 40, 1)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()
    assert ":0@" not in warnings[0].getMessage()

    valkey.start()  # same port, empty: a restart without persistence loses every entry
    assert a.get(key(3)) is None and a.stats().remote.skipped == 41  # the clock stood still: the breaker is open
    clock.now += 0.5  # the retry interval
    assert a.get(key(3)) is None
    st = a.stats().remote
    assert st.up and st.misses == 1 and st.outages == 1
    assert any("is back" in r.getMessage() for r in caplog.records)
    a.put(make_entry(key(2)))
    drain(a)
    assert_same(remote_store(valkey.url).get(key(2)), make_entry(key(2)))


def test_stalled_server_costs_at_most_the_timeout(valkey, clock):
    writer = remote_store(valkey.url)
    writer.put(make_entry(key(1)))
    drain(writer)
    store = remote_store(valkey.url, retry_s=0.3)
    valkey.pause()
    try:
        t = time.perf_counter()
        assert store.get(key(1)) is None
        assert TIMEOUT * 0.9 < time.perf_counter() - t < AT_MOST_ONE_TIMEOUT  # the timeout, once: no retries
        t = time.perf_counter()
        assert store.get(key(1)) is None  # the breaker is open: no second wait
        assert time.perf_counter() - t < TIMEOUT * 0.9
        st = store.stats().remote
        assert (st.errors, st.outages, st.skipped) == (1, 1, 1)
    finally:
        valkey.resume()
    clock.now += 0.3  # the retry interval
    assert_same(store.get(key(1)), make_entry(key(1)))  # the connection that timed out was dropped, not reused
    assert store.stats().remote.up


def test_full_server_refuses_puts_but_serves_gets(tmp_path, caplog):
    srv = StoreServer(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    try:
        store = remote_store(srv.url)
        caplog.set_level(logging.WARNING, logger="chunkcache.store.remote")
        for i in range(12):  # ~530 KB each: the server fills up after a few
            store.put(make_entry(key(i), tokens=1024, layers=8, seed=i))
            drain(store)
        st = store.stats().remote
        assert st.full > 0 and st.writes + st.full == 12 and (st.errors, st.outages, st.up) == (0, 0, True)
        assert sum("is full" in r.getMessage() for r in caplog.records) == 1
        fresh = remote_store(srv.url)
        assert_same(fresh.get(key(0)), make_entry(key(0), tokens=1024, layers=8, seed=0))
    finally:
        srv.kill()


def test_evicted_entry_is_a_plain_miss(tmp_path):
    srv = StoreServer(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    try:
        store = remote_store(srv.url)
        for i in range(12):
            store.put(make_entry(key(i), tokens=1024, layers=8, seed=i))
            drain(store)
        fresh = remote_store(srv.url)
        assert fresh.get(key(0)) is None and fresh.get(key(11)) is not None
        st = fresh.stats().remote
        assert (st.misses, st.hits, st.errors, st.corrupt) == (1, 1, 0, 0)
        assert store.stats().remote.writes == 12
    finally:
        srv.kill()


def test_password_and_wrong_password(tmp_path):
    srv = StoreServer(tmp_path, password="s3cret")
    try:
        store = remote_store(srv.url)
        store.put(make_entry(key(1)))
        drain(store)
        assert store.stats().remote.writes == 1 and "s3cret" not in repr(store.stats())
        wrong = remote_store(srv.url.replace("s3cret", "nope"))
        assert wrong.get(key(1)) is None
        assert (wrong.stats().remote.errors, wrong.stats().remote.up) == (1, False)
    finally:
        srv.kill()


def test_remote_url_from_yaml_and_environment(tmp_path, monkeypatch, valkey):
    from sglang_patch.serve import launcher

    path = tmp_path / "c.yaml"
    path.write_text(f"store:\n  remote_url: {valkey.url}\n  remote_timeout_s: 0.1\n")
    config = Config.load(path)
    assert (config.store.remote_url, config.store.remote_timeout_s) == (valkey.url, 0.1)
    assert Config().store.remote_url is None and ChunkStore.from_config(Config().store).remote is None
    monkeypatch.setenv(launcher.CONFIG_ENV, str(path))
    monkeypatch.setenv(launcher.REMOTE_URL_ENV, "redis://127.0.0.1:1/0")
    assert launcher.load_server_config().store.remote_url == "redis://127.0.0.1:1/0"
    tier = ChunkStore.from_config(config.store, FP).remote
    assert isinstance(tier, RemoteTier) and tier.prefix == f"cc:v1:{FP}:" and tier.server == valkey.url


def test_remote_config_is_checked_at_load(tmp_path):
    from chunkcache.config import ConfigError

    path = tmp_path / "c.yaml"
    for bad, key in [("remote_url: http://:pw@host:1/0", "remote_url"), ("remote_timeout_s: 0", "remote_timeout_s"),
                     ("remote_write_queue: 0", "remote_write_queue"), ("remote_retry_s: -1", "remote_retry_s")]:
        path.write_text(f"store:\n  {bad}\n")
        with pytest.raises(ConfigError, match=key) as err:
            Config.load(path)
        assert "pw" not in str(err.value)


def test_remote_counters_reach_prometheus(valkey):
    from prometheus_client import CollectorRegistry

    from sglang_patch.scheduler import metrics

    registry = CollectorRegistry()
    metrics.start(True, model_name="m", registry=registry)
    try:
        store = remote_store(valkey.url, remote_max_value_bytes=1 << 16)
        store.put(make_entry(key(1)))
        store.put(make_entry(key(2), tokens=4096))  # oversize
        drain(store)
        store.get(key(3))
        metrics.set_store_stats(store.stats())
        metrics.set_store_stats(store.stats())  # a second snapshot adds nothing: counters get increments
        def value(name, labels=None):
            return registry.get_sample_value(name, {"model_name": "m", **(labels or {})})

        assert value("chunkcache_remote_bytes_written_total") == store.stats().remote.bytes_written > 0
        assert value("chunkcache_remote_misses_total") == 1 and value("chunkcache_remote_up") == 1
        assert value("chunkcache_remote_skipped_total", {"reason": "oversize"}) == 1
    finally:
        metrics.start(False)
