"""Replaying requests against a server: one after another (TTFT), as Poisson arrivals at a rate (throughput and
goodput: requests overlap and the server batches them), or from N closed-loop clients (the load follows the server's
own speed: throughput at a fixed concurrency)."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from tqdm import tqdm

from ..workloads import Request
from .http_client import Outcome, generate

Hints = Callable[[Request], dict | None]


def replay(url: str, requests: list[Request], hints: Hints, max_new_tokens: int, *, rate: float | None = None,
           seed: int = 0, desc: str = "") -> list[dict]:
    """One record per request, in request order. `rate` (requests/s): Poisson arrivals; None: sequential."""
    bar = tqdm(total=len(requests), desc=desc, unit="req", leave=False)
    records: list[dict | None] = [None] * len(requests)
    t0 = time.perf_counter()

    def send(i: int, at: float) -> None:
        time.sleep(max(0.0, at - (time.perf_counter() - t0)))
        arrival = time.perf_counter() - t0
        out = generate(url, requests[i].prompt.input_ids, max_new_tokens, hints(requests[i]))
        records[i] = _record(requests[i], out, arrival)
        with lock:
            bar.update()

    lock = threading.Lock()
    if rate is None:
        for i in range(len(requests)):
            send(i, 0.0)
    else:
        rng = random.Random(seed)
        arrivals, t = [], 0.0
        for _ in requests:
            arrivals.append(t)
            t += rng.expovariate(rate)
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            for f in [pool.submit(send, i, at) for i, at in enumerate(arrivals)]:
                f.result()  # a failed request fails the run: a benchmark with holes is not one to trust
    bar.close()
    return records  # type: ignore[return-value]


def closed(url: str, requests: list[Request], hints: Hints, max_new_tokens: int, clients: int,
           desc: str = "") -> list[dict]:
    """One record per request, in request order. `clients` threads take the requests in order from one queue, each
    sending its next as soon as its previous one finished; exactly max_new_tokens each (ignore_eos), so the output
    tokens/s of two servers compare like for like."""
    bar = tqdm(total=len(requests), desc=desc, unit="req", leave=False)
    records: list[dict | None] = [None] * len(requests)
    queue = iter(range(len(requests)))
    lock = threading.Lock()
    t0 = time.perf_counter()

    def client(c: int) -> None:
        while True:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            arrival = time.perf_counter() - t0
            out = generate(url, requests[i].prompt.input_ids, max_new_tokens, hints(requests[i]), ignore_eos=True)
            records[i] = {**_record(requests[i], out, arrival), "client": c}
            with lock:
                bar.update()

    with ThreadPoolExecutor(max_workers=clients) as pool:
        for f in [pool.submit(client, c) for c in range(clients)]:
            f.result()  # a failed request fails the run, as in replay
    bar.close()
    return records  # type: ignore[return-value]


def _record(request: Request, out: Outcome, arrival: float) -> dict:
    report = out.report or {}
    return {
        "request": request.id, "arrival_s": arrival, "ttft_s": out.ttft_s, "latency_s": out.latency_s,
        "finish_s": arrival + out.latency_s, "tokens_per_s": out.tokens_per_s,
        "prompt_tokens": out.prompt_tokens, "output_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens, "blended": out.report is not None,
        **{k: report.get(k, 0) for k in ("chunk_hits", "chunk_misses", "reused_tokens", "recomputed_tokens")},
        "select_s": report.get("select_s"), "blend_s": report.get("blend_s"),
        "answer": out.text, "report": out.report,  # raw: fallbacks (client.fell_back) are counted from it
    }
