"""A tenant purged from every tier (POST /chunkcache/purge: ChunkStore.purge) and the local tiers emptied
(/flush_cache: ChunkStore.clear): after a purge no entry of that tenant is left in memory, on disk or in the shared
Valkey tier (one server or a cluster), and every other tenant's entries, and entries with no tenant, are untouched."""

import threading

import pytest
import torch
from store_server import SECRET, StoreServer, store_secret  # noqa: F401 - store_secret is an autouse fixture
from test_store import FP, make_entry
from test_store_remote import drain, remote_store

from chunkbench.serving.valkey_cluster import ValkeyCluster
from chunkcache.blend.idle import IdleWork
from chunkcache.hashing import entry_key, prefix_key, tenant_key
from chunkcache.ranks import Ranks
from chunkcache.store import ChunkEntry, ChunkStore
from chunkcache.store import remote as remote_module
from chunkcache.store.disk import DiskTier
from chunkcache.store.remote import VALUE_TAG, unseal
from chunkcache.store.wire import decode, encode

A, B = tenant_key("kb-a"), tenant_key("kb-a", "user-1")  # a namespace, and the same namespace under a salt
OTHER_FP = "e" * 32  # another model sharing the Valkey server


def entry(tenant: str, i: int, fp: str = FP, tokens: int = 8, features: dict | None = None) -> ChunkEntry:
    """An entry of `tenant` whose key is what its tenant, context and tokens make (ChunkStore.put checks it)."""
    ids = torch.arange(tokens) + 100 * i
    context = prefix_key([1, 2, 3])
    e = make_entry("", tokens=tokens, seed=i, fp=fp, features=features)
    return ChunkEntry(entry_key(fp, tenant, context, ids), ids, e.k, e.v, 3, fp, e.features, tenant, context)


def fill(store: ChunkStore, fp: str = FP) -> dict[str, list[ChunkEntry]]:
    """3 entries of A, 2 of B, 1 with no tenant (made outside a server's store), all put."""
    made = {A: [entry(A, i, fp) for i in range(3)], B: [entry(B, 10 + i, fp) for i in range(2)],
            "": [make_entry(f"{fp[:8]}{'0' * 24}", seed=99, fp=fp)]}
    for entries in made.values():
        for e in entries:
            assert store.put(e)
    return made


def tenants_in(client) -> dict[str, int]:
    """Sealed values per tenant in a Valkey server, each one's authenticator checked and its entry decoded whole (the
    oracle: what a reader would be served; a planted value without a seal is no entry a reader serves)."""
    found: dict[str, int] = {}
    for name in client.scan_iter(match="cc:v1:*"):
        value = client.get(name)
        if value.startswith(VALUE_TAG):
            e = decode(bytearray(unseal(SECRET.encode(), name.decode(), value)))
            found[e.tenant] = found.get(e.tenant, 0) + 1
    return found


def test_purge_leaves_no_entry_of_the_tenant_in_memory_and_the_others_whole():
    store = ChunkStore(host_bytes=1 << 20)
    made = fill(store)
    assert store.purge(A) == {"memory": 3}
    assert not any(e.key in store for e in made[A])
    assert all(store.get(e.key) is made[t][i] for t in (B, "") for i, e in enumerate(made[t]))
    # the budget's accounting follows: what is held is exactly the others' bytes
    assert store.stats().memory_bytes == sum(e.nbytes for t in (B, "") for e in made[t])
    assert store.purge(A) == {"memory": 0}  # nothing left to purge
    with pytest.raises(ValueError, match="tenant digest"):
        store.purge("")  # would name the entries that have no tenant


def test_purge_leaves_no_file_of_the_tenant_on_disk_other_processes_files_included(tmp_path):
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path))
    made = fill(store)
    other = DiskTier(tmp_path, 1 << 30)  # another process writing the same directory
    late = entry(A, 7)
    assert other.put(late)
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / f"{'9' * 32}.kv").write_bytes(b"not an entry")  # unreadable: left to the read that drops it
    assert store.purge(A) == {"memory": 3, "disk": 4}
    on_disk = {p.name.removesuffix(".kv") for p in tmp_path.glob("*/*.kv")}
    assert on_disk == {e.key for t in (B, "") for e in made[t]} | {"9" * 32}
    store.memory.clear()
    assert all(store.get(e.key) is None for e in [*made[A], late])  # not in memory, not on disk
    assert all(store.get(e.key) is not None for t in (B, "") for e in made[t])
    assert store.stats().disk_bytes == sum(p.stat().st_size for p in tmp_path.glob("*/*.kv") if p.parent.name != "zz")


def test_clear_empties_the_local_tiers_and_leaves_the_shared_one(tmp_path):
    valkey = StoreServer(tmp_path)
    try:
        store = remote_store(valkey.url, disk_dir=str(tmp_path / "disk"))
        made = fill(store)
        drain(store)
        assert store.clear() == {"memory": 6, "disk": 6}
        st = store.stats()
        assert (st.memory_entries, st.memory_bytes, st.disk_entries, st.disk_bytes) == (0, 0, 0, 0)
        assert not list((tmp_path / "disk").glob("*/*.kv"))
        assert tenants_in(valkey.client()) == {A: 3, B: 2, "": 1}  # other servers' store too: kept
        assert store.get(made[A][0].key) is not None and store.stats().remote_hits == 1
    finally:
        valkey.kill()


