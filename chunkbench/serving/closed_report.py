"""The closed-loop summary: per side and client count, throughput over the blocks' wall time, TTFT percentiles,
fallbacks and chunk hits per request; chunkcache/stock ratios per client count (closed_loop.md, closed_loop.png)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

import torch

from . import plots
from .floor import Shape, StockRates, causal_pairs
from .http_client import fell_back
from .ab_report import endpoint_lines, mean, pct, span


@dataclass(frozen=True)
class Cell:
    """One side at one client count, its blocks pooled."""
    arm: str
    clients: int
    requests: int
    seconds: float  # the blocks' wall times, summed
    output_tokens: int
    ttft_p50: float
    ttft_p90: float
    fallbacks: int  # requests the server computed in full (client.fell_back on the raw report)
    chunk_hits: float  # per request
    chunk_misses: float  # per request

    @property
    def req_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def cell(rows: list[dict]) -> Cell:
    """Pooled throughput is all requests over all blocks' wall time (first arrival to last finish of each block),
    not a mean of per-block rates: a slow block weighs by its length."""
    blocks: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        blocks[r["block"]].append(r)
    ttft = [r["ttft_s"] for r in rows]
    return Cell(rows[0]["arm"], rows[0]["clients"], len(rows), sum(span(b) for b in blocks.values()),
                sum(r["output_tokens"] for r in rows), pct(ttft, 50), pct(ttft, 90),
                sum(fell_back(r["report"]) for r in rows), mean(r["chunk_hits"] for r in rows),
                mean(r["chunk_misses"] for r in rows))


def cells(records: list[dict]) -> dict[int, dict[str, Cell]]:
    """clients -> side -> Cell, client counts in run order."""
    by: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in records:
        by[r["clients"], r["side"]].append(r)
    out: dict[int, dict[str, Cell]] = defaultdict(dict)
    for (clients, side), rows in by.items():
        out[clients][side] = cell(rows)
    return dict(out)


def ratios(sides: dict[str, Cell]) -> tuple[float, float]:
    """(throughput, TTFT p50) of chunkcache over stock at one client count. Under load a request's TTFT depends on
    what else is in flight, so these compare the sides' distributions, not request pairs as report.ratios does."""
    cc, stock = sides["chunkcache"], sides["stock"]
    return cc.req_s / stock.req_s, cc.ttft_p50 / stock.ttft_p50


def markdown(config, records: list[dict]) -> str:
    wl = config.workload
    lines = [
        f"## `{wl.spec}` closed loop — stock prefix caching vs chunkcache ({config.arm.label})",
        "",
        f"Model `{config.model}`; {wl.docs} documents of ≤{wl.words} words per prompt (median "
        f"{statistics.median(r['prompt_tokens'] for r in records):.0f} prompt tokens), exactly "
        f"{config.max_new_tokens} new tokens (ignore_eos), greedy. Per client count, {config.blocks} pair(s) of "
        f"{config.requests}-request blocks, stock and chunkcache alternating, both servers up throughout; each client "
        f"sends its next request when its previous one finished. Throughput: requests (output tokens) over the "
        f"blocks' summed wall time. Ratios: chunkcache/stock (throughput > 1, TTFT < 1: chunkcache better).",
        *endpoint_lines(records, config.endpoints is not None),
        "",
        "| clients | side | requests | throughput req/s | output tok/s | TTFT p50 s | TTFT p90 s | fallbacks "
        "| chunk hits/req | chunk misses/req | throughput ratio | TTFT p50 ratio |",
        "|" + "---|" * 12,
    ]
    for clients, sides in cells(records).items():
        ratio = ratios(sides) if len(sides) == 2 else (float("nan"),) * 2  # a cut-short run may lack a side
        for c in sides.values():
            lines.append(
                f"| {clients} | {c.arm} | {c.requests} | {c.req_s:.3f} | {c.tok_s:.2f} | {c.ttft_p50:.3f} "
                f"| {c.ttft_p90:.3f} | {c.fallbacks} | {c.chunk_hits:.2f} | {c.chunk_misses:.2f} "
                + (f"| {ratio[0]:.3f} | {ratio[1]:.3f} |" if c.arm != "stock" else "| | |"))
    return "\n".join(lines) + "\n"


def floor_lines(records: list[dict], host: dict) -> list[str]:
    """Per client count, chunkcache's throughput against its floor at stock's rates in the same blocks
    (chunkbench.serving.floor.StockRates; `host`: the shape, the attention kernel's seconds per pair and the copy
    bandwidth, measured by the run)."""
    shape = Shape(**{**host["shape"], "dtype": getattr(torch, host["shape"]["dtype"])})
    lines = ["", f"Floor at stock's rates ({shape.layers} layers, {host['shape']['dtype']}; causal attention "
             f"{host['pair_s'] * 1e9:.2f} ns per (query, key) pair timed by the bench, copy "
             f"{host['copy_bytes_s'] / 1e9:.1f} GB/s): stock's seconds per request less its attention, per prompt "
             f"token it computed, prices each recomputed token; a request computed in full is priced as stock's. "
             f"Fraction = chunkcache's throughput over the floor's (1: at the floor).", "",
             "| clients | stock s/request | of it attention | stock s per computed token | floor req/s "
             "| chunkcache req/s | floor fraction |", "|" + "---|" * 7]
    by: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for r in records:
        by[r["clients"], r["side"]].append(r)
    for clients, sides in cells(records).items():
        if len(sides) < 2:
            continue
        stock_rows = by[clients, "stock"]
        rates = StockRates.measured(sides["stock"].seconds, [(r["prompt_tokens"], r["cached_tokens"])
                                                             for r in stock_rows], host["pair_s"], host["copy_bytes_s"])
        attention = rates.pair_s * sum(causal_pairs(r["prompt_tokens"], r["cached_tokens"]) for r in stock_rows)
        floor_s = sum(rates.stock_s(r["prompt_tokens"], r["cached_tokens"]) if not r["report"] or fell_back(r["report"])
                      else rates.blend_s(shape, r["recomputed_tokens"], r["report"].get("attended_pairs", 0),
                                         r["reused_tokens"]) for r in by[clients, "chunkcache"])
        cc = sides["chunkcache"]
        floor_req_s = cc.requests / floor_s
        lines.append(f"| {clients} | {sides['stock'].seconds / len(stock_rows):.3f} "
                     f"| {attention / sides['stock'].seconds:.0%} | {rates.token_s * 1e3:.3f} ms "
                     f"| {floor_req_s:.3f} | {cc.req_s:.3f} | **{cc.req_s / floor_req_s:.2f}** |")
    return lines


def write(config, records: list[dict], host: dict | None = None) -> str:
    """Write closed_loop.md and closed_loop.png into the run's results directory; the markdown. `host`: the floor's
    rates (floor_lines), when the run measured them."""
    summary = markdown(config, records)
    if host is not None:
        summary += "\n".join(floor_lines(records, host)) + "\n"
    (config.out / "closed_loop.md").write_text(summary)
    plots.closed_loop(cells(records), config.out / "closed_loop.png")
    return summary
