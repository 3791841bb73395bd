"""Quality of automatic chunk detection against hinted blending and full recompute, on the reference path.

Per case (a workload item, as `chunkcache eval` builds it), with an empty store:
  full    the unmodified HF prefill of the prompt (the oracle);
  hinted  the prompt's documents marked as chunks, each computed standalone after the prefix (`chunkcache eval`'s
          blend);
  auto    what a server with `auto.enabled` does for the prompt sent unmarked after the same documents came in
          another prompt (another order, another question; `--warm drop-last`: without the prompt's last document;
          `--warm alone`: each document in a prompt of its own, as ingest or single-document requests store them):
          that prompt teaches the store its paragraphs (each encoded alone after the canonical head, `--head`), then
          the prompt's stored segments become its chunks.
Both blends use the same selector and rho; rows hold the first-token KL against full, teacher-forced agreement with
full's greedy answer and `contains` (every gold answer in the reply: needle accuracy).

    .venv/bin/python -m chunkbench.quality.auto_quality --workload synthetic:multikey --requests 100 \\
        --out results/aq-mk.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import replace
from pathlib import Path

from chunkcache.blend.auto import AutoChunks, canonical_head
from chunkcache.config import HEADS, AutoConfig
from chunkcache.reference import ReferenceBlender
from chunkcache.segment import break_ids
from chunkcache.store import ChunkStore
from .. import scoring
from ..intervals import mean_interval
from ..workloads import WorkloadConfig, items, to_request
from .reference_path import ReferenceMeasure, rho_used

WARM_QUESTION = "Which of the documents is the longest?"


def contains(text: str, answers) -> float:
    normalized = scoring.normalize(text)
    return float(all(scoring.normalize(a) in normalized for a in answers))


def run(args) -> None:
    blender = ReferenceBlender.from_pretrained(args.model)
    tok = blender.tokenizer
    auto = AutoChunks(AutoConfig(enabled=True, head=args.head), break_ids(tok.batch_decode([[i] for i in range(len(tok))])),
                      blender.fingerprint, canonical_head(tok, args.head))
    measure = ReferenceMeasure(blender, args.max_new_tokens)
    rng = random.Random(args.seed)
    done = set()
    out_path = Path(args.out)
    if out_path.is_file():
        done = {json.loads(line)["id"] for line in out_path.open()}
    from tqdm import tqdm

    with out_path.open("a") as out:
        for item in tqdm(items(WorkloadConfig(args.workload, args.requests, args.docs, args.words, seed=args.seed))):
            if item.id in done:
                continue
            blender.store = ChunkStore(model_fingerprint=blender.fingerprint)
            ref, full_row = measure.full(item)
            hinted = measure.blended(ref, args.selector, args.ratio, {})
            order = list(range(len(item.documents)))
            while order == sorted(order) and len(order) > 1:
                rng.shuffle(order)
                if args.warm in ("keep-first", "held-first"):  # the first document first in both prompts
                    order = [0] + [i for i in order if i]
            if args.warm == "drop-last":  # the last document never stored: it and the question are the auto query
                order = [i for i in order if i != len(order) - 1]
            warms = [replace(item, documents=tuple(item.documents[i] for i in order), question=WARM_QUESTION)]
            if args.warm == "alone":
                warms = [replace(item, documents=(doc,), question=WARM_QUESTION) for doc in item.documents]
            learned = sum(blender.learn(to_request(tok, w).prompt.input_ids, auto) for w in warms)
            ids = ref.result.layout.token_ids
            # held-first: a server's radix tree holds the prompt up to its first document's end (the earlier prompt
            # began the same way)
            matched = to_request(tok, item).prompt.token_spans[0][1] if args.warm == "held-first" else 0
            res = blender.auto_blend(ids, auto, args.selector, args.ratio, matched=matched)
            if res is None:  # too few stored tokens: served as stock, exactly full's answer
                auto_row = {**full_row, "rho_used": 1.0, "stock": True}
            else:
                auto_row = measure.measured(res, ref, rho_used=rho_used(res), reused=res.reused_tokens)
            row = {"id": item.id, "tokens": len(ids), "learned": learned, "selector": args.selector,
                   "ratio": args.ratio, "answers": list(item.answers)}
            for name, r in (("full", full_row), ("hinted", hinted), ("auto", auto_row)):
                row[name] = {k: r[k] for k in ("text", "tf_agreement", "kl_first") if k in r}
                row[name]["contains"] = contains(r["text"], item.answers)
                row[name].update({k: r[k] for k in ("rho_used", "reused", "stock") if k in r})
            out.write(json.dumps(row) + "\n")
            out.flush()


def summarize(path: Path) -> str:
    rows = [json.loads(line) for line in path.open()]
    n = len(rows)
    kl = {s: [r[s]["kl_first"] for r in rows] for s in ("hinted", "auto")}
    diff = [a - h for a, h in zip(kl["auto"], kl["hinted"])]
    lo, hi = mean_interval(diff)
    base = statistics.mean(kl["hinted"])
    acc = {s: statistics.mean(r[s]["contains"] for r in rows) for s in ("full", "hinted", "auto")}
    tf = {s: statistics.mean(r[s]["tf_agreement"] for r in rows) for s in ("hinted", "auto")}
    lines = [f"{path.name}: {n} cases, median {statistics.median(r['tokens'] for r in rows):.0f} tokens, "
             f"{rows[0]['selector']} at rho {rows[0]['ratio']}; auto served as stock in "
             f"{sum(bool(r['auto'].get('stock')) for r in rows)}",
             "| side | first-token KL (mean) | TF agreement | contains (needle accuracy) | vs full |",
             "|---|---|---|---|---|",
             f"| full | 0 | 1 | {acc['full']:.3f} | 100 % |"]
    for s in ("hinted", "auto"):
        vs_full = f"{100 * acc[s] / acc['full']:.1f} %" if acc["full"] else "n/a"
        lines.append(f"| {s} | {statistics.mean(kl[s]):.4f} | {tf[s]:.3f} | {acc[s]:.3f} | {vs_full} |")
    lines.append(f"auto vs hinted, paired: KL {100 * statistics.mean(diff) / base:+.1f} % "
                 f"[{100 * lo / base:+.1f}, {100 * hi / base:+.1f}] (95 % bootstrap interval of the mean difference, "
                 f"over hinted's mean)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.quality.auto_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="synthetic:multikey", help="musique | synthetic:TASK (chunkcache eval's)")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--words", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--selector", default="prophet")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--warm", choices=("shuffle", "keep-first", "held-first", "drop-last", "alone"),
                    default="shuffle",
                    help="the earlier prompt's document order: any other order, the same first document (isolates "
                    "what the first document's context costs; held-first: and the prompt held exactly up to that "
                    "document's end, as the radix tree holds the prefix the two prompts share), any order without "
                    "the last document (a passage the store lacks at the prompt's end, as under churn), or each "
                    "document in a prompt of its own (ingest)")
    ap.add_argument("--head", choices=HEADS, default=AutoConfig().head,
                    help="auto.head: what each paragraph is encoded after (default: the shipped one)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", required=True, help="JSON Lines of rows; an existing file is resumed")
    ap.add_argument("--report", action="store_true", help="only summarize --out")
    args = ap.parse_args()
    if not args.report:
        run(args)
    print(summarize(Path(args.out)))


if __name__ == "__main__":
    main()
