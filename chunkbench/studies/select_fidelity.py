"""Which cheap score ranks the tokens that matter to the answer?

`select_study` measures how much of the oracle's KV deviation a pick removes; this measures what users get: for each
case one probe blend reads every signal once (ProphetKV's query attention per layer over the reused KV, CacheBlend's
K and V deviation at layers 1-3, the oracle's true and attended deviation), then every candidate score's top-K at rho is
blended and compared with full recompute: first-token KL and teacher-forced agreement over full's greedy answer.
The report pairs each candidate with a baseline (`prophet`) on the same cases (the difference per case, its mean and
95 % bootstrap interval, and how many cases it wins), which separates candidates that unpaired intervals cannot.

Candidates: `prophet` (all layers, summed), `prophet:first_third` (the first third of the layers only: what the
`self` draft, a third of the target, would score reading the query over its reused KV), `sum` (mix with
combine=sum: half relevance, half V deviation at layer 3), `product:vL` / `product:kL` (mix by product: the geometric
mean of relevance and the V or K deviation at layer L; `product:k3` is mix's default; `product:k3:first_half` and
`:first_two_thirds` its relevance over the first layers only), `oracle:attended`, `oracle`.

    .venv/bin/python -m chunkbench.studies.select_fidelity run --workload synthetic:multikey --seed 1000 \\
        --requests 30 --out results/fidelity-multikey.jsonl
    .venv/bin/python -m chunkbench.studies.select_fidelity report results/fidelity-multikey.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from chunkcache.select.base import finish
from chunkcache.select.budget import rank
from chunkcache.select.mix import MixSelector
from .. import intervals
from ..quality import fidelity_measures
from ..quality.reference_path import ReferenceMeasure, kl_logits
from ..workloads import WorkloadConfig, items, phase
from .select_study import Stored


LAYERS = (1, 2, 3)  # deviation check layers the probe reads


class Probe:
    """A selector that reads every signal a candidate needs and picks the attended oracle's tokens (any pick will
    do: the probe's own blend is not measured)."""

    name = "probe"

    def __init__(self):
        self.layout = None
        self.signals: dict = {}

    def select(self, layout, ratio, features):
        self.layout = layout
        # the reference engine's query pass before it is summed over layers (Features.query_attention); served back
        # to the selectors as select_study.Stored, whose keys these are. The oracle's full prefill first: the
        # deviation checks then read its layers instead of deepening a partial pass once per check layer.
        self.signals = {"true": features.true_deviation(False).double(),
                        "attended": features.true_deviation(True).double(),
                        "attention": features.passes.query_attention_per_layer().double(),
                        **{f"dev_{which}": {layer: features.kv_deviation(layer, which).double() for layer in LAYERS}
                           for which in ("k", "v")}}
        self.signals["qa"] = self.signals["attention"].sum(0)
        return finish(layout, rank(self.signals["attended"], layout.context_mask())[: layout.budget(ratio)], None)


