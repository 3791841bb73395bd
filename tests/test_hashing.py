import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from chunkcache import hashing
from chunkcache.hashing import chunk_key, model_fingerprint, prefix_key

FP = "0" * 32


def write_model(d, config=None, weights=(1.0, 2.0)):
    d.mkdir(exist_ok=True)
    config = config or {"model_type": "llama", "hidden_size": 8, "transformers_version": "5.19.0"}
    (d / "config.json").write_text(json.dumps(config))
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(weights)], "data_offsets": [0, 4 * len(weights)]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + struct.pack(f"<{len(weights)}f", *weights))
    return d


def test_fixed_vectors():
    # pinned: a change here invalidates every store on every machine, so it must be deliberate (bump KEY_VERSION)
    assert prefix_key([1, 2, 3]) == "d600116d1c47521095b6f5e3dabc3e05"
    assert chunk_key(FP, "default", prefix_key([1, 2, 3]), [10, 20, 30]) == "c744f214a019a35cb0317e1bf462759e"
    # BLAKE2b-128 over the length-prefixed fields: a key a client cannot craft a collision for
    import hashlib

    fields = [b"chunkcache-key-v2", b"prefix", np.asarray([1, 2, 3], dtype="<i8").tobytes()]
    h = hashlib.blake2b(digest_size=16)
    for f in fields:
        h.update(struct.pack("<Q", len(f)) + f)
    assert h.hexdigest() == prefix_key([1, 2, 3])


def test_fixed_fingerprint(tmp_path):
    assert model_fingerprint(write_model(tmp_path / "m")) == "d33a46d9eba01c4fa74ff138f99f155d"


def test_token_id_containers_agree():
    ids = [5, 0, 49151, 7]
    expected = chunk_key(FP, "ns", "p", ids)
    for same in (torch.tensor(ids), torch.tensor(ids, dtype=torch.int32), np.array(ids, dtype=np.uint16), tuple(ids)):
        assert chunk_key(FP, "ns", "p", same) == expected


def test_stable_across_processes(tmp_path):
    model = write_model(tmp_path / "m")
    code = (
        "from chunkcache.hashing import chunk_key, prefix_key, model_fingerprint;"
        f"print(chunk_key(model_fingerprint({str(model)!r}), 'ns', prefix_key([1, 2]), [3, 4, 5]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == chunk_key(model_fingerprint(model), "ns", prefix_key([1, 2]), [3, 4, 5])


def test_every_field_changes_the_key():
    base = (FP, "ns", prefix_key([1, 2]), [3, 4, 5])
    variants = [
        ("1" * 32, "ns", prefix_key([1, 2]), [3, 4, 5]),
        (FP, "other", prefix_key([1, 2]), [3, 4, 5]),
        (FP, "ns", prefix_key([1, 2, 0]), [3, 4, 5]),
        (FP, "ns", prefix_key([]), [3, 4, 5]),
        (FP, "ns", prefix_key([1, 2]), [3, 4]),
        (FP, "ns", prefix_key([1, 2]), [3, 5, 4]),
        (FP, "ns", prefix_key([1, 2]), [3, 4, 5 + (1 << 32)]),
        (FP, "ns", prefix_key([1, 2]), []),
        # field boundaries are length-prefixed: moving characters between fields changes the key
        (FP + "n", "s", prefix_key([1, 2]), [3, 4, 5]),
    ]
    keys = {chunk_key(*v) for v in variants}
    assert chunk_key(*base) not in keys and len(keys) == len(variants)


def test_fingerprint_tracks_config_and_weights_but_not_resave_noise(tmp_path):
    base = model_fingerprint(write_model(tmp_path / "a"))
    resaved = {"hidden_size": 8, "model_type": "llama", "transformers_version": "9.9.9", "_name_or_path": "/x"}
    assert model_fingerprint(write_model(tmp_path / "b", config=resaved)) == base
    assert model_fingerprint(write_model(tmp_path / "c", config={"model_type": "llama", "hidden_size": 9})) != base
    assert model_fingerprint(write_model(tmp_path / "d", weights=(1.0, 2.5))) != base
    d = write_model(tmp_path / "e")
    (d / "model-extra.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    assert model_fingerprint(d) != base


def test_fingerprint_requires_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weight files"):
        model_fingerprint(tmp_path)


def test_big_model_is_sampled_not_read(tmp_path, monkeypatch):
    d = write_model(tmp_path / "m")
    with open(d / "model-00002.safetensors", "wb") as f:
        header = b'{"__metadata__":{}}'
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(16 << 30)  # sparse: 16 GiB that costs nothing on disk
    read = 0
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=-1):
            nonlocal read
            data = self.f.read(n)
            read += len(data)
            return data

        def seek(self, *a):
            return self.f.seek(*a)

    monkeypatch.setattr(hashing, "open", lambda *a, **kw: Counting(real_open(*a, **kw)), raising=False)
    model_fingerprint(d)
    assert read <= hashing.SAMPLE_BLOCKS * hashing.SAMPLE_BLOCK_BYTES + (1 << 20)


def test_cache_salt_separates_tenants_and_leaves_unsalted_keys_unchanged():
    """SGLang's `cache_salt` isolates tenants in the radix tree; the chunk store must too."""
    args = (FP, "default", prefix_key([1, 2, 3]), [10, 20, 30])
    assert chunk_key(*args, cache_salt=None) == chunk_key(*args, cache_salt="") == "c744f214a019a35cb0317e1bf462759e"
    salted = {chunk_key(*args, cache_salt=s) for s in ("user-1", "user-2")}
    assert len(salted) == 2 and chunk_key(*args) not in salted
    # the salt is its own field: it cannot be forged by moving characters into the namespace
    assert chunk_key(FP, "defaultuser-1", *args[2:]) not in salted
