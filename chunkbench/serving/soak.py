"""Bounded soak of a chunkcache server: N clients of mixed traffic against a KV pool smaller than the working set.

    .venv/bin/python -m chunkbench.serving.soak --clients 8 --duration 600

Starts `chunkcache serve` (its own port, --enable-metrics) with a config whose KV pool (`--pool-tokens`) is smaller
than what the clients touch, then runs `--clients` threads for `--duration` seconds, each sending its next request
as soon as the previous one finished, drawn from a mix of
  hinted   /generate with text and char_spans over a random subset of the documents, in random order;
  plain    /generate without hints (served exactly as stock SGLang);
  chat     /v1/chat/completions with `chunkcache.documents`;
  ingest   /chunkcache/ingest of a few documents, some already stored, some new.
Every `--sample-s` seconds it records the server's RSS (its whole process tree) and the KV pool from /server_info
(`internal_states[].chunkcache.kv_pool`: available, evictable, protected). After the traffic it waits for the server
to go idle and checks that the pool returns to its starting size: available + evictable as at the start, nothing
protected, and, after /flush_cache, every token available again.

Writes to `--out` (default results/soak-TIME/): samples.jsonl, failures.jsonl (every failed request, with the
answer), summary.json and summary.md: requests and failures per kind, fallbacks by reason (meta_info and
/metrics), KV pool at start / end / after flush, RSS at start, peak and end. Exit status 1 when a request failed
or the pool did not come back.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import requests
from prometheus_client.parser import text_string_to_metric_families

from chunkbench.serving.http_client import flush_cache
from chunkbench.serving.servers import start_server

WORDS = "amber basalt cedar delta ember fjord granite harbor island juniper kestrel lagoon marsh north".split()
KINDS = {"hinted": 0.35, "plain": 0.2, "chat": 0.35, "ingest": 0.1}
PREFIX = "Answer the question from the records below.\n\n"


def document(i: int, words: int, rng: random.Random) -> str:
    return f"Record {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + f". The code of record {i} is {1000 + 7 * i}."


class Soak:
    def __init__(self, url: str, docs: list[str], args, out: Path):
        self.url, self.docs, self.args, self.out = url, docs, args, out
        self.lock = threading.Lock()
        self.requests: Counter = Counter()
        self.failures: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self.fresh = 0  # ingest documents never seen before
        self.failure_log = open(out / "failures.jsonl", "w")

    def run_client(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        kinds, weights = zip(*KINDS.items())
        while time.time() < deadline:
            kind = rng.choices(kinds, weights)[0]
            try:
                status, body = getattr(self, kind)(rng)
                ok = status == 200
            except requests.RequestException as exc:
                status, body, ok = None, repr(exc), False
            with self.lock:
                self.requests[kind] += 1
                if not ok:
                    self.failures[kind] += 1
                    self.failure_log.write(json.dumps({"kind": kind, "status": status, "body": str(body)[:2000]}) + "\n")
                    self.failure_log.flush()
                elif isinstance(body, dict) and (report := _report(body)) and "fallback" in report:
                    self.fallbacks[report["fallback"]] += 1

    def pick(self, rng: random.Random) -> list[str]:
        return rng.sample(self.docs, rng.randint(2, min(self.args.docs_per_request, len(self.docs))))

    def hinted(self, rng):
        text, spans = PREFIX, []
        for doc in self.pick(rng):
            spans.append([len(text), len(text) + len(doc) + 2])
            text += doc + "\n\n"
        i = rng.randrange(len(self.docs))
        text += f"Question: what is the code of record {i}?\nAnswer:"
        payload = {"char_spans": spans, "selector": rng.choice(self.args.selectors)}
        body = {"text": text, "sampling_params": self.sampling(rng), "kv_hints": {
            "protocol_version": "1", "message_id": "soak", "actions": [{
                "action_id": "c", "action_type": "chunkcache.chunks", "action_version": "1", "payload": payload}]}}
        r = requests.post(self.url + "/generate", json=body, timeout=self.args.timeout)
        return r.status_code, _json(r)

    def plain(self, rng):
        text = PREFIX + " ".join(self.pick(rng)) + "\nQuestion: which record mentions a fjord?\nAnswer:"
        r = requests.post(self.url + "/generate", json={"text": text, "sampling_params": self.sampling(rng)},
                          timeout=self.args.timeout)
        return r.status_code, _json(r)

    def chat(self, rng):
        i = rng.randrange(len(self.docs))
        body = {"messages": [{"role": "user", "content": f"What is the code of record {i}?"}],
                "max_tokens": self.sampling(rng)["max_new_tokens"], "temperature": 0,
                "chunkcache": {"documents": self.pick(rng), "selector": rng.choice(self.args.selectors)}}
        r = requests.post(self.url + "/v1/chat/completions", json=body, timeout=self.args.timeout)
        return r.status_code, _json(r)

    def ingest(self, rng):
        with self.lock:
            start, self.fresh = self.fresh, self.fresh + 2
        new = [document(100_000 + start + k, self.args.words, rng) for k in range(2)]
        r = requests.post(self.url + "/chunkcache/ingest", json={"documents": self.pick(rng)[:2] + new},
                          timeout=self.args.timeout)
        return r.status_code, _json(r)

    def sampling(self, rng) -> dict:
        return {"max_new_tokens": rng.randint(4, self.args.max_new_tokens), "temperature": 0}


def _json(r: requests.Response):
    try:
        return r.json()
    except ValueError:
        return r.text


def _report(body: dict) -> dict | None:
    return (body.get("meta_info") or {}).get("chunkcache") or (body.get("metadata") or {}).get("chunkcache")


def kv_pool(url: str, timeout: float = 300) -> dict:
    """/server_info waits for the scheduler's loop: behind a long blended prefill on a loaded host that takes a while."""
    info = requests.get(url + "/server_info", timeout=timeout).json()
    pools = [s["chunkcache"]["kv_pool"] for s in info["internal_states"] if s.get("chunkcache", {}).get("kv_pool")]
    return {k: sum(p[k] for p in pools) for k in ("available", "evictable", "protected")}