def candidates(probe: Probe) -> dict[str, torch.Tensor]:
    """Each candidate's scores; `mix`'s through MixSelector itself over the probed signals."""
    attn, stored = probe.signals["attention"], Stored(probe.signals)
    third = max(1, -(-attn.shape[0] // 3))
    return {
        "prophet": probe.signals["qa"],
        "prophet:first_third": attn[:third].sum(0),
        "sum": MixSelector(combine="sum", which="v").scores(probe.layout, stored),
        **{f"product:{which}{layer}": MixSelector(which=which, layer=layer).scores(probe.layout, stored)
           for which in ("k", "v") for layer in LAYERS},
        # mix's default with its relevance read over the first layers only: a query pass that stops early
        **{f"product:k3:first_{name}": MixSelector().scores(probe.layout, Stored({**probe.signals,
                                                                                 "qa": attn[:n].sum(0)}))
           for name, n in (("half", -(-attn.shape[0] // 2)), ("two_thirds", -(-2 * attn.shape[0] // 3)))},
        "oracle:attended": probe.signals["attended"],
        "oracle": probe.signals["true"],
    }


class Fixed:
    """Top-K of given scores."""

    name = "fixed"

    def __init__(self, scores: torch.Tensor):
        self.scores = scores

    def select(self, layout, ratio, features):
        return finish(layout, rank(self.scores, layout.context_mask())[: layout.budget(ratio)], None)


def run(args) -> None:
    from chunkcache.reference import ReferenceBlender

    torch.set_num_threads(args.threads)
    config = WorkloadConfig(args.workload, args.skip + args.requests, args.docs, args.words, seed=args.seed)
    pool = phase(config, items(config), 0)[args.skip:]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["item"] for line in out.open()} if out.is_file() else set()
    blender = ReferenceBlender.from_pretrained(args.model)
    measure = ReferenceMeasure(blender, args.max_new_tokens)
    with out.open("a") as f:
        for item in tqdm([it for it in pool if it.id not in done], desc=args.workload, unit="case"):
            ref, _ = measure.full(item)
            probe = Probe()
            blender.blend(*ref.parts, selector=probe, ratio=args.ratio)
            rows = []
            for name, scores in candidates(probe).items():
                res = blender.blend(*ref.parts, selector=Fixed(scores), ratio=args.ratio)
                forced = blender.teacher_forced_logits(res, ref.continuation).argmax(-1).tolist()
                rows.append({"item": item.id, "candidate": name, "ratio": args.ratio,
                             "kl_first": kl_logits(ref.result.logits, res.logits),
                             "tf_agreement": fidelity_measures.agreement(forced, ref.continuation)})
            f.writelines(json.dumps(r) + "\n" for r in rows)  # a case's rows land together or not at all
            f.flush()


def by_candidate(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """{candidate: {case: row}} of study or eval rows. An eval selector run at more than one rho in the same files is
    one candidate per rho, named `label@rho`, so one rho's rows never replace another's."""
    labels = [r.get("candidate") or r["selector"] for r in rows]
    rhos: dict[str, set] = defaultdict(set)
    for label, r in zip(labels, rows):
        rhos[label].add(r.get("ratio"))
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    for label, r in zip(labels, rows):
        by[label if len(rhos[label]) == 1 else f"{label}@{r['ratio']:g}"][r["item"]] = r
    return by


def paired(by: dict[str, dict[str, dict]], baseline: str, names: list[str] | None = None) -> tuple[list[str], list[dict]]:
    """(the cases every named candidate holds, a row per candidate: mean KL and TF, the per-case KL difference to the
    baseline, each with its 95 % bootstrap interval, and the cases where the candidate's KL is below the baseline's)."""
    names = names or list(by)
    missing = [n for n in {baseline, *names} if n not in by]
    if missing:
        raise SystemExit(f"no rows for {', '.join(sorted(missing))}; rows hold: {', '.join(by)}")
    cases = sorted(set.intersection(*(set(by[n]) for n in {baseline, *names})))
    base = [by[baseline][c]["kl_first"] for c in cases]
    table = []
    for name in names:
        kl = [by[name][c]["kl_first"] for c in cases]
        tf = [by[name][c]["tf_agreement"] for c in cases]
        diff = [a - b for a, b in zip(kl, base)]
        table.append({"name": name, "kl": (sum(kl) / len(kl), *intervals.mean_interval(kl)),
                      "tf": (sum(tf) / len(tf), *intervals.mean_interval(tf)),
                      "diff": (sum(diff) / len(diff), *intervals.mean_interval(diff)),
                      "relative": sum(diff) / sum(base), "better": sum(x < 0 for x in diff)})
    return cases, table


def report(args) -> None:
    """Also reads `chunkcache eval`'s row files (OUT.jsonl: a row per case and selector), pairing its selectors."""
    rows = [r for path in args.paths for r in map(json.loads, Path(path).open())
            if "item" in r]  # not an eval file's identity line
    cases, table = paired(by_candidate(rows), args.baseline, args.candidates.split(";") if args.candidates else None)
    print(f"{len(cases)} cases; KL and its difference to {args.baseline} per case: mean [95 % bootstrap interval]\n")
    print(f"| candidate | KL first token | TF agreement | KL - {args.baseline} | relative | cases better |")
    print("|---|---|---|---|---|---|")
    for t in table:
        (m, lo, hi), (tm, tlo, thi), (d, dlo, dhi) = t["kl"], t["tf"], t["diff"]
        print(f"| {t['name']} | {m:.4f} [{lo:.4f}, {hi:.4f}] | {tm:.3f} [{tlo:.3f}, {thi:.3f}] | {d:+.4f} [{dlo:+.4f}, "
              f"{dhi:+.4f}] | {t['relative']:+.0%} | {t['better']} of {len(cases)} |")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.studies.select_fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="blend every candidate's picks per case (resumable: cases in OUT are kept)")
    r.add_argument("--workload", default="synthetic:multikey", help="synthetic:TASK or musique[:PATH]")
    r.add_argument("--requests", type=int, default=30)
    r.add_argument("--skip", type=int, default=0, help="leave out the first cases (musique: records)")
    r.add_argument("--docs", type=int, default=3)
    r.add_argument("--words", type=int, default=250)
    r.add_argument("--seed", type=int, default=1000, help="synthetic: first case seed (the eval uses 0..n-1)")
    r.add_argument("--ratio", type=float, default=0.15)
    r.add_argument("--max-new-tokens", type=int, default=24)
    r.add_argument("--model", default="smollm2-135m-instruct")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", required=True)
    p = sub.add_parser("report", help="the paired table of one or more runs' rows")
    p.add_argument("paths", nargs="+")
    p.add_argument("--baseline", default="prophet", help="the candidate (or eval selector label) others pair with")
    p.add_argument("--candidates", help="only these, ';'-separated (labels hold commas), on the cases they all hold; "
                   "a selector run at several rho is LABEL@RHO")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    main()
