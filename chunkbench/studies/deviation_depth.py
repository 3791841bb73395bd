"""How a chunk's KV deviation grows with its depth: the evidence behind chunkcache.blend.features.DEPTH_EXPONENT.

Each case's chunks are blended in three orders (as given, reversed, rotated by one: the orders the eval harness
warms stored deviations in), and each chunk's mean K deviation at layer 3 (mix's default check) is recorded with its
depth: the context positions between the shared prefix and the chunk. For every pair of orders in which the same
chunk sits away from home at two different depths, log(mean deviation ratio) is regressed on log(depth ratio); the
slope is the exponent, r how well depth alone explains the change.

    OMP_NUM_THREADS=1 .venv/bin/python -m chunkbench.studies.deviation_depth --workload musique --docs 5 --words 120
    OMP_NUM_THREADS=1 .venv/bin/python -m chunkbench.studies.deviation_depth --workload synthetic:multikey --seed 1000
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

import torch
from tqdm import tqdm

from chunkcache.models import DEFAULT_MODEL
from chunkcache.select.base import finish

from ..quality.reference_path import split
from ..workloads import WorkloadConfig, items, phase, to_request


class Probe:
    """Records the K deviation at `layer` in the prompt it is asked to select for; picks nothing."""

    name = "probe"

    def __init__(self, layer: int):
        self.layer, self.deviation, self.layout = layer, None, None

    def select(self, layout, ratio, features):
        self.layout, self.deviation = layout, features.kv_deviation(self.layer, "k").double()
        return finish(layout, torch.zeros(0, dtype=torch.long), None)


def fit(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope through (log depth ratio, log deviation ratio) pairs, and Pearson's r."""
    xs, ys = zip(*pairs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / sxx, sxy / math.sqrt(sxx * syy)


def main(argv=None) -> int:
    from chunkcache.reference import ReferenceBlender

    ap = argparse.ArgumentParser(prog="python -m chunkbench.studies.deviation_depth", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="musique")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--words", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args(argv)
    config = WorkloadConfig(args.workload, args.requests, args.docs, args.words, seed=args.seed)
    blender = ReferenceBlender.from_pretrained(args.model)
    pairs = []
    for item in tqdm(phase(config, items(config), 0)[: args.requests], desc=args.workload, unit="case"):
        prefix, chunks, query = split(to_request(blender.tokenizer, item).prompt)
        n = len(chunks)
        seen: dict[int, list[tuple[int, float]]] = {i: [] for i in range(n)}  # chunk -> (depth, mean deviation)
        for order in (list(range(n)), list(range(n))[::-1], list(range(1, n)) + [0]):
            probe = Probe(args.layer)
            blender.blend(prefix, [chunks[i] for i in order], query, selector=probe)
            for i, (s, e) in zip(order, probe.layout.chunk_spans):
                if s > probe.layout.prefix_len:  # away from home
                    seen[i].append((s - probe.layout.prefix_len, float(probe.deviation[s:e].mean())))
        for at in seen.values():
            pairs += [(math.log(d1 / d2), math.log(m1 / m2)) for (d1, m1), (d2, m2) in itertools.combinations(at, 2)
                      if d1 != d2]
    slope, r = fit(pairs)
    print(f"{args.workload}: mean K deviation at layer {args.layer} ~ depth ** {slope:.3f} (r {r:.3f}, "
          f"{len(pairs)} pairs of the same chunk at two depths, {args.requests} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
