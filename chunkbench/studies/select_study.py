"""Where the anchors' selectors lose the tokens that matter, against the oracle's ground truth.

`collect` (resumable: it keeps what OUT holds) runs the synthetic tasks through the reference blender once per case
and keeps every feature a selector could read, next to the truth: per context token, the deviation of its reused KV
from full recompute's summed over layers (Features.true_deviation), ProphetKV's query attention, the K and V deviation
at every layer (CacheBlend's signal at each possible check layer), and which tokens belong to the task's fact
sentences (needles). `report` ranks with each signal at a budget rho and says how much of the oracle's deviation each
pick recovers, and where the misses are (chunk starts, needles, elsewhere; position inside the chunk), sweeps the
`mix` selector's weights, and shows what the adaptive budget chooses per request.

Use seeds the committed eval does not (the eval's cases are seeds 0..n-1):

    .venv/bin/python -m chunkbench.studies.select_study collect --requests 12 --seed 1000 --out results/study.pt
    .venv/bin/python -m chunkbench.studies.select_study report results/study.pt --ratio 0.15
"""

from __future__ import annotations

import argparse
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from chunkcache.align import decode_with_offsets
from chunkcache.select.base import Layout, finish
from chunkcache.select.budget import rank
from chunkcache.select.mix import MixSelector

TASKS = ("multikey", "multivalue", "vartrack", "bridge")
# the fact sentences of chunkbench.synthetic, as they read in the prompt
FACTS = re.compile(r"The special magic number for [\w-]+ is \d+\.|VAR \w+ = (?:VAR )?\w+\.|\w+'s house is in \w+\."
                   r"|\w+ stays in \w+'s house on \w+\.")
START = 4  # tokens at a chunk's start counted as "chunk start"


class Probe:
    """A selector that reads every feature and recomputes only the forced tokens."""

    name = "probe"

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.got: dict[str, torch.Tensor] = {}

    def select(self, layout, ratio, features):
        # true_deviation first: its full prefill leaves every layer's exact KV for the kv_deviation calls
        self.got = {"true": features.true_deviation(), "qa": features.query_attention(),
                    **{f"dev_{w}": torch.stack([features.kv_deviation(l, w) for l in range(self.n_layers)])
                       for w in "kv"}}
        return finish(layout, torch.empty(0, dtype=torch.long), None)


def collect(args) -> None:
    from chunkbench.quality.reference_path import split
    from chunkbench.workloads import WorkloadConfig, items, to_request
    from chunkcache.reference import ReferenceBlender

    blender = ReferenceBlender.from_pretrained(args.model)
    out = Path(args.out)
    cases = torch.load(out, weights_only=False) if out.is_file() else []  # a cut-short collection goes on
    done = {c["item"] for c in cases}
    for task in args.tasks.split(","):
        config = WorkloadConfig(f"synthetic:{task}", args.requests, args.docs, args.words, seed=args.seed)
        for item in items(config):
            if item.id in done:
                continue
            parts = split(to_request(blender.tokenizer, item).prompt)
            probe = Probe(blender.n_layers)
            res = blender.blend(*parts, selector=probe, ratio=0.0)
            text, offsets = decode_with_offsets(blender.tokenizer, res.layout.token_ids.tolist())
            needle = torch.zeros(res.layout.n, dtype=torch.bool)
            for m in FACTS.finditer(text):
                needle |= torch.tensor([a < m.end() and b > m.start() and b > a for a, b in offsets])
            cases.append({"task": task, "item": item.id, "token_ids": res.layout.token_ids,
                          "prefix_len": res.layout.prefix_len, "chunk_spans": res.layout.chunk_spans,
                          "query_span": res.layout.query_span, "needle": needle & res.layout.context_mask(),
                          **{k: v.float() for k, v in probe.got.items()}})
            torch.save(cases, out)
            print(f"{item.id}: {res.layout.n} tokens, {int(needle.sum())} needle tokens", flush=True)


@dataclass
class Stored:
    """Features of a collected case, served as the Features protocol (for MixSelector.scores)."""

    case: dict

    def query_attention(self):
        return self.case["qa"]

    def kv_deviation(self, layer, which):
        return self.case[f"dev_{which}"][layer]


def layout_of(case: dict) -> Layout:
    return Layout(case["token_ids"], case["prefix_len"], tuple(map(tuple, case["chunk_spans"])),
                  tuple(case["query_span"]))


def epic_scores(layout: Layout) -> torch.Tensor:
    dist = torch.full((layout.n,), float("inf"))
    for s, e in layout.chunk_spans:
        dist[s:e] = torch.arange(e - s, dtype=dist.dtype)
    return -dist


