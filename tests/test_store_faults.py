"""Disk-tier entries that cannot be read, or decode but do not fit the model: each is a counted miss and is dropped,
never an exception that fails every request using its chunk."""

import errno
import logging
from dataclasses import replace

import pytest

from chunkcache.store import ChunkStore, EntryLayout
from chunkcache.store.disk import DiskTier
from chunkcache.store.wire import encode

from test_store import FP, key, make_entry

# make_entry's KV: 2 layers, 2 KV heads, head_dim 4
LAYOUT = EntryLayout(FP, num_layers=2, num_kv_heads=2, head_dim=4)


def store_over(tmp_path, layout=LAYOUT) -> ChunkStore:
    """A store whose gets all reach the disk tier (no host tier in front)."""
    return ChunkStore(host_bytes=0, disk_dir=str(tmp_path), model_fingerprint=FP, layout=layout)


def test_directory_in_place_of_an_entry_is_a_counted_miss_and_removed(tmp_path, caplog):
    store = store_over(tmp_path)
    path = store.disk.path(key(1))
    path.mkdir(parents=True)
    (path / "junk").write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="chunkcache.store.disk"):
        assert store.get(key(1)) is None  # was: IsADirectoryError out of DiskTier.get, every request
    assert "IsADirectoryError" in caplog.text
    st = store.stats()
    assert (st.corrupt, st.misses) == (1, 1) and not path.exists()
    store.put(make_entry(key(1)))  # the slot is usable again
    assert store.get(key(1)) is not None


@pytest.mark.parametrize("code", [errno.EACCES, errno.EIO])
def test_unreadable_entry_is_a_counted_miss(tmp_path, monkeypatch, code):
    store = store_over(tmp_path)
    store.put(make_entry(key(2)))

    def failing_open(*args, **kwargs):
        raise OSError(code, "injected")

    monkeypatch.setattr("chunkcache.store.disk.open", failing_open, raising=False)
    assert store.get(key(2)) is None
    monkeypatch.undo()
    assert store.stats().corrupt == 1 and store.stats().misses == 1
    assert store.get(key(2)) is None  # dropped: a file that failed to read is not trusted later


@pytest.mark.parametrize("entry, reason", [
    (make_entry(key(3), layers=3), "[layers, kv heads, head_dim] = [3, 2, 4], the model has [2, 2, 4]"),
    (replace(make_entry(key(3)), k=make_entry(key(3)).k.repeat(1, 1, 1, 48), v=make_entry(key(3)).v.repeat(1, 1, 1, 48)),
     "[2, 2, 192], the model has [2, 2, 4]"),
    (make_entry(key(3), fp="0" * 32), "computed by model 00000000000000000000000000000000"),
])
def test_entry_that_decodes_but_does_not_fit_the_model_is_dropped(tmp_path, caplog, entry, reason):
    """A valid checksum is not enough: the probe's head_dim-192 entry was kept and failed every request."""
    DiskTier(tmp_path, 1 << 20).put(entry)  # written by something else (another model, a bug, a hand)
    store = store_over(tmp_path)
    with caplog.at_level(logging.WARNING, logger="chunkcache.store.disk"):
        assert store.get(entry.key) is None
    assert reason in caplog.text
    assert store.stats().corrupt == 1 and not store.disk.path(entry.key).exists()


def test_entry_that_fits_is_served(tmp_path):
    e = make_entry(key(4))
    (tmp_path / e.key[:2]).mkdir()
    (tmp_path / e.key[:2] / f"{e.key}.kv").write_bytes(encode(e))
    got = store_over(tmp_path).get(e.key)
    assert got is not None and got.k.shape == e.k.shape
