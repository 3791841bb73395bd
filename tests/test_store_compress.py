"""Compressed KV in the disk and remote tiers (`store.compress`, chunkcache/store/codec.py): the error each value may
have, the bytes a token takes, entries of the uncompressed format still read, corrupt compressed entries are
counted misses, and the tiers store compressed and hand back decoded, full-width entries."""

import base64
import logging
import struct

import msgpack
import pytest
import torch
from test_store import FP, assert_same, corrupt_file, key
from store_server import store_secret  # noqa: F401 - an autouse fixture: the remote tier's secret
from test_store_remote import drain, remote_store, stored, valkey  # noqa: F401 - valkey is a fixture

from chunkcache.config import Config, ConfigError
from chunkcache.store import ChunkEntry, ChunkStore
from chunkcache.store.codec import GROUP, Codec, named
from chunkcache.store.disk import DiskTier
from chunkcache.store.remote import key_prefix
from chunkcache.store.wire import COMPRESSED, PLAIN, decode, encode

INT8, INT4 = Codec(8), Codec(4)


def kv_entry(k: str = key(1), tokens: int = 2 * GROUP + 6, dtype=torch.float32, seed: int = 0) -> ChunkEntry:
    """Two whole K groups and a short one; K with an outlier channel (x 20, as real keys have) and a constant one."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, tokens, 2, 64)
    kk, vv = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    kk[..., 3] *= 20
    kk[..., 7] = 0.5
    return ChunkEntry(key=k, token_ids=torch.arange(tokens), k=kk.to(dtype), v=vv.to(dtype), start_pos=5,
                      model_fingerprint=FP)


def header(data: bytes) -> dict:
    (n,) = struct.unpack_from("<I", data, 4)
    return msgpack.unpackb(data[8 : 8 + n])


def half_steps(x: torch.Tensor, bits: int, axis: str) -> torch.Tensor:
    """By hand: each value's half quantisation step, (max - min) / (2^bits - 1) / 2 of its group. K ("channel"): each
    channel over the tokens GROUP at a time (the last group shorter); V ("token"): each token's channels GROUP at a
    time. x [L, T, H, D] float32."""
    bound = torch.empty_like(x)
    T, D = x.shape[1], x.shape[3]
    for s in range(0, T if axis == "channel" else D, GROUP):
        g = x[:, s : s + GROUP] if axis == "channel" else x[..., s : s + GROUP]
        lo = g.amin(1 if axis == "channel" else -1, keepdim=True)
        hi = g.amax(1 if axis == "channel" else -1, keepdim=True)
        half = ((hi - lo) / (2**bits - 1) / 2).expand_as(g)
        if axis == "channel":
            bound[:, s : s + GROUP] = half
        else:
            bound[..., s : s + GROUP] = half
    return bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", [INT8, INT4], ids=["int8", "int4"])
def test_every_value_decodes_within_half_a_step_of_its_group(codec, dtype):
    e = kv_entry(dtype=dtype)
    k, v = codec.decode(codec.encode(e.k, e.v), dtype)
    assert k.dtype == v.dtype == dtype and k.shape == v.shape == e.k.shape
    for got, want, axis in [(k, e.k, "channel"), (v, e.v, "token")]:
        want = want.float()
        # the float16 parameters round the step by up to 2^-11 of itself; float32 arithmetic adds ~1e-7
        bound = half_steps(want, codec.bits, axis) * (1 + 2**-10) + 1e-6
        if dtype == torch.bfloat16:  # then the decoded value is rounded to bfloat16: half its ulp, <= 2^-8 of it
            bound += got.float().abs() * 2**-8
        err = (got.float() - want).abs()
        assert (err <= bound).all(), f"{axis}: error {float((err - bound).max()):+g} over the bound"
    assert torch.equal(k[..., 7], e.k[..., 7])  # a constant channel (step 0) is exact


@pytest.mark.parametrize("name,per_token", [("none", 23_040), ("int8", 12_960), ("int4", 7_200)])
def test_bytes_per_token_for_the_default_models_shape(name, per_token):
    """SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, bfloat16. By hand per token and layer-head: uncompressed
    2 * 64 * 2 = 256 B; int8 64 + 64 B of codes, K's parameters 2 float16 per channel per 32 tokens (64 * 4 / 32 =
    8 B), V's 2 float16 per 32 channels (2 * 4 = 8 B): 144 B; int4 32 + 32 + 8 + 8 = 80 B. Times 30 * 3."""
    e = ChunkEntry(key=key(1), token_ids=torch.arange(64), k=torch.randn(30, 64, 3, 64).bfloat16(),
                   v=torch.randn(30, 64, 3, 64).bfloat16(), start_pos=0, model_fingerprint=FP)
    codec = named(name)
    kv = {"k": e.k, "v": e.v} if codec is None else codec.encode(e.k, e.v)
    assert sum(t.numel() * t.element_size() for t in kv.values()) == 64 * per_token
    h = header(encode(e, codec))
    assert h["payload_bytes"] == 64 * (per_token + 8)  # and the token ids' int64
    assert h["version"] == (PLAIN if codec is None else COMPRESSED)


