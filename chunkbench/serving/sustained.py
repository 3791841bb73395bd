"""Sustained cross-server reuse: two chunkcache servers behind SGLang's router (examples/cluster.py, round robin)
over a Valkey Cluster (3 primaries, a replica each), a long run of RAG requests whose passages follow a Zipf
popularity over a pool several times one server's host tier.

    .venv/bin/python -m chunkbench.serving.sustained [--requests 1000] [--pool 64] [--per-request 4] \
        [--words 110] [--host-mb 48] [--zipf 1.0] [--out results/sustained.json]

Each request is a chat request through the router with `--per-request` distinct passages drawn by popularity, in a
random order, a question about one of them, one output token (its latency is the TTFT). Round robin sends request i
to server i mod 2 (checked at the end against each server's request count); server B is the second. Prints, per
window of requests (100-500 and 500-1000 by default), each server's chunk hit rate (hits over hits + misses, as its
reports say), the share of its hits the cluster served, and its median TTFT; and B's second window over its first
(the goal: within 10 % for hit rate and TTFT). The anchor fades if the second window falls behind the first: the
store evicting what the fleet needs, the host tiers thrashing, or the servers' own state growing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import sys
import time
from pathlib import Path

import requests
import yaml

from chunkcache.config import REMOTE_SECRET_ENV, config_file
from sglang_patch.serve.server_process import ServerProcess, free_ports

from .auto_bench import zipf_sample
from .valkey_cluster import ValkeyCluster

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("harbor lantern copper meadow archive signal orchard falcon granite winter ledger compass velvet summit "
         "canal beacon thistle quarry ember willow").split()


def passages(n: int, words: int) -> list[str]:
    rng = random.Random(11)
    return [f"Passage {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + f". The code of passage {i} is "
            f"{5000 + 13 * i}." for i in range(n)]


def ask(url: str, docs: list[str], question: str) -> tuple[float, dict]:
    t = time.perf_counter()
    r = requests.post(url + "/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": question}], "max_tokens": 1, "temperature": 0,
        "chat_template_kwargs": {"chunkcache": {"documents": docs}}})
    seconds = time.perf_counter() - t
    r.raise_for_status()
    return seconds, r.json()["metadata"]["chunkcache"]


def window(rows: list[dict], server: int, lo: int, hi: int) -> dict:
    mine = [r for r in rows[lo:hi] if r["server"] == server]
    hits = sum(r["hits"] for r in mine)
    looked = hits + sum(r["misses"] for r in mine)
    return {"requests": len(mine), "hit_rate": hits / looked if looked else None,
            "fetched_share": sum(r["fetched"] for r in mine) / hits if hits else None,
            "ttft_s": statistics.median(r["ttft_s"] for r in mine)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m chunkbench.serving.sustained", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--windows", default="100,500,1000", help="window bounds over the request index")
    p.add_argument("--pool", type=int, default=64, help="passages in the pool")
    p.add_argument("--per-request", type=int, default=4)
    p.add_argument("--words", type=int, default=110, help="words per passage (~1.4 tokens each)")
    p.add_argument("--host-mb", type=int, default=48, help="store.host_bytes of each server, MB")
    p.add_argument("--zipf", type=float, default=1.0, help="popularity of the passage ranked r: 1 / r^zipf")
    p.add_argument("--out", default="results/sustained.json")
    p.add_argument("--tmp", default="results/sustained")
    args = p.parse_args()
    tmp = Path(args.tmp).resolve()
    tmp.mkdir(parents=True, exist_ok=True)
    pool = passages(args.pool, args.words)
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.pool)]
    rng = random.Random(3)
    config = yaml.safe_load(config_file("default").read_text())
    config["store"].update(host_bytes=args.host_mb << 20, remote_timeout_s=2.0, remote_retry_s=1.0)
    config["serve"]["max_total_tokens"] = 32768  # the same KV pool on both servers, whatever memory each saw free
    config_path = tmp / "sustained.yaml"
    config_path.write_text(yaml.safe_dump(config))
    store = ValkeyCluster(tmp, 3, "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru")
    os.environ.setdefault(REMOTE_SECRET_ENV, secrets.token_hex(32))  # the store's secret, inherited by the servers
    port = free_ports(3)
    router = f"http://127.0.0.1:{port}"
    workers = [f"http://127.0.0.1:{port + 1 + i}" for i in range(2)]
    fleet = ServerProcess(
        [sys.executable, str(ROOT / "examples" / "cluster.py"), "--remote-url", store.url, "--workers", "2",
         "--port", str(port), "--policy", "round_robin", "--config", str(config_path), "--log-dir",
         str(tmp / "logs"), "--enable-metrics"], url=router, log_path=tmp / "cluster.log")
    rows: list[dict] = []
    try:
        deadline = time.time() + 900
        while f"router {router}" not in fleet.log():  # the script's "ready" line
            if not fleet.alive() or time.time() > deadline:
                raise RuntimeError(f"the cluster did not start: {tmp / 'cluster.log'}, {tmp / 'logs'}")
            time.sleep(1)
        for i in range(args.requests):
            chosen = zipf_sample(rng, weights, args.per_request)
            rng.shuffle(chosen)
            target = rng.choice(chosen)
            ttft, report = ask(router, [pool[j] for j in chosen], f"What is the code of passage {target}?")
            rows.append({"i": i, "server": i % 2, "ttft_s": ttft, "hits": report.get("chunk_hits", 0),
                         "misses": report.get("chunk_misses", 0), "fetched": report.get("fetched", 0),
                         "computed_instead": report.get("computed_instead", 0)})
            if (i + 1) % 100 == 0:
                print(f"{i + 1} requests; last 100: median TTFT "
                      f"{statistics.median(r['ttft_s'] for r in rows[-100:]):.3f} s", flush=True)
        counts = [requests.get(w + "/metrics", timeout=30).text for w in workers]
        served = [sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("chunkcache_requests_total")) for text in counts]
    finally:
        fleet.stop(grace=90)
        store.stop()
    bounds = [int(b) for b in args.windows.split(",")]
    result = {"args": vars(args), "served_per_server": served, "windows": []}
    for lo, hi in zip(bounds, bounds[1:]):
        result["windows"].append({"from": lo, "to": hi, "servers": [window(rows, s, lo, hi) for s in (0, 1)]})
    first, last = (w["servers"][1] for w in (result["windows"][0], result["windows"][-1]))
    result["b_last_over_first"] = {"hit_rate": last["hit_rate"] / first["hit_rate"],
                                   "ttft_s": last["ttft_s"] / first["ttft_s"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**result, "rows": rows}, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
