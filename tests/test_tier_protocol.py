"""The tier protocol (chunkcache/store/tier.py) is the store's extension point: the built-in tiers satisfy it, and a
tier written against it alone, stacked behind memory and disk, is written through, answers hits and misses and has its
hits promoted into the tiers in front, as the disk's are."""

from test_store import key, make_entry

from chunkcache.store import ChunkEntry, ChunkStore
from chunkcache.store.remote import RemoteTier
from chunkcache.store.tier import LocalTier, Tier


class DictTier:
    """A toy local tier: entries in a dict, no budget, every get recorded."""

    def __init__(self):
        self.entries: dict[str, ChunkEntry] = {}
        self.evictions = 0
        self.asked: list[str] = []

    def get(self, key: str) -> ChunkEntry | None:
        self.asked.append(key)
        return self.entries.get(key)

    def put(self, entry: ChunkEntry) -> bool:
        self.entries[entry.key] = entry
        return True

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def purge(self, tenant: str) -> int:
        doomed = [k for k, entry in self.entries.items() if entry.tenant == tenant]
        for k in doomed:
            del self.entries[k]
        return len(doomed)

    def clear(self) -> int:
        n = len(self.entries)
        self.entries.clear()
        return n


def test_the_built_in_tiers_satisfy_the_protocol(tmp_path):
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path))
    assert all(isinstance(tier, LocalTier) for tier in (store.memory, store.disk, DictTier()))
    assert issubclass(RemoteTier, Tier)


def test_a_fourth_tier_stacks_behind_the_built_in_ones(tmp_path):
    toy = DictTier()
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path), tiers=[toy])
    assert store.tiers == (store.memory, store.disk, toy)
    e = make_entry(key(1))
    assert store.put(e) and toy.entries == {e.key: e}  # written through

    store.memory.pop(e.key)
    store.disk.pop(e.key)
    assert e.key in store  # the toy alone holds it
    assert store.get(e.key) is e and toy.asked == [e.key]
    assert e.key in store.memory and e.key in store.disk  # promoted into both tiers in front
    assert store.get(e.key) is e and toy.asked == [e.key]  # now a memory hit: the toy is not asked

    assert store.get(key(2)) is None and toy.asked == [e.key, key(2)]  # a miss walks every tier
    st = store.stats()
    assert (st.hits, st.misses, st.memory_hits, st.disk_hits, st.memory_entries, st.disk_entries) == (2, 1, 1, 0, 1, 1)


def test_a_fourth_tier_keeps_what_memory_and_disk_refuse(tmp_path):
    toy = DictTier()
    store = ChunkStore(host_bytes=0, disk_dir=str(tmp_path), disk_bytes=0, tiers=[toy])
    e = make_entry(key(1))
    assert store.put(e) and store.get(e.key) is e  # kept by the toy, though memory and disk refused it
    assert (store.stats().memory_entries, store.stats().disk_entries) == (0, 0)