def rss_bytes(pid: int) -> int:
    proc = psutil.Process(pid)
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def chunkcache_metrics(url: str) -> tuple[dict[str, float], int]:
    """From one /metrics read: fallbacks so far by reason, and the bytes the chunk store's memory tier holds (it grows
    with every new document up to store.host_bytes: the part of the server's RSS growth that is data, not a
    leak)."""
    fallbacks, store_host = {}, 0
    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "chunkcache_fallbacks_total":
                fallbacks[sample.labels["reason"]] = sample.value
            elif sample.name == "chunkcache_store_bytes" and sample.labels.get("tier") == "host":
                store_host = int(sample.value)
    return fallbacks, store_host


def wait_idle(url: str, timeout: float = 300) -> dict:
    """The KV pool once nothing is protected (no request holds tokens) and two readings agree."""
    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        pool = kv_pool(url)
        if pool["protected"] == 0 and pool == last:
            return pool
        last = pool
        time.sleep(2)
    return last


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chunkbench.serving.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=600, help="seconds of traffic (default: %(default)s)")
    p.add_argument("--pool-tokens", type=int, default=4096, help="KV pool of the server, in tokens; keep it below "
                   "the working set (--docs x --words, many orders) (default: %(default)s)")
    p.add_argument("--docs", type=int, default=32, help="documents the clients draw from (default: %(default)s)")
    p.add_argument("--words", type=int, default=60, help="words per document (default: %(default)s)")
    p.add_argument("--docs-per-request", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--selectors", default="prophet,epic,none", help="comma-separated, drawn per request")
    p.add_argument("--sample-s", type=float, default=2.0, help="seconds between RSS / KV pool samples")
    p.add_argument("--timeout", type=float, default=600, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.selectors = args.selectors.split(",")
    out = args.out or Path("results") / time.strftime("soak-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    (out / "chunkcache.yaml").write_text(f"serve: {{max_total_tokens: {args.pool_tokens}}}\n")
    rng = random.Random(args.seed)
    docs = [document(i, args.words, rng) for i in range(args.docs)]

    with start_server(out / "server.log", chunk_reuse=True, config=str(out / "chunkcache.yaml")) as server:
        url = server.url
        soak = Soak(url, docs, args, out)
        soak.chat(random.Random(-1))  # warm-up: the first request pays one-off costs (selector set-up, allocations)
        start_pool, start_rss = wait_idle(url), rss_bytes(server.pid)
        start_fallbacks, start_store = chunkcache_metrics(url)
        samples = open(out / "samples.jsonl", "w")
        t0 = time.time()
        deadline = t0 + args.duration
        threads = [threading.Thread(target=soak.run_client, args=(args.seed * 1000 + c, deadline), daemon=True)
                   for c in range(args.clients)]
        for t in threads:
            t.start()
        peak_rss, missed = start_rss, 0
        while any(t.is_alive() for t in threads):
            rss = rss_bytes(server.pid)
            peak_rss = max(peak_rss, rss)
            try:
                pool = kv_pool(url, timeout=max(10.0, 5 * args.sample_s))
            except requests.RequestException as exc:  # a missed sample, not a failed soak: the clients' requests say that
                pool, missed = {"kv_pool_error": repr(exc)[:200]}, missed + 1
            try:
                pool["store_host"] = chunkcache_metrics(url)[1]
            except requests.RequestException:
                pass
            samples.write(json.dumps({"t": round(time.time() - t0, 1), "rss": rss, **pool,
                                      "requests": sum(soak.requests.values())}) + "\n")
            samples.flush()
            time.sleep(args.sample_s)
        for t in threads:
            t.join()
        traffic_s = time.time() - t0
        end_pool = wait_idle(url)
        end_rss = rss_bytes(server.pid)
        end_fallbacks, end_store = chunkcache_metrics(url)
        metric_fallbacks = {k: v - start_fallbacks.get(k, 0.0) for k, v in end_fallbacks.items()
                            if v - start_fallbacks.get(k, 0.0)}
        flush_cache(url)
        flushed_pool = wait_idle(url)
        flushed_start = start_pool["available"] + start_pool["evictable"]

    pool_back = (end_pool["protected"] == 0 and end_pool["available"] + end_pool["evictable"] == flushed_start
                 and flushed_pool["available"] == flushed_start)
    summary = {
        "clients": args.clients, "duration_s": round(traffic_s, 1), "pool_tokens": args.pool_tokens,
        "requests": dict(soak.requests), "requests_total": sum(soak.requests.values()),
        "failures": dict(soak.failures), "failures_total": sum(soak.failures.values()),
        "fallbacks_meta_info": dict(soak.fallbacks), "fallbacks_metrics": metric_fallbacks,
        "kv_pool_samples_missed": missed,
        "kv_pool": {"start": start_pool, "end_idle": end_pool, "after_flush": flushed_pool, "back_to_start": pool_back},
        "rss_mb": {"start": round(start_rss / 2**20, 1), "peak": round(peak_rss / 2**20, 1),
                   "end": round(end_rss / 2**20, 1), "growth": round((end_rss - start_rss) / 2**20, 1),
                   "store_host_growth": round((end_store - start_store) / 2**20, 1),
                   "growth_besides_store": round((end_rss - start_rss - end_store + start_store) / 2**20, 1)},
        "command": " ".join(sys.argv),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(render(summary))
    print(render(summary))
    print(f"written to {out}")
    return 0 if summary["failures_total"] == 0 and pool_back else 1


def render(s: dict) -> str:
    kinds = sorted(set(s["requests"]) | set(s["failures"]))
    lines = [f"# Soak: {s['clients']} clients, {s['duration_s']} s, KV pool {s['pool_tokens']} tokens", "",
             f"`{s['command']}`", "", "| kind | requests | failures |", "|---|---|---|"]
    lines += [f"| {k} | {s['requests'].get(k, 0)} | {s['failures'].get(k, 0)} |" for k in kinds]
    lines += [f"| **all** | {s['requests_total']} | {s['failures_total']} |", "",
              f"Fallbacks by reason (meta_info): {s['fallbacks_meta_info'] or 'none'}; "
              f"(/metrics): {s['fallbacks_metrics'] or 'none'}", "",
              f"KV pool (available / evictable / protected): start {_pool(s['kv_pool']['start'])}, "
              f"idle at the end {_pool(s['kv_pool']['end_idle'])}, after /flush_cache "
              f"{_pool(s['kv_pool']['after_flush'])}: back to start: **{s['kv_pool']['back_to_start']}** "
              f"({s['kv_pool_samples_missed']} samples during the traffic timed out)", "",
              f"RSS of the server's processes (MiB): start {s['rss_mb']['start']}, peak {s['rss_mb']['peak']}, "
              f"end {s['rss_mb']['end']}, growth {s['rss_mb']['growth']}, of which the chunk store's memory tier "
              f"{s['rss_mb']['store_host_growth']} (new documents' KV, bounded by store.host_bytes), the rest "
              f"{s['rss_mb']['growth_besides_store']}", ""]
    return "\n".join(lines)


def _pool(p: dict) -> str:
    return f"{p['available']} / {p['evictable']} / {p['protected']}"


if __name__ == "__main__":
    sys.exit(main())
