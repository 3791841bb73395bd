"""The markdown summary: medians and p90 per side, and chunkcache/stock ratios computed per request pair (the same
prompt sent to both servers), so a ratio is never a ratio of unrelated medians."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Iterable

import numpy as np

GOODPUT_FRACTION = 0.8  # SpecCache §3.3: a request is good when its score >= 80 % of the full-recompute mean


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def pct(values: Iterable[float], q: float) -> float:
    values = [v for v in values if not math.isnan(v)]
    return float(np.percentile(values, q)) if values else float("nan")


def groups(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(phase, arm) -> records, stock first, in run order."""
    out: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in sorted(records, key=lambda r: r["side"] != "stock"):
        out[r["phase"], r["arm"]].append(r)
    return dict(out)


def ratios(rows: list[dict], stock: list[dict], key: str) -> list[float]:
    base = {r["request"]: r[key] for r in stock}
    return [r[key] / base[r["request"]] for r in rows]


def span(rows: list[dict]) -> float:
    """Seconds from the first arrival to the last finish of requests replayed together (a phase, a block)."""
    return max(r["finish_s"] for r in rows) - min(r["arrival_s"] for r in rows)


def goodput(rows: list[dict], threshold: float) -> tuple[float, float, float]:
    """(throughput req/s, goodput req/s, output tokens/s) over the phase's duration H: first arrival to last finish."""
    duration = span(rows)
    good = sum(r["f1"] >= threshold for r in rows)
    return len(rows) / duration, good / duration, sum(r["output_tokens"] for r in rows) / duration


def endpoint_lines(records: list[dict], deployed: bool | None = None) -> list[str]:
    """Which endpoint each arm's figures came from, as lines to append to a summary (none for records from before
    they carried it). `deployed`: whether the bench started those servers, where the run says."""
    arms: dict[str, dict[str, None]] = defaultdict(dict)
    for r in records:
        if r.get("endpoint"):
            arms[r["endpoint"]][r["arm"]] = None
    if not arms:
        return []
    how = {True: " (deployed: not started by the bench)", False: " (started by the bench)", None: ""}[deployed]
    return ["", f"Endpoints{how}: " + "; ".join(f"{', '.join(names)} from `{url}`" for url, names in arms.items())]


def markdown(records: list[dict], config, threshold: float) -> str:
    wl = config.workload
    g = groups(records)
    seq = [(arm, rows) for (ph, arm), rows in g.items() if ph == "sequential"]
    stock_seq = g["sequential", "stock"]
    lines = [
        f"## `{wl.spec}` — stock prefix caching vs chunkcache",
        "",
        f"Model `{config.model}`; {wl.requests} requests, {wl.docs} documents of ≤{wl.words} words per prompt "
        f"(median {statistics.median(r['prompt_tokens'] for r in stock_seq):.0f} prompt tokens), "
        f"{config.max_new_tokens} new tokens, greedy. Ratios are chunkcache/stock per request pair (< 1: faster). "
        f"F1/EM against gold; agreement = F1 against stock's answer (exact prefill).",
        *endpoint_lines(records, config.endpoints is not None),
        "",
        "### Sequential (TTFT)",
        "",
        "| side | n | TTFT p50 s | TTFT p90 s | TTFT ratio p50 | TTFT ratio p90 | latency p50 s | latency p90 s "
        "| latency ratio p50 | decode tok/s p50 | F1 | EM | agreement | radix-cached tok | chunk hits | reused tok "
        "| recomputed tok |",
        "|" + "---|" * 17,
    ]
    for arm, rows in seq:
        tt, lat = ratios(rows, stock_seq, "ttft_s"), ratios(rows, stock_seq, "latency_s")
        lines.append(
            f"| {arm} | {len(rows)} | {pct([r['ttft_s'] for r in rows], 50):.3f} | {pct([r['ttft_s'] for r in rows], 90):.3f} "
            f"| {pct(tt, 50):.3f} | {pct(tt, 90):.3f} | {pct([r['latency_s'] for r in rows], 50):.3f} "
            f"| {pct([r['latency_s'] for r in rows], 90):.3f} | {pct(lat, 50):.3f} "
            f"| {pct([r['tokens_per_s'] for r in rows], 50):.1f} | {mean(r['f1'] for r in rows):.3f} "
            f"| {mean(r['em'] for r in rows):.3f} | {mean(r['agreement'] for r in rows):.3f} "
            f"| {mean(r['cached_tokens'] for r in rows):.0f} | {mean(r['chunk_hits'] for r in rows):.2f} "
            f"| {mean(r['reused_tokens'] for r in rows):.0f} | {mean(r['recomputed_tokens'] for r in rows):.0f} |")
    load = [(ph, arm, rows) for (ph, arm), rows in g.items() if ph != "sequential"]
    if load:
        lines += [
            "",
            f"### Poisson arrivals (throughput, goodput: F1 ≥ {threshold:.3f} = {GOODPUT_FRACTION:.0%} "
            f"of stock's mean F1)",
            "",
            "| rate req/s | side | n | throughput req/s | goodput req/s | output tok/s | TTFT p50 s | TTFT p90 s "
            "| TTFT ratio p50 | latency p50 s | latency p90 s | F1 |",
            "|" + "---|" * 12,
        ]
        for ph, arm, rows in load:
            thr, good, tok = goodput(rows, threshold)
            tt = ratios(rows, g[ph, "stock"], "ttft_s")
            lines.append(
                f"| {rows[0]['rate']:g} | {arm} | {len(rows)} | {thr:.4f} | {good:.4f} | {tok:.2f} "
                f"| {pct([r['ttft_s'] for r in rows], 50):.3f} | {pct([r['ttft_s'] for r in rows], 90):.3f} "
                f"| {pct(tt, 50):.3f} | {pct([r['latency_s'] for r in rows], 50):.3f} "
                f"| {pct([r['latency_s'] for r in rows], 90):.3f} | {mean(r['f1'] for r in rows):.3f} |")
    return "\n".join(lines) + "\n"
