"""The closed-loop summary: per side and client count, throughput over the blocks' wall time, TTFT percentiles,
fallbacks and chunk hits per request; chunkcache/stock ratios per client count (closed_loop.md, closed_loop.png)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from . import plots
from .http_client import fell_back
from .ab_report import mean, pct, span


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


def write(config, records: list[dict]) -> str:
    """Write closed_loop.md and closed_loop.png into the run's results directory; the markdown."""
    summary = markdown(config, records)
    (config.out / "closed_loop.md").write_text(summary)
    plots.closed_loop(cells(records), config.out / "closed_loop.png")
    return summary
