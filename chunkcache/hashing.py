"""Content keys: 128-bit BLAKE2b digests, stable across processes, machines and Python versions.

Every field is length-prefixed before hashing so that no two different field tuples produce the same byte stream.
A key names everything its entry's KV is a function of (chunkcache.store.entry): the model, the tenant, the context
the tokens attended to and the tokens. Keys are cryptographic: a client can craft text, and a crafted collision of a
context digest would let KV that attended to other text answer for it (token ids are checked on every hit, the
contexts they attended to only through their digest). Model fingerprints hash operator-supplied weight files with
xxh3 (fast over gigabytes; no client chooses them).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xxhash

KEY_VERSION = b"chunkcache-key-v2"
FINGERPRINT_VERSION = b"chunkcache-model-v1"
# Weight files up to this size are hashed whole (270 MB takes ~0.1 s); bigger ones are sampled so that a 16 GB
# model costs ~SAMPLE_BLOCKS MiB of reads, not 16 GB.
FULL_HASH_BYTES = 1 << 30
SAMPLE_BLOCKS = 64
SAMPLE_BLOCK_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# config.json keys that change when a checkpoint is re-saved but do not change what the model computes
CONFIG_KEYS_IGNORED = ("transformers_version", "_name_or_path")

TokenIds = Sequence[int] | torch.Tensor | np.ndarray


def _token_bytes(token_ids: TokenIds) -> bytes:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    return np.asarray(token_ids, dtype="<i8").reshape(-1).tobytes()


def _digest(*fields: bytes, h=None) -> str:
    """BLAKE2b-128 of the length-prefixed fields (`h`: another hash object, for the model fingerprint)."""
    h = hashlib.blake2b(digest_size=16) if h is None else h
    for f in fields:
        h.update(struct.pack("<Q", len(f)))
        h.update(f)
    return h.hexdigest()


def prefix_key(token_ids: TokenIds) -> str:
    """Identity of a context: the token ids an entry's KV attended to before its own (a shared prefix, or automatic
    detection's head and the paragraph before a segment)."""
    return _digest(KEY_VERSION, b"prefix", _token_bytes(token_ids))


def tenant_key(namespace: str, cache_salt: str | None = None) -> str:
    """Identity of a tenant: the namespace and SGLang's per-request isolation salt (requests with different salts
    never share a chunk, as they never share a radix prefix)."""
    fields = [KEY_VERSION, b"tenant", namespace.encode()]
    if cache_salt:
        fields += [b"salt", cache_salt.encode()]
    return _digest(*fields)


def entry_key(model_fingerprint: str, tenant: str, context: str, token_ids: TokenIds) -> str:
    """Store key of one entry from its digests (tenant_key, prefix_key of its context): what a reader recomputes
    from a stored entry's own header to check that the entry is what its key names."""
    return _digest(KEY_VERSION, b"chunk", model_fingerprint.encode(), tenant.encode(), context.encode(),
                   _token_bytes(token_ids))


def chunk_key(model_fingerprint: str, namespace: str, prefix: str, token_ids: TokenIds,
              cache_salt: str | None = None) -> str:
    """Store key of one chunk: its KV depends on the model, the tenant (namespace, `cache_salt`), the context it
    follows (`prefix`, a prefix_key) and its tokens."""
    return entry_key(model_fingerprint, tenant_key(namespace, cache_salt), prefix, token_ids)


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """Identity of a model directory from its config and weight files, without loading the model."""
    d = Path(model_dir)
    config = json.loads((d / "config.json").read_text())
    for k in CONFIG_KEYS_IGNORED:
        config.pop(k, None)
    fields = [FINGERPRINT_VERSION, json.dumps(config, sort_keys=True, separators=(",", ":")).encode()]
    weights = sorted(p for p in d.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise FileNotFoundError(f"{d}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    for p in weights:
        fields += [p.name.encode(), struct.pack("<Q", p.stat().st_size), _file_identity(p)]
    return _digest(*fields, h=xxhash.xxh3_128())  # unchanged since v1: calibrations name their weights by it


def shard_fingerprint(fingerprint: str, tp_rank: int, tp_size: int) -> str:
    """The fingerprint of one tensor-parallel rank's KV (its slice of the KV heads): with a shared disk or remote
    tier, a rank must never read another rank's slice, so both its chunk keys and its entries' model check carry the
    rank. One rank (tp_size 1) keeps the model's fingerprint, which the reference blender shares."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is not in [0, {tp_size})")
    return fingerprint if tp_size == 1 else f"{fingerprint}:tp{tp_rank}of{tp_size}"


def _file_identity(path: Path) -> bytes:
    size = path.stat().st_size
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        if path.suffix == ".safetensors":
            # the header names every tensor with its dtype, shape and offset
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(n))
            f.seek(0)
        if size <= FULL_HASH_BYTES:
            while block := f.read(16 << 20):
                h.update(block)
        else:
            for i in range(SAMPLE_BLOCKS):
                f.seek((size - SAMPLE_BLOCK_BYTES) * i // (SAMPLE_BLOCKS - 1))
                h.update(f.read(SAMPLE_BLOCK_BYTES))
    return h.digest()
