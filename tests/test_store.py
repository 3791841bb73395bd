import errno
import logging
import multiprocessing as mp
import os
import threading

import pytest
import torch

from chunkcache.store import ChunkEntry, ChunkStore, FingerprintMismatch
from chunkcache.store.disk import DiskTier
from chunkcache.store.wire import decode, encode

FP = "f" * 32


def make_entry(key: str, tokens: int = 8, layers: int = 2, dtype=torch.float32, seed: int = 0, fp: str = FP,
               features: dict | None = None) -> ChunkEntry:
    g = torch.Generator().manual_seed(seed)
    shape = (layers, tokens, 2, 4)
    return ChunkEntry(
        key=key, token_ids=torch.arange(tokens) + seed, k=torch.randn(shape, generator=g).to(dtype),
        v=torch.randn(shape, generator=g).to(dtype), start_pos=5, model_fingerprint=fp, features=features or {},
    )


def key(i: int) -> str:
    return f"{i:032x}"


def assert_same(a: ChunkEntry, b: ChunkEntry) -> None:
    assert a.key == b.key and a.start_pos == b.start_pos and a.model_fingerprint == b.model_fingerprint
    for x, y in [(a.token_ids, b.token_ids), (a.k, b.k), (a.v, b.v)]:
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert a.features.keys() == b.features.keys()
    for name in a.features:
        assert torch.equal(a.features[name], b.features[name])


def test_entry_shape_checks():
    e = make_entry(key(1))
    assert (e.num_layers, e.num_tokens, e.num_kv_heads, e.head_dim) == (2, 8, 2, 4)
    assert e.nbytes == 8 * 8 + 2 * (2 * 8 * 2 * 4 * 4)
    with pytest.raises(ValueError, match="token ids"):
        ChunkEntry(key(1), torch.arange(3), e.k, e.v, 0, FP)
    with pytest.raises(ValueError, match=r"\[L, T, H, D\]"):
        ChunkEntry(key(1), e.token_ids, e.k, e.v[:, :4], 0, FP)


def test_memory_lru_eviction_order_and_budget():
    size = make_entry(key(0)).nbytes
    store = ChunkStore(host_bytes=3 * size)
    for i in range(3):
        store.put(make_entry(key(i)))
    assert store.get(key(0)) is not None  # 0 becomes most recent: 1 is now the oldest
    store.put(make_entry(key(3)))
    assert key(1) not in store and all(key(i) in store for i in (0, 2, 3))
    store.put(make_entry(key(4)))
    assert key(2) not in store
    st = store.stats()
    assert st.evictions == 2 and st.memory_entries == 3 and st.memory_bytes == 3 * size
    assert store.get(key(1)) is None and store.stats().misses == 1


def test_memory_entry_larger_than_budget_is_not_kept():
    store = ChunkStore(host_bytes=100)
    assert store.put(make_entry(key(0))) is False
    assert key(0) not in store and store.stats().memory_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_a_pinned_tier_keeps_page_locked_kv_that_copies_without_blocking_to_the_same_values():
    from chunkcache.config import StoreConfig

    store = ChunkStore.from_config(StoreConfig())  # pin_memory unset: pinned where CUDA is
    e = make_entry(key(0))
    k, v = e.k.clone(), e.v.clone()
    assert store.put(e) is True
    got = store.get(key(0))
    assert got.k.is_pinned() and got.v.is_pinned()
    assert torch.equal(got.k, k) and torch.equal(got.v, v)
    dst = torch.empty_like(k, device="cuda")
    dst.copy_(got.k, non_blocking=True)
    assert torch.equal(dst.cpu(), k)
    assert not ChunkStore(host_bytes=1 << 20).memory.pin  # a store built by hand pins only when asked


def test_pin_memory_without_cuda_is_refused_with_the_reason(monkeypatch):
    from chunkcache.config import StoreConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="pin_memory: true needs a CUDA device"):
        ChunkStore.from_config(StoreConfig(pin_memory=True))
    assert not ChunkStore.from_config(StoreConfig()).memory.pin  # unset: no CUDA, nothing pinned


def test_put_says_whether_a_local_tier_kept_the_entry(tmp_path):
    e = make_entry(key(0))
    assert ChunkStore(host_bytes=1 << 20).put(e) is True
    assert ChunkStore(host_bytes=100, disk_dir=str(tmp_path / "a")).put(e) is True  # memory refused, the disk kept it
    refused = ChunkStore(host_bytes=100, disk_dir=str(tmp_path / "b"), disk_bytes=100)
    assert refused.put(e) is False and key(0) not in refused and refused.get(key(0)) is None


def charged_as_held(store: ChunkStore) -> bool:
    """The host budget's invariant: memory is charged exactly what its entries hold, features included."""
    return store.stats().memory_bytes == sum(e.nbytes for e in store.memory.entries.values())


