"""Cluster mode of the remote tier against a real Valkey Cluster, 3 primaries with a replica each
(chunkbench/serving/valkey_cluster.py): where entries land, what a request costs per node, redirections followed, and what a
stalled node, a dead primary and its replica's promotion cost."""

import dataclasses
import json
import time
from collections import Counter

import pytest
import redis
import redis.connection
import torch
from test_store import FP, assert_same, key, make_entry
from store_server import store_secret  # noqa: F401 - an autouse fixture: the remote tier's secret
from test_store_remote import clock, drain, remote_store, stored  # noqa: F401 - clock is a fixture

from chunkbench.serving.valkey_cluster import ValkeyCluster, wait_until
from chunkcache.config import Config, ConfigError, StoreConfig
from chunkcache.store import ChunkStore
from chunkcache.store.cluster import ClusterTier
from chunkcache.store.remote import key_prefix
from chunkcache.store.wire import encode

PASSWORD = "s3cret"
STALL_TIMEOUT = 0.5  # the tier's timeout where a test tells one stalled node's wait from two in a row


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One cluster for the tests that leave every node running; each test starts it empty. With a password: the
    tier's URL carries it to every node."""
    c = ValkeyCluster(tmp_path_factory.mktemp("cluster"), password=PASSWORD)
    yield c
    c.stop()


@pytest.fixture
def shared(cluster):
    for node in cluster.primaries():
        node.client().flushall()
    return cluster


@pytest.fixture
def own_cluster(tmp_path):
    """A cluster for a test that kills a node; its replica takes over when the test promotes it."""
    c = ValkeyCluster(tmp_path, auto_failover=False)
    yield c
    c.stop()


def name(k: str) -> str:
    return f"{key_prefix(FP)}{{{k}}}"


def by_node(cluster: ValkeyCluster, keys: list[str]) -> dict[int, list[str]]:
    """The keys grouped by the port of the primary the cluster serves each from."""
    groups: dict[int, list[str]] = {}
    for k in keys:
        groups.setdefault(cluster.node_of(name(k)).port, []).append(k)
    return groups


def node_stats(store: ChunkStore) -> dict[int, object]:
    return {int(n.node.rpartition(":")[2]): n for n in store.stats().remote.nodes}


def fill(store: ChunkStore, n: int, tokens: int = 4) -> list[str]:
    keys = [key(i) for i in range(n)]
    for i, k in enumerate(keys):
        store.put(make_entry(k, tokens=tokens, seed=i))
    drain(store)
    return keys


def test_entries_spread_over_every_primary_on_their_chunk_keys_slot(shared):
    a = remote_store(shared.url)
    assert isinstance(a.remote, ClusterTier)
    keys = fill(a, 30)
    groups = by_node(shared, keys)
    assert sorted(groups) == sorted(n.port for n in shared.primaries())  # every primary holds some
    for port, group in groups.items():
        node = next(n for n in shared.nodes if n.port == port)
        assert node.client().dbsize() == len(group)
        for k in group:
            assert stored(node.client(), name(k)) == encode(make_entry(k, tokens=4, seed=keys.index(k)))
            # the hash tag: the entry's key is on the slot of its chunk key alone
            assert node.client().cluster("keyslot", name(k)) == node.client().cluster("keyslot", k)
    st = a.stats().remote
    assert st.writes == 30 and (st.errors, st.outages, st.skipped, st.up) == (0, 0, 0, True)
    assert {p: n.writes for p, n in node_stats(a).items()} == {p: len(g) for p, g in groups.items()}
    assert all(n.serving and n.up for n in st.nodes)
    assert st.server.startswith("redis+cluster://127.0.0.1:") and PASSWORD not in repr(a.stats())
    # what /server_info serves (sglang_patch/scheduler/cache.py)
    served = json.loads(json.dumps(dataclasses.asdict(a.stats())))
    assert sorted(n["node"] for n in served["remote"]["nodes"]) == sorted(p.name for p in shared.primaries())

    b = remote_store(shared.url)
    got = b.get_many(keys)
    assert sorted(got) == keys
    for i, k in enumerate(keys):
        assert_same(got[k], make_entry(k, tokens=4, seed=i))
    assert {p: n.hits for p, n in node_stats(b).items()} == {p: len(g) for p, g in groups.items()}


def test_compressed_entries_are_stored_on_their_primaries_and_read_decoded(shared):
    from chunkcache.store.codec import Codec
    from chunkcache.store.wire import decode

    a = remote_store(shared.url, compress="int8")
    entries = [make_entry(key(i), tokens=40, seed=i) for i in range(6)]
    for e in entries:
        a.put(e)
    drain(a)
    b = remote_store(shared.url)  # compress: none reads them all the same
    got = b.get_many([e.key for e in entries])
    for e in entries:
        value = stored(shared.node_of(name(e.key)).client(), name(e.key))
        assert value == encode(e, Codec(8)) and len(value) < len(encode(e))
        assert_same(got[e.key], decode(value))
    assert b.stats().remote.hits == 6 and b.stats().remote.corrupt == 0


