"""Disk tier: one file per entry, safe against crashes, concurrent writers, corruption and a full disk.

A file holds one entry in the wire format (wire.py: versioned, checksummed, K and V compressed with the tier's
codec, `store.compress`), named by its key.

Writes go to a uniquely named temp file in the same directory and are renamed into place (os.replace is atomic),
so readers and other processes writing the same key only ever see complete files. No fsync: a file torn by a
power loss fails its checksum and is dropped like any other corrupt entry.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
import uuid
from collections import OrderedDict
from pathlib import Path

from .codec import Codec
from .entry import ChunkEntry, EntryLayout
from .wire import HEAD, CorruptEntry, decode, encode, header_length, read_header

log = logging.getLogger(__name__)

SUFFIX = ".kv"
# temp files this old were left by a crashed writer, not one still writing
STALE_TEMP_SECONDS = 3600


class DiskTier:
    """Not locked itself (`ChunkStore` serialises a process's access); safe across processes by construction."""

    def __init__(self, root: str | os.PathLike, budget_bytes: int, layout: EntryLayout | None = None,
                 codec: Codec | None = None):
        """`layout`, if given: entries that do not fit it are dropped on read like corrupt ones. `codec`, if given:
        entries are written compressed (read either way)."""
        self.root = Path(root)
        self.layout = layout
        self.codec = codec
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.sizes: OrderedDict[str, int] = OrderedDict()  # oldest use first; files other processes add join on read
        self.bytes = 0
        self.evictions = 0
        self.corrupt = 0
        self.disk_full = 0
        self._scan()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def __len__(self) -> int:
        return len(self.sizes)

    def get(self, key: str) -> ChunkEntry | None:
        """The entry, or None: absent, or dropped because it cannot be read (a directory in its place, EACCES, EIO),
        fails verification or does not fit `layout` - a counted miss either way, never an exception, so one bad
        file cannot fail every request that uses its chunk."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
            entry = decode(data)
            if entry.key != key:
                raise CorruptEntry(f"file holds key {entry.key}")
            if self.layout is not None:
                self.layout.check(entry)
        except FileNotFoundError:
            self._forget(key)
            return None
        except (OSError, ValueError) as e:  # CorruptEntry, FingerprintMismatch and a layout misfit are ValueErrors
            self.corrupt += 1
            log.warning("dropping corrupt or unusable chunk-store entry %s: %s: %s", path, type(e).__name__, e)
            self._drop(path)
            self._forget(key)
            return None
        self._touch(key, len(data))
        return entry

    def _drop(self, path: Path) -> None:
        """Remove what is at an entry's path; if even that fails, the next read counts it again (logged)."""
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        except OSError as e:
            log.error("cannot remove unusable chunk-store entry %s: %s", path, e)

    def put(self, entry: ChunkEntry) -> bool:
        """Write an entry; False if it was not stored (bigger than the budget, or the disk is full)."""
        data = encode(entry, self.codec)
        if len(data) > self.budget_bytes:
            return False
        path = self.path(entry.key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{entry.key}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.disk_full += 1
            log.error("chunk store disk %s is full; entry %s not written (%s)", self.root, entry.key, e)
            return False
        self._touch(entry.key, len(data))
        self._evict(keep=entry.key)
        return True

    def pop(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)
        self._forget(key)

    def purge(self, tenant: str) -> int:
        """Every file in the directory whose header names `tenant` (files other processes wrote too), found by
        reading headers, never KV; a file that cannot be read or has no header is left to the read that drops it."""
        n = 0
        for path in self._files():
            try:
                with open(path, "rb") as f:
                    head = f.read(HEAD)
                    head += f.read(header_length(head))
                if read_header(head).get("tenant") != tenant:
                    continue
            except (OSError, CorruptEntry):
                continue
            self._forget(path.name.removesuffix(SUFFIX))
            try:
                path.unlink()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            n += 1
        return n

    def clear(self) -> int:
        """Every entry file in the directory, other processes' too (a directory shared by servers is emptied for
        all of them)."""
        n = 0
        for path in self._files():
            try:
                path.unlink()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            n += 1
        self.sizes.clear()
        self.bytes = 0
        return n

    def _files(self) -> list[Path]:
        return list(self.root.glob(f"*/*{SUFFIX}"))

    def _touch(self, key: str, size: int) -> None:
        self._forget(key)
        self.sizes[key] = size
        self.bytes += size

    def _forget(self, key: str) -> None:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.bytes -= size

    def _evict(self, keep: str) -> None:
        for key in list(self.sizes):
            if self.bytes <= self.budget_bytes:
                break
            if key != keep:
                self.pop(key)
                self.evictions += 1

    def _scan(self) -> None:
        files = []
        for p in self.root.glob("*/*"):
            try:
                st = p.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            if p.name.endswith(".tmp"):
                if time.time() - st.st_mtime > STALE_TEMP_SECONDS:
                    p.unlink(missing_ok=True)
            elif p.name.endswith(SUFFIX):
                files.append((st.st_mtime, p.name.removesuffix(SUFFIX), st.st_size))
        for _, key, size in sorted(files):
            self._touch(key, size)
        self._evict(keep="")