def test_add_features_charges_the_host_budget_and_writes_through_to_disk(tmp_path):
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path))
    store.put(make_entry(key(1)))
    before = store.stats().memory_bytes
    scores = torch.rand(8)
    assert store.add_features(key(1), {"spec:imp": scores}) is True
    assert store.stats().memory_bytes == before + scores.nbytes and charged_as_held(store)
    reopened = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path))  # another process, or after a restart
    assert torch.equal(reopened.get(key(1)).features["spec:imp"], scores)
    assert_same(reopened.get(key(1)), store.get(key(1)))


def test_features_a_selector_wrote_in_place_are_charged_when_added(tmp_path):
    """The engines hand a selector the stored entry's own feature dict (Features.chunk_features), then add what grew."""
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path))
    store.put(make_entry(key(1)))
    entry = store.get(key(1))
    before = store.stats().memory_bytes
    entry.features["clip:kv"] = torch.randn(2, 1, 4, 8, 2)
    assert store.stats().memory_bytes == before  # written, not yet added
    assert store.add_features(key(1), {"clip:kv": entry.features["clip:kv"]}) is True
    assert store.stats().memory_bytes == before + entry.features["clip:kv"].nbytes and charged_as_held(store)
    assert "clip:kv" in ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path)).get(key(1)).features


def test_a_grown_entry_evicts_the_oldest_and_is_dropped_once_alone_over_budget():
    size = make_entry(key(0)).nbytes
    store = ChunkStore(host_bytes=2 * size)
    store.put(make_entry(key(0)))
    store.put(make_entry(key(1)))
    assert store.add_features(key(1), {"f": torch.zeros(1)}) is True
    assert key(0) not in store and key(1) in store and store.stats().evictions == 1 and charged_as_held(store)
    assert store.add_features(key(1), {"g": torch.zeros(size // 2)}) is False  # 4 bytes each: now over alone
    assert key(1) not in store and store.stats().memory_bytes == 0


def test_add_features_reaches_an_entry_only_the_disk_holds(tmp_path):
    store = ChunkStore(host_bytes=0, disk_dir=str(tmp_path))
    store.put(make_entry(key(2)))
    assert store.add_features(key(2), {"f": torch.ones(3)}) is True
    assert torch.equal(ChunkStore(host_bytes=0, disk_dir=str(tmp_path)).get(key(2)).features["f"], torch.ones(3))


def test_add_features_to_an_entry_no_local_tier_holds_is_refused():
    store = ChunkStore(host_bytes=1 << 20)
    assert store.add_features(key(5), {"f": torch.zeros(1)}) is False
    assert key(5) not in store and store.stats().memory_bytes == 0


def test_on_change_gets_a_snapshot_after_each_operation(tmp_path):
    """What the server's store metrics follow (sglang_patch.scheduler.cache): every change, from whichever operation
    made it."""
    size = make_entry(key(0)).nbytes
    seen = []
    store = ChunkStore(host_bytes=size, disk_dir=str(tmp_path), on_change=seen.append)
    store.put(make_entry(key(0)))
    assert seen[-1].memory_bytes == size and seen[-1].disk_entries == 1
    store.put(make_entry(key(1)))
    assert seen[-1].evictions == 1
    store.get(key(0))  # from disk, back into memory: key(1) evicted
    assert (seen[-1].disk_hits, seen[-1].evictions) == (1, 2)
    store.add_features(key(0), {"x": torch.zeros(1)})
    assert seen[-1].memory_bytes == 0  # grown past the host budget alone: kept on disk only
    assert store.add_features(key(9), {}) is False and len(seen) == 5  # a miss too (the disk drops corrupt entries)
    assert seen[-1] == store.stats()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_disk_round_trip_bit_exact(tmp_path, dtype):
    e = make_entry(key(7), dtype=dtype, features={"draft_scores": torch.rand(8), "draft_k": torch.randn(3, 8, 1, 2)})
    e.k[0, 0, 0, 0] = float("nan")  # bit patterns, not values, must survive
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path))
    store.put(e)
    fresh = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path))  # empty memory tier: served from disk
    got = fresh.get(e.key)
    assert_same(e, got)
    st = fresh.stats()
    assert (st.disk_hits, st.memory_entries, st.disk_entries) == (1, 1, 1)  # the disk hit was promoted
    assert fresh.get(e.key) is got and fresh.stats().memory_hits == 1


def corrupt_file(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "payload":
        data[-5] ^= 0x01
    elif how == "header":
        data[20] ^= 0x01
    elif how == "truncated":
        data = data[: len(data) - 9]
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["payload", "header", "truncated", "empty"])
def test_corrupt_disk_entry_is_dropped_counted_and_never_served(tmp_path, caplog, how):
    e = make_entry(key(3))
    ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path)).put(e)
    disk = DiskTier(tmp_path, 1 << 20)
    corrupt_file(disk.path(e.key), how)
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="chunkcache.store.disk"):
        assert store.get(e.key) is None
    assert "corrupt" in caplog.text
    st = store.stats()
    assert st.corrupt == 1 and st.misses == 1 and st.disk_entries == 0
    assert not disk.path(e.key).exists()
    assert store.get(e.key) is None and store.stats().corrupt == 1  # gone, not re-detected