# an entry as the disk tier wrote it before compression existed (format version 1; encoded by commit 1d45b9e):
# k [[[[0.5, -1]], [[2, 0.25]]]], v [[[[1.5, 3]], [[-0.75, 4]]]], tokens [7, 9], start 3, feature s = [1, 2]
OLD_ENTRY = base64.b64decode(
    "Q0NLVgMBAACHp3ZlcnNpb24Bo2tledkgMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMDGxbW9kZWxfZmluZ2VycHJpbnTZIGZmZmZmZmZm"
    "ZmZmZmZmZmZmZmZmZmZmZmZmZmZmZmZmqXN0YXJ0X3BvcwOndGVuc29yc5SVqXRva2VuX2lkc6VpbnQ2NJECABCVoWunZmxvYXQzMpQBAgECEBCV"
    "oXanZmxvYXQzMpQBAgECIBCVqmZlYXR1cmVzL3OnZmxvYXQzMpECMAitcGF5bG9hZF9ieXRlczioY2hlY2tzdW3ZIDgwM2VlZmZjMjBiYzM4ZWMy"
    "ODk5ZGFkZTE0YjZiNmZmBwAAAAAAAAAJAAAAAAAAAAAAAD8AAIC/AAAAQAAAgD4AAMA/AABAQAAAQL8AAIBAAACAPwAAAEA=")


def test_an_entry_of_the_old_format_still_reads_and_is_still_written_so(tmp_path):
    old = ChunkEntry(key=f"{1:032x}", token_ids=torch.tensor([7, 9]), k=torch.tensor([[[[0.5, -1.0]], [[2.0, 0.25]]]]),
                     v=torch.tensor([[[[1.5, 3.0]], [[-0.75, 4.0]]]]), start_pos=3, model_fingerprint=FP,
                     features={"s": torch.tensor([1.0, 2.0])})
    assert_same(decode(OLD_ENTRY), old)
    assert encode(old) == OLD_ENTRY  # uncompressed entries are written as before: older readers read them
    disk = DiskTier(tmp_path, 1 << 20)
    path = disk.path(old.key)
    path.parent.mkdir()
    path.write_bytes(OLD_ENTRY)
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path), compress="int8")
    assert_same(store.get(old.key), old)


def test_an_entry_the_codec_cannot_hold_is_written_uncompressed():
    e = kv_entry()
    e.k[0, 0, 0, 0] = float("nan")
    data = encode(e, INT8)
    assert header(data)["version"] == PLAIN
    assert_same(decode(data), e)


@pytest.mark.parametrize("how", ["payload", "header", "truncated"])
def test_a_corrupt_compressed_entry_is_a_counted_miss(tmp_path, caplog, how):
    e = kv_entry()
    ChunkStore(host_bytes=0, disk_dir=str(tmp_path), compress="int4").put(e)
    path = DiskTier(tmp_path, 1 << 20).path(e.key)
    assert header(path.read_bytes())["version"] == COMPRESSED
    corrupt_file(path, how)
    store = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path), compress="int4")
    with caplog.at_level(logging.WARNING, logger="chunkcache.store.disk"):
        assert store.get(e.key) is None
    st = store.stats()
    assert (st.corrupt, st.misses, st.disk_entries) == (1, 1, 0) and not path.exists() and "corrupt" in caplog.text


def test_decode_rejects_every_single_byte_flip_of_a_compressed_entry():
    e = ChunkEntry(key(1), torch.arange(3), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4), 0, FP)
    data = encode(e, INT4)
    assert header(data)["version"] == COMPRESSED
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x40
        with pytest.raises(ValueError):
            decode(bad)


def test_the_disk_tier_stores_compressed_and_returns_decoded_entries(tmp_path):
    e = kv_entry(dtype=torch.bfloat16)
    writer = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path), compress="int8")
    writer.put(e)
    assert_same(writer.get(e.key), e)  # memory keeps what was put, full precision
    path = writer.disk.path(e.key)
    assert header(path.read_bytes())["version"] == COMPRESSED
    assert path.stat().st_size < 0.6 * len(encode(e)) and writer.stats().disk_bytes == path.stat().st_size

    reader = ChunkStore(host_bytes=1 << 20, disk_dir=str(tmp_path))  # compress: none reads it all the same
    got = reader.get(e.key)
    want = decode(encode(e, INT8))
    assert_same(got, want)
    assert got.dtype == torch.bfloat16 and not torch.equal(got.k, e.k)
    assert reader.stats().disk_hits == 1 and reader.memory.get(e.key) is got  # promoted decoded, full width
    assert reader.stats().memory_bytes == e.nbytes


def test_the_remote_tier_stores_compressed_and_returns_decoded_entries(valkey, tmp_path):  # noqa: F811
    e = kv_entry(dtype=torch.bfloat16)
    a = remote_store(valkey.url, compress="int4", disk_dir=str(tmp_path / "a"))
    a.put(e)
    drain(a)
    value = stored(valkey.client(), key_prefix(FP) + e.key)
    assert value == encode(e, INT4) and header(value)["version"] == COMPRESSED
    assert a.disk.path(e.key).read_bytes() == value  # the knob reaches both tiers
    sent = a.stats().remote.bytes_written
    assert sent == len(valkey.client().get(key_prefix(FP) + e.key)) and len(value) < 0.35 * len(encode(e))

    b = remote_store(valkey.url, compress="none", disk_dir=str(tmp_path / "b"))
    got = b.get(e.key)
    assert_same(got, decode(value))
    assert got.dtype == torch.bfloat16
    st = b.stats()
    assert (st.remote.hits, st.remote.corrupt, st.memory_entries, st.disk_entries) == (1, 0, 1, 1)
    assert header(b.disk.path(e.key).read_bytes())["version"] == PLAIN  # b's own disk writes as b says


def test_compress_is_checked_at_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("store:\n  compress: none\n")
    assert Config.load(path).store.compress == "none" and Config().store.compress == "int8"
    path.write_text("store:\n  compress: fp8\n")
    with pytest.raises(ConfigError, match="compress"):
        Config.load(path)