@pytest.mark.parametrize("peek", [remote_module.HEADER_PEEK, 16])  # 16: every header read again whole
def test_purge_leaves_no_value_of_the_tenant_in_valkey_of_any_model(tmp_path, monkeypatch, peek):
    monkeypatch.setattr(remote_module, "HEADER_PEEK", peek)
    valkey = StoreServer(tmp_path)
    try:
        a, b = remote_store(valkey.url), remote_store(valkey.url, fp=OTHER_FP)  # two servers, two models
        made = fill(a)
        other = fill(b, OTHER_FP)
        # a header longer than the peek: many features, each a row of the header
        wide = entry(A, 20, features={f"f{i}": torch.zeros(1) for i in range(40)})
        a.put(wide)
        drain(a), drain(b)
        client = valkey.client()
        planted = entry(A, 30)  # an unsealed value claiming the tenant (never served: forged) goes too
        client.set(f"cc:v1:{FP}:{planted.key}", encode(planted))
        client.set(f"cc:v1:{FP}:{'8' * 32}", b"garbage")  # no entry at all: left
        assert tenants_in(client) == {A: 7, B: 4, "": 2}

        assert b.purge(A) == {"memory": 3, "remote": 8}  # b's own memory; the shared tier: both models', planted too
        assert tenants_in(client) == {B: 4, "": 2}
        assert client.exists(f"cc:v1:{FP}:{planted.key}") == 0 and client.exists(f"cc:v1:{FP}:{'8' * 32}") == 1
        a.memory.clear()
        assert all(a.get(e.key) is None for e in [*made[A], wide])
        assert all(a.get(e.key) is not None for t in (B, "") for e in made[t])
        assert all(b.get(e.key) is not None for e in other[B])
    finally:
        valkey.kill()


def test_puts_queued_before_a_purge_are_not_written_after_it(tmp_path):
    valkey = StoreServer(tmp_path)
    try:
        store = remote_store(valkey.url)
        tier = store.remote
        tier._writing = threading.RLock()  # held here: the writer waits, and this thread's purge still runs
        with tier._writing:
            queued = [entry(A, i) for i in range(3)] + [entry(B, 10)]
            for e in queued:
                store.put(e)
            assert store.purge(A)["remote"] == 0  # nothing written yet
        drain(store)  # the writer goes on: the tenant's puts from before the purge are not sent
        assert tenants_in(valkey.client()) == {B: 1}
        later = entry(A, 5)
        store.put(later)  # a put after the purge is written as usual
        drain(store)
        assert tenants_in(valkey.client()) == {A: 1, B: 1}
    finally:
        valkey.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = ValkeyCluster(tmp_path_factory.mktemp("cluster"), primaries=2)
    yield c
    c.stop()


def test_purge_searches_every_primary_of_a_cluster(cluster):
    store = remote_store(cluster.url)
    made = {A: [entry(A, i) for i in range(8)], B: [entry(B, 10 + i) for i in range(8)]}
    for e in [*made[A], *made[B]]:
        store.put(e)
    drain(store)
    name = {e.key: f"cc:v1:{FP}:{{{e.key}}}" for t in made for e in made[t]}
    for t in made:  # each tenant has entries on both primaries, so that one primary's search cannot pass
        assert len({cluster.node_of(name[e.key]).port for e in made[t]}) == 2
    assert store.purge(A) == {"memory": 8, "remote": 8}
    left = {t: sum(cluster.node_of(name[e.key]).client().exists(name[e.key]) for e in made[t]) for t in made}
    assert left == {A: 0, B: 8}


def test_a_purge_drops_the_tenants_waiting_jobs_that_would_store_entries():
    idle = IdleWork(Ranks(), {"deviation": 8, "encode": 8, "audit": 8})
    for tenant in (A, B, A):
        idle.put("encode", lambda: None, tenant=tenant)
        idle.put("deviation", lambda: None, tenant=tenant)
    idle.put("audit", lambda: None)
    assert idle.drop(("deviation", "encode"), A) == 4
    assert (idle.waiting("encode"), idle.waiting("deviation"), idle.waiting("audit")) == (1, 1, 1)
    assert idle.drop(("deviation", "encode")) == 2  # a flush: all of them
    assert idle.waiting() == 1  # the audit's sample stores nothing


def test_a_purge_and_a_clear_reach_a_further_local_tier(tmp_path):
    from test_tier_protocol import DictTier

    toy = DictTier()
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path), tiers=[toy])
    made = fill(store)
    assert store.purge(A) == {"memory": 3, "disk": 3, "tier2": 3}
    assert set(toy.entries) == {e.key for t in (B, "") for e in made[t]}
    assert store.clear() == {"memory": 3, "disk": 3, "tier2": 3} and not toy.entries
