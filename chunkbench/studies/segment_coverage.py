"""How much of a prompt's pasted documents each boundary scheme finds again after they come back in another order:
content-defined segments (chunkcache.segment, at several settings) against fixed blocks found by a rolling probe
(LMCache's blend server: aligned B-token blocks of the stored prompt, looked for at every offset of the new one).

Per MuSiQue record: a prompt of its first `--docs` passages (a template, the chat template around it) is stored, then
the same passages in another order with another question are looked up; coverage = found tokens / document tokens.

    .venv/bin/python -m chunkbench.studies.segment_coverage --records 30 --docs 8
"""

from __future__ import annotations

import argparse
import random

from chunkcache.segment import Segmenter, break_ids
from ..serving.auto_bench import TEMPLATES, passages

JOINS = {"template": None, "space": " ", "numbered": "numbered"}


def text(docs: list[str], question: str, join: str) -> str:
    if join == "template":
        return TEMPLATES["llamaindex"].format(context="\n\n".join(docs), question=question)
    if join == "space":
        return "Documents: " + " ".join(docs) + " Question: " + question
    return "Documents:\n" + "\n".join(f"[{i + 1}] {d}" for i, d in enumerate(docs)) + "\nQuestion: " + question


def by_segments(seg: Segmenter, stored: list[int], new: list[int]) -> int:
    keep = {tuple(stored[s:e]) for s, e in seg.spans(stored) if e - s >= seg.min_tokens}
    return sum(e - s for s, e in seg.spans(new) if e - s >= seg.min_tokens and tuple(new[s:e]) in keep)


def by_blocks(block: int, stored: list[int], new: list[int]) -> int:
    keep = {tuple(stored[i: i + block]) for i in range(0, len(stored) - block + 1, block)}
    i = found = 0
    while i + block <= len(new):
        if tuple(new[i: i + block]) in keep:
            found, i = found + block, i + block
        else:
            i += 1
    return found


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.studies.segment_coverage", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=30)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--words", type=int, help="passages cut to this many words (default: whole)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from chunkcache.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    breaks = break_ids(tok.batch_decode([[i] for i in range(len(tok))]))
    schemes = {f"cdc mean {m} min {n}": (lambda s, t, g=Segmenter(breaks, mean=m, min_tokens=n): by_segments(g, s, t))
               for m, n in ((16, 16), (32, 16), (64, 16), (32, 8))}
    schemes.update({f"blocks {b}": (lambda s, t, b=b: by_blocks(b, s, t)) for b in (64, 256)})

    def ids(docs, question, join):
        chat = tok.apply_chat_template([{"role": "user", "content": text(docs, question, join)}], tokenize=False,
                                       add_generation_prompt=True)
        return tok(chat, add_special_tokens=False)["input_ids"]

    print(f"{'scheme':<22}" + "".join(f"{j:>12}" for j in JOINS))
    rng = random.Random(0)
    rows = {name: dict.fromkeys(JOINS, 0) for name in schemes}
    total = dict.fromkeys(JOINS, 0)
    for question, docs in passages()[: args.records]:
        docs = [" ".join(d.split(" ")[: args.words]) if args.words else d for d in docs[: args.docs]]
        order = docs[:]
        rng.shuffle(order)
        for join in JOINS:
            stored, new = ids(docs, question, join), ids(order, "Another question: " + question, join)
            total[join] += sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in docs)
            for name, found in schemes.items():
                rows[name][join] += found(stored, new)
    for name, found in rows.items():
        print(f"{name:<22}" + "".join(f"{found[j] / total[j]:>12.3f}" for j in JOINS))


if __name__ == "__main__":
    main()
