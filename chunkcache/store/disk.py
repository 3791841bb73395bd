"""Disk tier: one file per entry, safe against crashes, concurrent writers, corruption and a full disk.

File layout: MAGIC | u32 LE header length | msgpack header | tensor payload.
The header holds the format version, the entry's metadata, one (name, dtype, shape, offset, nbytes) row per
tensor and `checksum` = xxh3-128 over the header packed without `checksum` followed by the payload, so a flipped
bit anywhere (start position, a shape, the KV itself) is caught on read.
Version 1 holds K and V as the entry does; version 2 (written with a codec, `store.compress`) holds them quantised,
with the codec's bits and group and the entry's dtype in the header's `codec` (codec.py), and is decoded on read.
An entry is written as version 1 when it is not compressed, so a reader that knows version 1 only still reads it;
every reader of version 2 reads both, whatever its own `store.compress`.

Writes go to a uniquely named temp file in the same directory and are renamed into place (os.replace is atomic),
so readers and other processes writing the same key only ever see complete files. No fsync: a file torn by a
power loss fails its checksum and is dropped like any other corrupt entry.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import msgpack
import torch
import xxhash

from .codec import TENSORS as CODED, Codec
from .entry import ChunkEntry, EntryLayout

log = logging.getLogger(__name__)

MAGIC = b"CCKV"
PLAIN, COMPRESSED = 1, 2  # format versions (above)
SUFFIX = ".kv"
# temp files this old were left by a crashed writer, not one still writing
STALE_TEMP_SECONDS = 3600
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool,
)}


class CorruptEntry(ValueError):
    pass


def encode(entry: ChunkEntry, codec: Codec | None = None) -> bytes:
    """The entry's bytes; with `codec`, its K and V quantised (version 2), unless the codec cannot hold them (a value
    not finite or beyond float16's range): then as they are (version 1), which holds any bits. Features as they are."""
    header = {"version": PLAIN}
    kv = {"k": entry.k, "v": entry.v}
    if codec is not None:
        try:
            kv = codec.encode(entry.k, entry.v)
        except ValueError as e:
            log.debug("chunk-store entry %s written uncompressed: %s", entry.key, e)
        else:
            header = {"version": COMPRESSED, "codec": {"bits": codec.bits, "group": codec.group,
                                                       "dtype": str(entry.dtype).removeprefix("torch.")}}
    tensors = {"token_ids": entry.token_ids, **kv}
    tensors.update({f"features/{name}": t for name, t in entry.features.items()})
    rows, blobs, offset = [], [], 0
    for name, t in tensors.items():
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        rows.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, len(data)])
        blobs.append(data)
        offset += len(data)
    payload = b"".join(blobs)
    header.update({
        "key": entry.key,
        "model_fingerprint": entry.model_fingerprint,
        "start_pos": entry.start_pos,
        # the digests its key is checked against on read (ChunkEntry.check_key); an entry without them (made outside
        # a server's store) is written as before they existed
        **({"tenant": entry.tenant, "context": entry.context} if entry.tenant or entry.context else {}),
        "tensors": rows,
        "payload_bytes": len(payload),
    })
    header["checksum"] = _checksum(header, payload)
    packed = msgpack.packb(header)
    return MAGIC + struct.pack("<I", len(packed)) + packed + payload


def decode(data: bytes | bytearray) -> ChunkEntry:
    """Parse and verify one file's bytes; CorruptEntry on any inconsistency."""
    try:
        return _parse(data)
    except CorruptEntry:
        raise
    except (KeyError, ValueError, TypeError, IndexError, AttributeError, RuntimeError, struct.error) as e:
        # whatever a damaged header makes msgpack, torch or the entry's own checks raise
        raise CorruptEntry(f"{type(e).__name__}: {e}") from e


def _parse(data: bytes | bytearray) -> ChunkEntry:
    if not isinstance(data, bytearray):
        data = bytearray(data)  # tensors share the buffer, and torch wants it writable
    if data[: len(MAGIC)] != MAGIC:
        raise CorruptEntry("bad magic")
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if start + n > len(data):
        raise CorruptEntry("truncated header")
    header = msgpack.unpackb(bytes(data[start : start + n]))
    checksum = header.pop("checksum")
    if header["version"] not in (PLAIN, COMPRESSED):
        raise CorruptEntry(f"format version {header['version']}, expected {PLAIN} or {COMPRESSED}")
    payload = memoryview(data)[start + n :]
    if len(payload) != header["payload_bytes"]:
        raise CorruptEntry(f"payload is {len(payload)} bytes, header says {header['payload_bytes']} (truncated?)")
    if _checksum(header, payload) != checksum:
        raise CorruptEntry("checksum mismatch")
    tensors = {}
    for name, dtype, shape, offset, nbytes in header["tensors"]:
        raw = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else torch.empty(0, dtype=torch.uint8)
        tensors[name] = raw.view(DTYPES[dtype]).reshape(shape)
    features = {name.removeprefix("features/"): t for name, t in tensors.items() if name.startswith("features/")}
    if header["version"] == COMPRESSED:
        spec = header["codec"]
        k, v = Codec(spec["bits"], spec["group"]).decode({n: tensors[n] for n in CODED}, DTYPES[spec["dtype"]])
    else:
        k, v = tensors["k"], tensors["v"]
    entry = ChunkEntry(
        key=header["key"], token_ids=tensors["token_ids"], k=k, v=v,
        start_pos=header["start_pos"], model_fingerprint=header["model_fingerprint"], features=features,
        tenant=header.get("tenant", ""), context=header.get("context", ""),
    )
    entry.check_key()
    return entry


def _checksum(header: dict, payload: bytes | memoryview) -> str:
    h = xxhash.xxh3_128(msgpack.packb(header))
    h.update(payload)
    return h.hexdigest()


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