def test_decode_rejects_every_single_byte_flip():
    data = bytearray(encode(make_entry(key(1), tokens=2, layers=1)))
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x40
        with pytest.raises(ValueError):
            decode(bad)


def test_disk_byte_budget_evicts_oldest(tmp_path):
    size = len(encode(make_entry(key(0))))
    store = ChunkStore(host_bytes=0, disk_dir=str(tmp_path), disk_bytes=2 * size)
    for i in range(3):
        store.put(make_entry(key(i)))
    assert key(0) not in store and key(1) in store and key(2) in store
    st = store.stats()
    assert st.disk_bytes == 2 * size and st.evictions == 1
    # a new process sees the same files and keeps the budget
    again = ChunkStore(host_bytes=0, disk_dir=str(tmp_path), disk_bytes=size)
    assert again.stats().disk_entries == 1 and key(2) in again


def test_full_disk_is_logged_counted_and_leaves_no_file(tmp_path, monkeypatch, caplog):
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path))
    real_open = open

    class FullFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    def fake_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return FullFile(f) if "w" in mode else f

    monkeypatch.setattr("builtins.open", fake_open)
    with caplog.at_level(logging.ERROR, logger="chunkcache.store.disk"):
        assert store.put(make_entry(key(9))) is True  # memory kept it
    monkeypatch.undo()
    assert "full" in caplog.text
    st = store.stats()
    assert st.disk_full == 1 and st.disk_entries == 0
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert store.get(key(9)) is not None  # still served from memory


def test_foreign_model_entry_refused(tmp_path):
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path), model_fingerprint=FP)
    with pytest.raises(FingerprintMismatch, match="refusing"):
        store.put(make_entry(key(1), fp="0" * 32))
    ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path)).put(make_entry(key(2), fp="0" * 32))
    with pytest.raises(FingerprintMismatch):
        ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path), model_fingerprint=FP).get(key(2))


def test_thread_safety(tmp_path):
    store = ChunkStore(host_bytes=20 * make_entry(key(0)).nbytes, disk_dir=str(tmp_path))
    errors = []

    def worker(t):
        try:
            for i in range(40):
                k = key(i % 25)
                store.put(make_entry(k, seed=i % 25))
                got = store.get(key((i * 7 + t) % 25))
                if got is not None:
                    assert torch.equal(got.k, make_entry(got.key, seed=int(got.key, 16)).k)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = store.stats()
    assert st.memory_bytes == sum(e.nbytes for e in store.memory.entries.values()) <= 20 * make_entry(key(0)).nbytes


def _writer(root: str, seed: int, rounds: int, barrier) -> None:
    disk = DiskTier(root, 1 << 30)
    e = make_entry(key(42), tokens=256, layers=4, seed=seed)
    barrier.wait()
    for _ in range(rounds):
        assert disk.put(e)


def test_two_processes_writing_the_same_key_never_corrupt_it(tmp_path):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), seed, 30, barrier)) for seed in (1, 2)]
    for p in procs:
        p.start()
    barrier.wait()
    expected = {seed: make_entry(key(42), tokens=256, layers=4, seed=seed) for seed in (1, 2)}
    reader = DiskTier(tmp_path, 1 << 30)
    reads = 0
    while any(p.is_alive() for p in procs) or reads == 0:
        got = reader.get(key(42))
        if got is not None:
            reads += 1
            seed = int(got.token_ids[0])  # make_entry offsets token ids by the seed
            assert_same(expected[seed], got)
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert reader.corrupt == 0
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [f"{key(42)}.kv"]
    assert_same(expected[int(reader.get(key(42)).token_ids[0])], reader.get(key(42)))
    assert os.path.getsize(reader.path(key(42))) == len(encode(expected[1]))


def test_a_tensor_parallel_rank_never_reads_another_ranks_kv_slice(tmp_path):
    """Ranks of one model share a disk (or remote) tier; each holds its own slice of the KV heads."""
    from chunkcache.hashing import chunk_key, shard_fingerprint
    from chunkcache.store import EntryLayout

    ids = list(range(20, 28))
    fps = [shard_fingerprint(FP, rank, 2) for rank in (0, 1)]
    assert shard_fingerprint(FP, 0, 1) == FP and len(set(fps)) == 2
    stores = [ChunkStore(disk_dir=str(tmp_path), model_fingerprint=fp, layout=EntryLayout(fp, 2, 2, 4))
              for fp in fps]
    keys = [chunk_key(fp, "default", "p" * 32, ids) for fp in fps]
    assert keys[0] != keys[1]  # the same chunk has another key on each rank
    stores[0].put(make_entry(keys[0], fp=fps[0]))
    assert stores[0].get(keys[0]) is not None
    assert stores[1].get(keys[1]) is None  # rank 1 looks for its own key: a miss
    assert stores[1].get(keys[0]) is None  # and rank 0's entry, read by its key from the shared disk, does not fit
    with pytest.raises(ValueError, match="tensor-parallel rank 2"):
        shard_fingerprint(FP, 2, 2)
