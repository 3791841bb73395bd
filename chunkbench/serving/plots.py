"""PNG plots of a bench run (matplotlib, Agg: no display needed): TTFT CDF, latency-quality frontier, goodput;
throughput and TTFT vs clients of a closed-loop run."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .ab_report import goodput, groups, mean, pct  # noqa: E402


def write_all(records: list[dict], threshold: float, out: Path) -> list[Path]:
    g = groups(records)
    paths = [ttft_cdf(g, out / "ttft_cdf.png"), frontier(g, out / "frontier.png")]
    if any(ph != "sequential" for ph, _ in g):
        paths.append(goodput_vs_rate(g, threshold, out / "goodput.png"))
    return paths


def ttft_cdf(g: dict, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for (ph, arm), rows in g.items():
        if ph == "sequential":
            ax.ecdf([r["ttft_s"] for r in rows], label=arm)
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF, sequential requests")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def frontier(g: dict, path: Path) -> Path:
    """Median TTFT vs mean F1, one point per side / (selector, rho): up and to the left is better."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for (ph, arm), rows in g.items():
        if ph == "sequential":
            x, y = pct([r["ttft_s"] for r in rows], 50), mean(r["f1"] for r in rows)
            ax.scatter(x, y, marker="*" if arm == "stock" else "o", s=80)
            ax.annotate(arm, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set(xlabel="median TTFT (s)", ylabel="mean F1", title="latency-quality frontier")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def goodput_vs_rate(g: dict, threshold: float, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    by_arm: dict[str, list[tuple[float, float, float]]] = {}
    for (ph, arm), rows in g.items():
        if ph != "sequential":
            thr, good, _ = goodput(rows, threshold)
            by_arm.setdefault(arm, []).append((rows[0]["rate"], thr, good))
    for arm, pts in by_arm.items():
        rate, thr, good = zip(*sorted(pts))
        line, = ax.plot(rate, good, marker="o", label=f"{arm} goodput")
        ax.plot(rate, thr, marker="x", linestyle="--", color=line.get_color(), label=f"{arm} throughput")
    ax.set(xlabel="arrival rate (req/s)", ylabel="req/s", title=f"goodput (F1 ≥ {threshold:.2f}) vs arrival rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def closed_loop(cells: dict, path: Path) -> Path:
    """Throughput and median TTFT vs client count, one line per side (closed_report.cells)."""
    fig, (thr, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    by_arm: dict[str, list] = {}
    for sides in cells.values():
        for c in sides.values():
            by_arm.setdefault(c.arm, []).append(c)
    for arm, cs in by_arm.items():
        cs.sort(key=lambda c: c.clients)
        x = [c.clients for c in cs]
        thr.plot(x, [c.req_s for c in cs], marker="o", label=arm)
        ttft.plot(x, [c.ttft_p50 for c in cs], marker="o", label=arm)
    thr.set(xlabel="clients", ylabel="requests/s", title="throughput, closed loop")
    ttft.set(xlabel="clients", ylabel="TTFT p50 (s)", title="median TTFT, closed loop")
    for ax in (thr, ttft):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(cells), [str(n) for n in sorted(cells)])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