def test_values_are_sealed_under_their_hash_tagged_names_and_written_once(shared):
    """On a cluster the authenticator covers the name as the primary stores it (braces included): a value moved to
    another entry's name is forged; a second put of a key leaves the value as it was (SET NX through RedisCluster),
    and only features grown on an entry replace it."""
    a = remote_store(shared.url)
    keys = fill(a, 2)
    first, second = (shared.node_of(name(k)).client() for k in keys)
    value = first.get(name(keys[0]))
    second.set(name(keys[1]), value)
    b = remote_store(shared.url)
    assert b.get(keys[1]) is None and not second.exists(name(keys[1]))
    assert (b.stats().remote.forged, b.stats().remote.corrupt) == (1, 0)
    b.put(make_entry(keys[0], tokens=4, seed=9))  # other bits under a stored key: kept out
    drain(b)
    assert first.get(name(keys[0])) == value and b.stats().remote.already_stored == 1
    fresh = remote_store(shared.url)
    assert_same(fresh.get(keys[0]), make_entry(keys[0], tokens=4, seed=0))  # the cluster still holds the first
    assert fresh.add_features(keys[0], {"spec:imp": torch.ones(4)}) is True
    drain(fresh)
    assert "spec:imp" in remote_store(shared.url).get(keys[0]).features


def test_a_requests_keys_cost_one_round_trip_per_node(shared, monkeypatch):
    a, b = remote_store(shared.url), remote_store(shared.url, host_bytes=0)  # b: every get asks the cluster
    keys = fill(a, 12)
    absent = [key(100 + i) for i in range(6)]
    groups = by_node(shared, keys + absent)
    assert len(groups) == 3
    b.get_many(keys + absent)  # the slot map read and a connection to each node opened, outside what is measured
    for node in shared.primaries():
        node.client().config_resetstat()

    sends: Counter[int] = Counter()  # writes of commands to a socket, by server port: one per round trip
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(self, command, check_health=True):
        sends[self.port] += 1
        return send(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    got = b.get_many(keys + absent)
    monkeypatch.undo()

    assert sorted(got) == keys
    assert sends == {port: 1 for port in groups}  # one pipeline per node touched
    for node in shared.primaries():  # every key asked once, of the node holding it: no redirection, no retry
        stats = node.client().info("commandstats")
        assert stats["cmdstat_get"]["calls"] == len(groups[node.port]) and "cmdstat_mget" not in stats
        assert stats["cmdstat_get"].get("rejected_calls", 0) == 0
    per_node = node_stats(b)
    assert {p: n.hits for p, n in per_node.items()} == {p: 2 * len(set(g) & set(keys)) for p, g in groups.items()}
    assert {p: n.misses for p, n in per_node.items()} == {p: 2 * len(set(g) & set(absent)) for p, g in groups.items()}


def test_moved_and_ask_replies_are_followed(shared):
    """A slot migrating (ASK: asked once more, with ASKING, of the importing node) and migrated (MOVED: the slot
    moves in the tier's map, and the next request goes straight to its new node)."""
    a = remote_store(shared.url)
    k = fill(a, 1)[0]
    store = remote_store(shared.url, host_bytes=0)  # no host tier: every get asks the cluster
    assert store.get(k) is not None
    source = shared.node_of(name(k))
    target = next(n for n in shared.primaries() if n.port != source.port)
    slot = source.client().cluster("keyslot", name(k))
    target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
    source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
    source.client().execute_command("MIGRATE", "127.0.0.1", target.port, name(k), 0, 5000, "AUTH", PASSWORD)
    for node in (source, target):
        node.client().config_resetstat()

    assert_same(store.get(k), make_entry(k, tokens=4))  # the source answers ASK: the entry is on the target
    assert target.client().info("commandstats")["cmdstat_asking"]["calls"] == 1

    for node in shared.primaries():
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.node_id)
    shared.wait_ok()
    assert_same(store.get(k), make_entry(k, tokens=4))  # the source answers MOVED
    gets_at_source = source.client().info("commandstats")["cmdstat_get"]["calls"]
    assert_same(store.get(k), make_entry(k, tokens=4))
    assert source.client().info("commandstats")["cmdstat_get"]["calls"] == gets_at_source  # straight to the target
    assert store.stats().remote.errors == 0 and store.stats().remote.up