def categories(case: dict, layout: Layout) -> dict[str, torch.Tensor]:
    """Disjoint masks over the context: chunk starts, needle tokens, the rest."""
    ctx = layout.context_mask()
    start = torch.zeros(layout.n, dtype=torch.bool)
    for s, e in layout.chunk_spans:
        start[s: s + START] = True
    needle = case["needle"] & ~start
    return {"start": start & ctx, "needle": needle, "other": ctx & ~start & ~needle}


def signals(case: dict, layout: Layout) -> dict[str, torch.Tensor]:
    return {"epic": epic_scores(layout), "cacheblend (v@1)": case["dev_v"][1], "cacheblend (k@1)": case["dev_k"][1],
            "prophet": case["qa"], "mix (defaults)": MixSelector().scores(layout, Stored(case))}


def score(case: dict, layout: Layout, scores: torch.Tensor, ratio: float) -> tuple[float, float, dict]:
    """(share of the oracle's recovered deviation, recall of the oracle's picks, missed deviation by category)."""
    ctx, true = layout.context_mask(), case["true"].double()
    k = layout.budget(ratio)
    oracle, picked = rank(true, ctx)[:k], rank(scores, ctx)[:k]
    missed = torch.zeros(layout.n, dtype=torch.bool)
    missed[oracle] = True
    missed[picked] = False
    best = float(true[oracle].sum())
    cats = {name: float(true[missed & m].sum()) / best for name, m in categories(case, layout).items()}
    return float(true[picked].sum()) / best, len(set(oracle.tolist()) & set(picked.tolist())) / max(k, 1), cats


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def report(args) -> None:
    cases = torch.load(args.path, weights_only=False)
    ratio = args.ratio
    tasks = list(dict.fromkeys(c["task"] for c in cases))
    laid = [(c, layout_of(c)) for c in cases]
    print(f"{len(cases)} cases ({', '.join(tasks)}), rho = {ratio}\n")

    print("## Where the truth is: share of all reused-KV deviation, and of the oracle's top-rho picks, by category\n")
    print("| task | start: all | needle: all | other: all | start: top | needle: top | other: top "
          "| tokens start/needle/other |")
    print("|---|---|---|---|---|---|---|---|")
    for task in tasks:
        rows = []
        for c, lay in laid:
            if c["task"] != task:
                continue
            cats, true, ctx = categories(c, lay), c["true"].double(), lay.context_mask()
            top = torch.zeros(lay.n, dtype=torch.bool)
            top[rank(true, ctx)[: lay.budget(ratio)]] = True
            total, top_total = float(true[ctx].sum()), float(true[top].sum())
            rows.append([float(true[m].sum()) / total for m in cats.values()]
                        + [float(true[m & top].sum()) / top_total for m in cats.values()]
                        + [int(m.sum()) for m in cats.values()])
        m = [mean(col) for col in zip(*rows)]
        print(f"| {task} | " + " | ".join(f"{x:.3f}" for x in m[:6]) + f" | {m[6]:.0f}/{m[7]:.0f}/{m[8]:.0f} |")

    print("\n## Position inside the chunk: mean true deviation per token by decile of the chunk\n")
    deciles = torch.zeros(10, dtype=torch.float64)
    counts = torch.zeros(10, dtype=torch.float64)
    for c, lay in laid:
        true = c["true"].double() / float(c["true"][lay.context_mask()].double().mean())
        for s, e in lay.chunk_spans:
            d = (torch.arange(e - s) * 10 // (e - s))
            deciles.index_add_(0, d, true[s:e])
            counts.index_add_(0, d, torch.ones(e - s, dtype=torch.float64))
    print("| decile | " + " | ".join(str(i) for i in range(10)) + " |\n|---|" + "---|" * 10)
    print("| deviation / mean | " + " | ".join(f"{x:.2f}" for x in (deciles / counts).tolist()) + " |")
    first = torch.zeros(8, dtype=torch.float64)
    for c, lay in laid:
        true = c["true"].double() / float(c["true"][lay.context_mask()].double().mean())
        for s, _ in lay.chunk_spans:
            first += true[s: s + 8]
    print("\nfirst 8 tokens of a chunk, deviation / mean: "
          + ", ".join(f"{x:.2f}" for x in (first / sum(len(lay.chunk_spans) for _, lay in laid)).tolist()))

    print("\n## Each signal at rho: recovered share of the oracle's deviation, recall of its picks, Spearman with "
          "the truth; missed deviation (share of the oracle's) by category\n")
    print("| task | signal | recovered | recall | Spearman | missed: start | missed: needle | missed: other |")
    print("|---|---|---|---|---|---|---|---|")
    for task in tasks:
        subset = [(c, lay) for c, lay in laid if c["task"] == task]
        for name in signals(*subset[0]):
            res = [(score(c, lay, signals(c, lay)[name], ratio),
                    spearman(signals(c, lay)[name][lay.context_mask()], c["true"][lay.context_mask()]))
                   for c, lay in subset]
            rec, recall = mean(r[0][0] for r in res), mean(r[0][1] for r in res)
            missed = {k: mean(r[0][2][k] for r in res) for k in ("start", "needle", "other")}
            print(f"| {task} | {name} | {rec:.3f} | {recall:.3f} | {mean(r[1] for r in res):.3f} | "
                  + " | ".join(f"{v:.3f}" for v in missed.values()) + " |")

    print("\n## CacheBlend's check layer: recovered share at rho by the K / V deviation of one layer (all tasks)\n")
    n_layers = cases[0]["dev_v"].shape[0]
    print("| layer | " + " | ".join(str(l) for l in range(1, n_layers)) + " |\n|---|" + "---|" * (n_layers - 1))
    for w in "kv":
        vals = [mean(score(c, lay, c[f"dev_{w}"][l], ratio)[0] for c, lay in laid) for l in range(1, n_layers)]
        print(f"| {w.upper()} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")

    print("\n## mix weights (relevance, deviation, boundary) x check layer: recovered share at rho per task, and "
          "the oracle's deviation missed on needle tokens (all tasks)\n")
    print("| relevance | deviation | boundary | layer | " + " | ".join(tasks) + " | mean | missed: needle |")
    print("|---|---|---|---|" + "---|" * (len(tasks) + 2))
    results = []
    for r, b, layer in itertools.product((0.0, 0.2, 0.4, 0.5, 0.6, 0.8, 1.0), (0.0, 0.05, 0.1, 0.2), (1, 2, 3)):
        d = round(1.0 - r - b, 3)
        if d < 0 or (d == 0 and layer != 1):
            continue
        sel = MixSelector(relevance=r, deviation=d, boundary=b, layer=layer)
        scored = [(c["task"], score(c, lay, sel.scores(lay, Stored(c)), ratio)) for c, lay in laid]
        per = [mean(s[0] for t2, s in scored if t2 == t) for t in tasks]
        results.append((mean(per), r, d, b, layer, per, mean(s[2]["needle"] for _, s in scored)))
    for total, r, d, b, layer, per, needle in sorted(results, reverse=True):
        print(f"| {r:g} | {d:g} | {b:g} | {layer} | " + " | ".join(f"{v:.3f}" for v in per)
              + f" | {total:.3f} | {needle:.3f} |")

    print("\n## Adaptive budget (mix defaults, floor 0.02, no cap): per-request rho by mass threshold, and the share "
          "of all reused-KV deviation left unrecomputed, adaptive vs a fixed rho equal to the adaptive mean\n")
    print("| mass | mean rho | sd | min | max | deviation left: adaptive | fixed at mean rho |")
    print("|---|---|---|---|---|---|---|")
    fixed = MixSelector()
    for mass in (0.4, 0.42, 0.44, 0.46, 0.48, 0.5):
        sel = MixSelector(mass=mass, rho_floor=0.02)
        picks = [(c, lay, *sel.budget().pick(lay, sel.scores(lay, Stored(c)), 1.0)) for c, lay in laid]
        rhos = torch.tensor([rho for *_, rho in picks])
        at = float(rhos.mean())
        same = [(c, lay, rank(fixed.scores(lay, Stored(c)), lay.context_mask())[: lay.budget(at)])
                for c, lay in laid]
        adaptive_left = mean(left(c, lay, p) for c, lay, p, _ in picks)
        fixed_left = mean(left(c, lay, p) for c, lay, p in same)
        print(f"| {mass} | {at:.3f} | {float(rhos.std()):.3f} | {float(rhos.min()):.3f} | {float(rhos.max()):.3f} | "
              f"{adaptive_left:.3f} | {fixed_left:.3f} |")


def left(case: dict, layout: Layout, picked: torch.Tensor) -> float:
    """Share of the context's reused-KV deviation in the tokens not picked."""
    true, ctx = case["true"].double(), layout.context_mask()
    rest = ctx.clone()
    rest[picked] = False
    return float(true[rest].sum() / true[ctx].sum())


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.studies.select_study", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--tasks", default=",".join(TASKS))
    c.add_argument("--requests", type=int, default=12)
    c.add_argument("--docs", type=int, default=3)
    c.add_argument("--words", type=int, default=250)
    c.add_argument("--seed", type=int, default=1000)
    c.add_argument("--model", default="smollm2-135m-instruct")
    c.add_argument("--out", default="results/study.pt")
    r = sub.add_parser("report")
    r.add_argument("path")
    r.add_argument("--ratio", type=float, default=0.15)
    args = ap.parse_args()
    collect(args) if args.cmd == "collect" else report(args)


if __name__ == "__main__":
    main()
