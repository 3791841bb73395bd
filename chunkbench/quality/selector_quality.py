"""Selector quality and cost through the reference blender on synthetic RAG cases.

For each case: full recompute (the oracle) and one blended prefill per selector at budget rho, each followed by a
greedy answer. Prints, per selector, answer agreement with full recompute, accuracy against the ground truth, and
selection time relative to the blended prefill (chunks already in the store). Agreement compares the answers
the replies give (the cities / numbers / names they name), `same text` the first lines verbatim.

    .venv/bin/python -m chunkbench.quality.selector_quality --n 30 --selectors epic,cacheblend,prophet,spec,clip
    .venv/bin/python -m chunkbench.quality.selector_quality --n 10 --selectors spec,spec:per_chunk=true \\
        --drafts self,self:4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from chunkbench import synthetic
from chunkbench.quality.reference_path import answer, blend, blend_seconds, selector_runs
from chunkcache.reference import ReferenceBlender


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.quality.selector_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=30, help="cases")
    ap.add_argument("--task", default="bridge", choices=synthetic.TASKS)
    ap.add_argument("--selectors", default="none,epic,cacheblend,prophet,spec,clip")
    ap.add_argument("--drafts", default="self", help="drafts for spec/clip, comma-separated: self, self:LAYERS, "
                                                     "a model name, an HF directory or a .gguf file (name:LAYERS)")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--chunks", type=int, default=3, help="chunks per prompt, each 256-512 tokens (ProphetKV App. B: 3)")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="needle answers need ~20")
    ap.add_argument("--seed", type=int, default=0, help="first case seed")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="results/selector_quality.json")
    ap.add_argument("--report", action="store_true", help="only print the table of an earlier run's --out file")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report:
        saved = json.loads(out.read_text())
        return _report(saved["rows"], argparse.Namespace(**saved["args"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)

    blender = ReferenceBlender.from_pretrained(args.model)
    tok = blender.tokenizer
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    runs = selector_runs(args.selectors.split(","), args.drafts.split(","), blender)
    rows: dict[str, list[dict]] = {"full": []}
    for seed in tqdm(range(args.seed, args.seed + args.n), desc=f"{args.task} cases", unit="case"):
        case = synthetic.generate(args.task, seed, n_chunks=args.chunks, count=count)
        prefix, chunks, query = synthetic.prompt(case, tok)
        full = blender.full_prefill(prefix, chunks, query)
        ref = answer(blender, full, args.max_new_tokens)
        rows["full"].append({"answer": ref, "correct": case.correct(ref), "blend_s": full.timings["total"],
                             "tokens": full.layout.n})
        for label, name, options in runs:
            res = blend(blender, (prefix, chunks, query), name, args.ratio, options)
            text = answer(blender, res, args.max_new_tokens)
            rows.setdefault(label, []).append({
                "answer": text, "agree": case.extract(text) == case.extract(ref),
                "same_text": _norm(text) == _norm(ref),
                "correct": case.correct(text),
                "select_s": res.timings["features"] + res.timings["select"], "blend_s": blend_seconds(res),
                "full_s": full.timings["total"],
                "recomputed": int(res.recomputed.numel()),
            })
        out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))  # a cut-short run keeps its cases
    _report(rows, args)
    print(f"per-case results: {out}")


def _norm(text: str) -> str:
    return " ".join(text.strip().lower().split("\n")[0].split())


def _report(rows: dict[str, list[dict]], args) -> None:
    n = len(rows["full"])
    full_s = statistics.mean(r["blend_s"] for r in rows["full"])
    tokens = statistics.mean(r["tokens"] for r in rows["full"])
    print(f"\n{args.task}: {n} cases, {tokens:.0f} prompt tokens on average, rho={args.ratio}, model {args.model}")
    print(f"full recompute: correct {sum(r['correct'] for r in rows['full'])}/{n}, prefill {full_s:.2f} s\n")
    head = (f"{'selector':<30}{'agree':>8}{'same text':>11}{'correct':>9}{'select s':>10}{'blend s':>9}"
            f"{'select/blend':>14}{'full/blend':>12}")
    print(head)
    print("-" * len(head))
    for label, rs in rows.items():
        if label == "full":
            continue
        sel = statistics.mean(r["select_s"] for r in rs)
        blend_s = statistics.mean(r["blend_s"] for r in rs)
        print(f"{label:<30}{sum(r['agree'] for r in rs):>5}/{n:<2}{sum(r['same_text'] for r in rs):>8}/{n:<2}"
              f"{sum(r['correct'] for r in rs):>6}/{n:<2}"
              f"{sel:>10.3f}{blend_s:>9.2f}{sel / blend_s:>14.2f}{full_s / blend_s:>12.2f}")


if __name__ == "__main__":
    main()
