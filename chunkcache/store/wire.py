"""The wire format of one chunk entry: the bytes a disk tier file and a remote tier value hold (remote.py seals them).

Layout: MAGIC | u32 LE header length | msgpack header | tensor payload.
The header holds the format version, the entry's metadata, one (name, dtype, shape, offset, nbytes) row per
tensor and `checksum` = xxh3-128 over the header packed without `checksum` followed by the payload, so a flipped
bit anywhere (start position, a shape, the KV itself) is caught on read.
Version 1 holds K and V as the entry does; version 2 (written with a codec, `store.compress`) holds them quantised,
with the codec's bits and group and the entry's dtype in the header's `codec` (codec.py), and is decoded on read.
An entry is written as version 1 when it is not compressed, so a reader that knows version 1 only still reads it;
every reader of version 2 reads both, whatever its own `store.compress`.
decode also checks the entry's key against the digests and tokens it carries (ChunkEntry.check_key); whether it
is the key asked for is the reader's check (a file's name, a server's key name).
"""

from __future__ import annotations

import logging
import struct

import msgpack
import torch
import xxhash

from .codec import TENSORS as CODED
from .codec import Codec
from .entry import ChunkEntry

log = logging.getLogger(__name__)

MAGIC = b"CCKV"
HEAD = len(MAGIC) + 4  # the bytes before an encoding's header: MAGIC and the header's length
PLAIN, COMPRESSED = 1, 2  # format versions (above)
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool,
)}


class CorruptEntry(ValueError):
    """Bytes that are not an entry this format wrote: damaged, truncated, another version, or altered."""


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


def header_length(data: bytes | bytearray | memoryview) -> int:
    """The bytes of the header that follows an encoding's first HEAD bytes, read from those; CorruptEntry when they
    are not an encoding's start."""
    if len(data) < HEAD or bytes(data[: len(MAGIC)]) != MAGIC:
        raise CorruptEntry("bad magic")
    return struct.unpack_from("<I", data, len(MAGIC))[0]


def read_header(data: bytes | bytearray | memoryview) -> dict:
    """The header of the encoding `data` starts with (its first HEAD + header_length bytes at least), not verified:
    the checksum covers the payload too. Enough to tell an entry's key and tenant without reading its KV (a purge);
    CorruptEntry when `data` does not hold a whole header."""
    n = header_length(data)
    if HEAD + n > len(data):
        raise CorruptEntry("truncated header")
    try:
        header = msgpack.unpackb(bytes(data[HEAD : HEAD + n]))
    except (ValueError, TypeError) as e:  # msgpack's ExtraData, FormatError and StackError are ValueErrors
        raise CorruptEntry(f"{type(e).__name__}: {e}") from e
    if not isinstance(header, dict):
        raise CorruptEntry(f"header is a {type(header).__name__}, not a map")
    return header


def _parse(data: bytes | bytearray) -> ChunkEntry:
    if not isinstance(data, bytearray):
        data = bytearray(data)  # tensors share the buffer, and torch wants it writable
    header = read_header(data)
    checksum = header.pop("checksum")
    if header["version"] not in (PLAIN, COMPRESSED):
        raise CorruptEntry(f"format version {header['version']}, expected {PLAIN} or {COMPRESSED}")
    payload = memoryview(data)[HEAD + header_length(data) :]
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