def test_stalled_nodes_cost_their_keys_once_and_in_parallel(shared, clock, monkeypatch):
    import redis

    calls = []  # (start, end, failed) of every node pipeline
    execute = redis.client.Pipeline.execute

    def timed(self, *args, **kwargs):
        start = time.monotonic()
        try:
            out = execute(self, *args, **kwargs)
        except redis.RedisError:
            calls.append((start, time.monotonic(), True))
            raise
        calls.append((start, time.monotonic(), False))
        return out

    monkeypatch.setattr(redis.client.Pipeline, "execute", timed)
    a = remote_store(shared.url)
    keys = fill(a, 12)
    groups = by_node(shared, keys)
    store = ChunkStore.from_config(StoreConfig(remote_url=shared.url, remote_timeout_s=STALL_TIMEOUT, host_bytes=0),
                                   FP)
    assert len(store.get_many(keys)) == 12  # the slot map read, every node answering
    stalled = shared.primaries()[:2]
    live = next(n for n in shared.primaries() if n not in stalled)
    for node in stalled:
        node.pause()
    try:
        calls.clear()
        got = store.get_many(keys)
        assert sorted(got) == sorted(groups[live.port])  # the live node's keys still hit
        # both stalled nodes waited for at once: their two failed pipelines overlap in time
        failed = [(start, end) for start, end, bad in calls if bad]
        assert len(failed) == 2 and max(s for s, _ in failed) < min(e for _, e in failed), calls
        calls.clear()
        assert sorted(store.get_many(keys)) == sorted(groups[live.port])
        assert not any(bad for *_, bad in calls)  # their breakers are open: no second wait (skipped, below)
        st = store.stats().remote
        per_node = node_stats(store)
        for node in stalled:
            assert (per_node[node.port].errors, per_node[node.port].outages, per_node[node.port].up) == (1, 1, False)
            assert per_node[node.port].skipped == len(groups[node.port])
        assert per_node[live.port].up and per_node[live.port].hits == 3 * len(groups[live.port])
        assert (st.up, st.errors, st.outages) == (False, 2, 2)
    finally:
        for node in stalled:
            node.resume()
    clock.now += store.remote.retry_s
    wait_until("the stalled nodes answering again", lambda: len(store.get_many(keys)) == 12)
    assert store.stats().remote.up


def test_a_dead_primary_costs_its_keys_and_hits_resume_after_its_replica_takes_over(own_cluster, clock):
    writer = remote_store(own_cluster.url)
    keys = fill(writer, 30)
    for primary in own_cluster.primaries():  # replication is asynchronous: wait until the replicas hold it all
        replica = own_cluster.replica_of(primary)
        wait_until("replicas caught up", lambda: replica.client().dbsize() == primary.client().dbsize())
    store = remote_store(own_cluster.url, host_bytes=0)  # every get asks the cluster
    assert len(store.get_many(keys)) == 30
    groups = by_node(own_cluster, keys)
    victim = own_cluster.node_of(name(keys[0]))
    replica = own_cluster.replica_of(victim)
    others = [k for k in keys if k not in groups[victim.port]]

    own_cluster.kill(victim)
    got = store.get_many(keys)  # no exception: the dead node's keys are misses, the others' hits
    assert sorted(got) == sorted(others)
    for k in others:
        assert_same(got[k], make_entry(k, tokens=4, seed=keys.index(k)))
    per_node = node_stats(store)
    assert (per_node[victim.port].up, per_node[victim.port].errors) == (False, 1)
    assert all(n.up for p, n in per_node.items() if p != victim.port) and not store.stats().remote.up
    skipped = store.stats().remote.skipped
    store.put(make_entry(groups[victim.port][0], tokens=4))  # bound for the dead node: dropped at once
    assert store.stats().remote.skipped == skipped + 1 and store.stats().remote.pending == 0

    own_cluster.promote(replica)
    clock.now += store.remote.retry_s  # the dead node's retry interval: the tier reads the slot map again
    wait_until("hits on the promoted replica", lambda: len(store.get_many(keys)) == 30)
    per_node = node_stats(store)
    assert per_node[replica.port].serving and per_node[replica.port].up
    assert per_node[replica.port].hits >= len(groups[victim.port])
    assert not per_node[victim.port].serving and store.stats().remote.up  # a node failed over no longer counts

    new = next(f"{i:032x}" for i in range(1000, 2000) if own_cluster.node_of(name(f"{i:032x}")).port == replica.port)
    store.put(make_entry(new, tokens=4))  # puts reach the promoted replica too
    drain(store)
    assert stored(replica.client(), name(new)) == encode(make_entry(new, tokens=4))
    assert node_stats(store)[replica.port].writes == 1


def test_an_unreachable_cluster_costs_one_attempt_per_outage(tmp_path, clock):
    from sglang_patch.serve.server_process import free_port

    store = remote_store(f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}", host_bytes=0)
    assert store.get(key(1)) is None  # refused by every seed: no exception
    for i in range(10):
        store.put(make_entry(key(i)))
        assert store.get(key(i)) is None
    st = store.stats().remote
    assert (st.up, st.errors, st.outages, st.skipped, st.nodes) == (False, 1, 1, 21, ())


def test_cluster_url_in_config(tmp_path):
    path = tmp_path / "c.yaml"
    url = "redis+cluster://:s3cret@127.0.0.1:7000,127.0.0.1:7001"
    path.write_text(f"store:\n  remote_url: {url}\n")
    config = Config.load(path)
    tier = ChunkStore.from_config(config.store, FP).remote
    assert isinstance(tier, ClusterTier) and tier.server == "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"
    assert tier.prefix == f"cc:v1:{FP}:"
    for bad in ["redis+cluster://:pw@h:1/3", "redis+cluster://:pw@h", "redis+cluster://:pw@h:1,h2",
                "valkey://:pw@h:1"]:
        path.write_text(f"store:\n  remote_url: {bad}\n")
        with pytest.raises(ConfigError, match="remote_url") as err:
            Config.load(path)
        assert "pw" not in str(err.value)
