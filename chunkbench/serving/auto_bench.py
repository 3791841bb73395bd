"""Automatic chunk detection against stock prefix caching: `chunkcache bench --workload auto`.

Documents are MuSiQue passages (chunkbench/data/musique_dev.json, 10 per record) pasted as plain text with the
default templates of two RAG frameworks, alternating (LlamaIndex's text QA template, LangChain's stuff-documents
prompt), as the user message of the model's chat template; no request carries a chunk hint. Two servers are up, an
auto one (`--auto-chunks`) and a stock one (`--no-chunk-reuse`); requests go one at a time, so only one scheduler
works at any moment.

  --phase shuffled  warm documents: each prompt's documents first sent once in another order, then the prompt
                    without hints (auto), with hints (the same documents marked, its own namespace) and to stock,
                    the three sides alternating per prompt. Reused tokens auto vs hinted, TTFT ratios to stock,
                    the share of hinted's speed-up auto keeps. `--profile FILE`: the auto server's scheduler sampled
                    with py-spy during the auto and the hinted requests (FILE.auto, FILE.hinted), the costliest
                    functions of each printed; the sampler shares the cores: a profiled run's timings are not reported.
  --phase cold      never-seen documents (each passage tagged with the request's number, so no segment is stored):
                    the same prompt to auto and to stock, alternating which goes first. Greedy output equal to
                    stock's, detection seconds, TTFT ratio (the cost of looking), learning's seconds (after the
                    first token: the server's /metrics).
  --phase churn     `--requests` prompts (batches of 15) of `--docs` whole passages drawn with Zipf popularity from a
                    pool of `--pool` (the store's host budget a fraction of their KV: set it with --config), a
                    fresh question each, every prompt to both servers (which goes first alternating). Per batch:
                    median TTFT stock/auto, the slowest request's auto/stock, how many were computed in full.
  --phase sustained `--requests` prompts whose documents are drawn with Zipf popularity from the whole pool (its KV
                    several times the store's host budget: set it with --config), all to the auto server; every
                    tenth also to stock. Per block of 100: hit rate, reused share, TTFT ratio to stock on the
                    block's paired prompts, the auto scheduler's RSS and the store's bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from ..workloads import DEFAULT_MUSIQUE
from .http_client import drain, fell_back, generate
from .pyspy import print_top, sampled
from .servers import start_server

DATA = DEFAULT_MUSIQUE
PY_SPY_ATTACH_S = 0.5  # a profiled request is sent this long after py-spy starts, so its first samples are kept
TEMPLATES = {
    # LlamaIndex's DEFAULT_TEXT_QA_PROMPT; nodes joined by "\n\n"
    "llamaindex": ("Context information is below.\n---------------------\n{context}\n---------------------\nGiven the "
                   "context information and not prior knowledge, answer the query.\nQuery: {question}\nAnswer: "),
    # LangChain's stuff-documents chain (documents joined by "\n\n") in the RAG prompt its tutorials use
    "langchain": "Answer the question based only on the following context:\n{context}\n\nQuestion: {question}",
}


def passages(path: Path = DATA) -> list[tuple[str, list[str]]]:
    """(question, its record's passages as "title\\ntext") per MuSiQue record."""
    return [(r["question"], [f"{c['title']}\n{c['text']}" for c in r["ctxs"]]) for r in json.loads(path.read_text())]


class Prompts:
    def __init__(self, tokenizer):
        self.tok = tokenizer

    def ids(self, docs: list[str], question: str, template: str) -> list[int]:
        text = TEMPLATES[template].format(context="\n\n".join(docs), question=question)
        return self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False)

    def hinted(self, docs: list[str], question: str, template: str) -> tuple[list[int], list[list[int]]]:
        """The same prompt's ids with each document's span (documents tokenized in place: the span is where the
        pasted document's own tokens sit, found by tokenizing the prompt up to its end)."""
        text = TEMPLATES[template].format(context="\n\n".join(docs), question=question)
        full = self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                            add_generation_prompt=True)
        ids = self.tok(full, add_special_tokens=False)["input_ids"]
        spans, at = [], 0
        for d in docs:
            start = full.index(d, at)
            s = len(self.tok(full[:start], add_special_tokens=False)["input_ids"])
            e = len(self.tok(full[:start + len(d)], add_special_tokens=False)["input_ids"])
            spans.append([s, e])
            at = start + len(d)
        return ids, spans


def hints(spans, namespace: str) -> dict:
    return {"protocol_version": "1", "message_id": "auto-bench", "actions": [{
        "action_id": "c", "action_type": "chunkcache.chunks", "action_version": "1",
        "payload": {"token_spans": spans, "namespace": namespace}}]}


def chunkcache_state(url: str) -> dict:
    """The auto server's chunkcache state from /server_info (the scheduler's pid, the store's bytes, ...)."""
    return requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]["chunkcache"]


def scheduler_rss(url: str) -> tuple[int, int]:
    """(RSS bytes of the server's scheduler, chunk-store host bytes), from /server_info."""
    state = chunkcache_state(url)
    for line in Path(f"/proc/{state['scheduler_pid']}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024, state["store"]["memory_bytes"]
    raise RuntimeError("no VmRSS for the scheduler")


def shuffled(args, prompts: Prompts, auto_url: str, stock_url: str, out) -> None:
    pool = passages()
    profiled = {"auto": [], "hinted": []} if args.profile else {}
    rng = random.Random(args.seed)
    for i in range(args.requests):
        question, docs = pool[i % len(pool)]
        docs = (docs * 2)[: args.docs]  # ~3K: 5 passages; ~7K: 12 (a record has 10: repeated ones are other copies)
        docs = [f"[{j}] {d}" if j >= 10 else d for j, d in enumerate(docs)]  # repeats differ from their originals
        template = list(TEMPLATES)[i % 2]
        warm = docs[:]
        rng.shuffle(warm)
        generate(auto_url, prompts.ids(warm, "Which passage is the longest?", template), 1)  # learns the documents
        hinted_warm, warm_spans = prompts.hinted(warm, "Which passage is the longest?", template)
        generate(auto_url, hinted_warm, 1, hints(warm_spans, "hinted"))
        order = docs[:]
        rng.shuffle(order)
        ids = prompts.ids(order, question, template)
        hinted_ids, spans = prompts.hinted(order, question, template)
        sides = [("auto", auto_url, ids, None), ("hinted", auto_url, hinted_ids, hints(spans, "hinted")),
                 ("stock", stock_url, ids, None)]
        for side, url, side_ids, kv in (sides if i % 2 == 0 else sides[::-1]):
            drain(auto_url)  # the deviations the warm-up estimated, measured before any side is timed
            if side in profiled:
                profiled[side].append(Path(f"{args.profile}.{side}.{i}"))
                with sampled(chunkcache_state(auto_url)["scheduler_pid"], profiled[side][-1]):
                    time.sleep(PY_SPY_ATTACH_S)
                    o = generate(url, side_ids, args.max_new_tokens, kv)
            else:
                o = generate(url, side_ids, args.max_new_tokens, kv)
            row = {"phase": "shuffled", "i": i, "side": side, "template": template, "prompt_tokens": len(side_ids),
                   "ttft_s": o.ttft_s, "text": o.text, "report": o.report, "fallback": fell_back(o.report)}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(side, len(side_ids), round(o.ttft_s, 3), (o.report or {}).get("reused_tokens"), flush=True)
    for side, parts in profiled.items():  # one file per side: py-spy's raw lines add up
        merged = Path(f"{args.profile}.{side}")
        merged.write_text("".join(p.read_text() for p in parts if p.exists()))
        for p in parts:
            p.unlink(missing_ok=True)
        print(f"\n{side}:")
        print_top(merged)


def cold(args, prompts: Prompts, auto_url: str, stock_url: str, out) -> None:
    pool = passages()
    for i in range(args.requests):
        question, docs = pool[(i + 50) % len(pool)]
        docs = [d.replace(". ", f". ({i}) ") for d in docs[: args.docs]]  # tagged in every sentence: never seen
        ids = prompts.ids(docs, question, list(TEMPLATES)[i % 2])
        sides = [("auto", auto_url), ("stock", stock_url)]
        for side, url in (sides if i % 2 == 0 else sides[::-1]):
            drain(auto_url)  # answers once the auto scheduler is idle: what it learned is stored, off either side
            o = generate(url, ids, args.max_new_tokens)
            row = {"phase": "cold", "i": i, "side": side, "prompt_tokens": len(ids), "ttft_s": o.ttft_s,
                   "output_ids": list(o.output_ids), "report": o.report, "fallback": fell_back(o.report)}
            out.write(json.dumps(row) + "\n")
            out.flush()
    drain(auto_url)  # the last prompt's learning stored
    out.write(json.dumps({"phase": "cold-learning", **learn_seconds(auto_url)}) + "\n")


def learn_seconds(url: str) -> dict:
    """The server's time storing learned segments, off the requests' first tokens: /metrics'
    chunkcache_auto_learn_seconds (sum, count)."""
    text = requests.get(url + "/metrics", timeout=30).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name.startswith("chunkcache_auto_learn_seconds")}
    return {"sum": samples.get("chunkcache_auto_learn_seconds_sum", 0.0),
            "count": int(samples.get("chunkcache_auto_learn_seconds_count", 0))}


def churn(args, prompts: Prompts, auto_url: str, stock_url: str, out) -> None:
    pool = passages()
    rng = random.Random(args.seed)
    docs = [d for _, ds in pool for d in ds]
    docs = [docs[i] for i in rng.sample(range(len(docs)), args.pool)]
    weights = [1.0 / (rank + 1) ** args.zipf for rank in range(len(docs))]
    questions = [q for q, _ in pool]
    for i in range(args.requests):
        ids = prompts.ids([docs[j] for j in zipf_sample(rng, weights, args.docs)], rng.choice(questions),
                          "llamaindex")
        sides = [("auto", auto_url), ("stock", stock_url)]
        for side, url in (sides if i % 2 == 0 else sides[::-1]):
            drain(auto_url)  # the auto server's idle work must not share the cores with either side's request
            o = generate(url, ids, args.max_new_tokens)
            row = {"phase": "churn", "i": i, "side": side, "prompt_tokens": len(ids), "ttft_s": o.ttft_s,
                   "report": o.report, "fallback": fell_back(o.report)}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(side, len(ids), round(o.ttft_s, 3), {k: (o.report or {}).get(k) for k in
                                                        ("reused_tokens", "recomputed_tokens", "choice",
                                                         "fallback")}, flush=True)


def churn_batches(rows: list[dict], size: int = 15) -> list[dict]:
    """Per batch of `size` churn prompts: median TTFT stock/auto, the largest auto/stock of one prompt, prompts
    computed in full by the auto server (served as stock, or predicted slower), reused share."""
    by = {(r["i"], r["side"]): r for r in rows if r["phase"] == "churn"}
    prompts = sorted({i for i, _ in by})
    out = []
    for b in range(0, len(prompts), size):
        pairs = [(by[i, "stock"], by[i, "auto"]) for i in prompts[b: b + size]
                 if (i, "stock") in by and (i, "auto") in by]
        reps = [a["report"] or {} for _, a in pairs]
        stock, auto = (statistics.median(p[k]["ttft_s"] for p in pairs) for k in (0, 1))
        out.append({"first": b, "n": len(pairs), "ratio": stock / auto,
                    "worst": max(a["ttft_s"] / s["ttft_s"] for s, a in pairs),
                    "full": sum("selector" not in x for x in reps),
                    "reused": sum(x.get("reused_tokens", 0) for x in reps) / sum(a["prompt_tokens"] for _, a in pairs)})
    return out


def zipf_sample(rng: random.Random, weights: list[float], k: int) -> list[int]:
    chosen: list[int] = []
    while len(chosen) < k:
        i = rng.choices(range(len(weights)), weights)[0]
        if i not in chosen:
            chosen.append(i)
    return chosen


def sustained(args, prompts: Prompts, auto_url: str, stock_url: str, out) -> None:
    pool = passages()
    docs = [" ".join(d.split(" ")[: args.words]) for _, ds in pool for d in ds]
    questions = [q for q, _ in pool]
    rng = random.Random(args.seed)
    order = list(range(len(docs)))
    rng.shuffle(order)  # popularity rank independent of the record a passage came from
    weights = [0.0] * len(docs)
    for rank, i in enumerate(order):
        weights[i] = 1.0 / (rank + 1) ** args.zipf
    from tqdm import tqdm

    for i in tqdm(range(args.requests), desc="requests"):
        chosen = zipf_sample(rng, weights, args.docs)
        template = list(TEMPLATES)[i % 2]
        ids = prompts.ids([docs[j] for j in chosen], rng.choice(questions), template)
        sides = [("auto", auto_url)] + ([("stock", stock_url)] if i % 10 == 0 else [])
        for side, url in (sides if (i // 10) % 2 == 0 else sides[::-1]):
            o = generate(url, ids, args.max_new_tokens)
            row = {"phase": "sustained", "i": i, "side": side, "prompt_tokens": len(ids), "ttft_s": o.ttft_s,
                   "report": o.report, "fallback": fell_back(o.report)}
            if side == "auto" and i % 10 == 0:
                row["rss"], row["store_bytes"] = scheduler_rss(auto_url)
            out.write(json.dumps(row) + "\n")
            out.flush()


def summarize(rows: list[dict]) -> str:
    lines = []
    sh = [r for r in rows if r["phase"] == "shuffled"]
    if sh:
        by = {s: [r for r in sh if r["side"] == s] for s in ("auto", "hinted", "stock")}
        med = {s: statistics.median(r["ttft_s"] for r in v) for s, v in by.items() if v}
        reused = {s: sum((r["report"] or {}).get("reused_tokens", 0) for r in by[s]) for s in ("auto", "hinted")}
        tokens = statistics.median(r["prompt_tokens"] for r in by["auto"])
        lines += [f"shuffled, warm documents: {len(by['auto'])} prompts, median {tokens:.0f} tokens",
                  "| side | TTFT median s | vs stock | reused tokens | fallbacks |", "|---|---|---|---|---|"]
        for s in ("stock", "hinted", "auto"):
            lines.append(f"| {s} | {med[s]:.3f} | {med['stock'] / med[s]:.2f}x | {reused.get(s, '')} | "
                         f"{sum(r['fallback'] for r in by[s])} |")
        hinted = {r["i"]: r["ttft_s"] for r in by["hinted"]}
        share = [hinted[r["i"]] / r["ttft_s"] for r in by["auto"] if r["i"] in hinted]
        lines.append(f"auto keeps {med['hinted'] / med['auto']:.2f} of hinted's speed-up (medians); per prompt, "
                     f"hinted's TTFT / auto's: median {statistics.median(share):.2f}, "
                     f"{', '.join(f'{x:.2f}' for x in share)}")
        lines.append(f"auto reuses {reused['auto'] / max(1, reused['hinted']):.3f} of hinted's tokens; auto's first "
                     f"token equals stock's in {sum(a['text'] == b['text'] for a, b in zip(by['auto'], by['stock']))} "
                     f"of {len(by['auto'])}")
    if any(r["phase"] == "churn" for r in rows):
        lines += ["churn: per batch of 15 prompts", "| prompts | n | TTFT stock/auto (medians) | slowest auto/stock | "
                  "computed in full | reused share |", "|---|---|---|---|---|---|"]
        for b in churn_batches(rows):
            lines.append(f"| {b['first']}- | {b['n']} | {b['ratio']:.2f} | {b['worst']:.2f} | {b['full']} | "
                         f"{b['reused']:.2f} |")
    co = [r for r in rows if r["phase"] == "cold"]
    if co:
        auto = {r["i"]: r for r in co if r["side"] == "auto"}
        stock = {r["i"]: r for r in co if r["side"] == "stock"}
        pairs = [(auto[i], stock[i]) for i in auto if i in stock]
        detect = [a["report"]["detect_s"] for a, _ in pairs]
        learning = next((r for r in rows if r["phase"] == "cold-learning"), {"sum": 0.0, "count": 0})
        lines += [f"never-seen documents: {len(pairs)} prompts, median "
                  f"{statistics.median(a['prompt_tokens'] for a, _ in pairs):.0f} tokens",
                  f"greedy output identical to stock's: {sum(a['output_ids'] == s['output_ids'] for a, s in pairs)} "
                  f"of {len(pairs)}; blended or fell back: "
                  f"{sum('selector' in a['report'] or a['fallback'] for a, _ in pairs)}",
                  f"TTFT median: auto {statistics.median(a['ttft_s'] for a, _ in pairs):.3f} s, stock "
                  f"{statistics.median(s['ttft_s'] for _, s in pairs):.3f} s; paired auto/stock median "
                  f"{statistics.median(a['ttft_s'] / s['ttft_s'] for a, s in pairs):.3f}",
                  f"detection median {1e3 * statistics.median(detect):.2f} ms "
                  f"({100 * statistics.median(d / s['ttft_s'] for d, (_, s) in zip(detect, pairs)):.2f} % of stock's "
                  f"TTFT); learning after the first token: {learning['count']} prompts, mean "
                  f"{1e3 * learning['sum'] / max(1, learning['count']):.1f} ms (chunkcache_auto_learn_seconds)"]
    blocks = sustained_blocks(rows)
    if blocks:
        auto = [r for r in rows if r["phase"] == "sustained" and r["side"] == "auto"]
        lines += ["", f"sustained: {len(auto)} requests, {sum(r['fallback'] for r in auto)} fallbacks",
                  "| requests | auto blended | reused share | segment hit rate | TTFT auto median s | TTFT ratio to "
                  "stock (paired) | scheduler RSS MB | store MB |", "|---|---|---|---|---|---|---|---|"]
        for b in blocks:
            lines.append(f"| {b['first']}-{b['last']} | {b['blended']} | {b['reused']:.3f} | {b['hit_rate']:.3f} | "
                         f"{b['ttft']:.3f} | {b['ratio']:.2f}x | {b['rss_mb']:.0f} | {b['store_mb']:.0f} |")
    return "\n".join(lines)


def sustained_blocks(rows: list[dict], size: int = 100) -> list[dict]:
    """Per block of `size` sustained requests: blended requests, reused share of prompt tokens, segment hit rate,
    median TTFT, TTFT ratio to stock on the block's paired prompts, the last RSS and store bytes read."""
    su = [r for r in rows if r["phase"] == "sustained"]
    stock = {r["i"]: r["ttft_s"] for r in su if r["side"] == "stock"}
    auto = [r for r in su if r["side"] == "auto"]
    out = []
    for b in range(0, len(auto), size):
        block = auto[b: b + size]
        reps = [r["report"] or {} for r in block]
        paired = [(stock[r["i"]], r["ttft_s"]) for r in block if r["i"] in stock]
        read = [r for r in block if "rss" in r]
        out.append({
            "first": b, "last": b + len(block) - 1, "blended": sum("selector" in x for x in reps),
            "reused": sum(x.get("reused_tokens", 0) for x in reps) / sum(r["prompt_tokens"] for r in block),
            "hit_rate": sum(x.get("chunk_hits", 0) for x in reps) / max(1, sum(x.get("segments", 0) for x in reps)),
            "ttft": statistics.median(r["ttft_s"] for r in block),
            "ratio": (statistics.median(s for s, _ in paired) / statistics.median(a for _, a in paired)
                      if paired else float("nan")),
            "rss_mb": read[-1]["rss"] / 2**20 if read else float("nan"),
            "store_mb": read[-1]["store_bytes"] / 2**20 if read else float("nan")})
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="chunkcache bench --workload auto", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="auto")
    ap.add_argument("--phase", choices=("shuffled", "cold", "churn", "sustained"), default="sustained")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--docs", type=int, default=5, help="passages per prompt (sustained 5 of 120 words: ~1.1K tokens; "
                    "shuffled, whole passages: 5 ~3K, 12 ~7K)")
    ap.add_argument("--words", type=int, default=120, help="sustained: passages cut to this many words")
    ap.add_argument("--zipf", type=float, default=1.0, help="popularity exponent over the passage pool")
    ap.add_argument("--pool", type=int, default=60, help="churn: passages the prompts draw from")
    ap.add_argument("--max-new-tokens", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", help="auto server's YAML (e.g. store.host_bytes for the sustained run)")
    ap.add_argument("--out", help="results directory (default results/auto-PHASE-TIME)")
    ap.add_argument("--report", metavar="DIR", help="only summarize an earlier run's rows.jsonl")
    ap.add_argument("--profile", metavar="FILE", help="shuffled: py-spy samples of the auto server's scheduler during "
                    "the auto and the hinted requests (FILE.auto, FILE.hinted); not a run to report timings from")
    args = ap.parse_args(argv)
    if args.report:
        report(Path(args.report))
        return 0
    from transformers import AutoTokenizer

    from chunkcache.config import config_file
    from chunkcache.models import resolve_model

    out_dir = Path(args.out or f"results/auto-{args.phase}-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = Prompts(AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct")))
    auto_yaml = out_dir / "auto.yaml"
    auto_yaml.write_text((config_file(args.config).read_text() if args.config else "") + "\n")
    with start_server(out_dir / "stock.log", chunk_reuse=False) as stock, \
            start_server(out_dir / "auto.log", chunk_reuse=True, config=str(auto_yaml), auto_chunks=True) as auto:
        with (out_dir / "rows.jsonl").open("w") as out:
            {"shuffled": shuffled, "cold": cold, "churn": churn, "sustained": sustained}[args.phase](
                args, prompts, auto.url, stock.url, out)
    report(out_dir)
    return 0


def report(out_dir: Path) -> None:
    rows = [json.loads(line) for line in (out_dir / "rows.jsonl").open()]
    summary = summarize(rows)
    (out_dir / "summary.md").write_text(summary + "\n")
    if any(r["phase"] == "sustained" for r in rows):
        plot(rows, out_dir / "sustained.png")
    print(summary)
    print(f"results in {out_dir}")


def plot(rows: list[dict], path: Path) -> None:
    """Per block of 100 sustained requests: TTFT ratio to stock, reused share, segment hit rate, scheduler RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = sustained_blocks(rows)
    x = [(b["first"] + b["last"]) / 2 for b in blocks]
    ratio, reused, hit, rss = ([b[k] for b in blocks] for k in ("ratio", "reused", "hit_rate", "rss_mb"))
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a1.plot(x, ratio, "o-", label="TTFT stock / auto (paired, median per block)")
    a1.set_ylabel("speed-up")
    a1.legend(loc="lower right")
    a1.grid(alpha=0.3)
    a2.plot(x, reused, "s-", label="reused share of prompt tokens")
    a2.plot(x, hit, "^-", label="segment hit rate")
    a2.set_ylim(0, 1)
    a2.set_xlabel("request")
    a2.grid(alpha=0.3)
    r2 = a2.twinx()
    r2.plot(x, rss, "k--", label="scheduler RSS (MB)")
    r2.set_ylabel("MB")
    a2.legend(loc="lower left")
    r2.legend(loc="lower right")
    fig.suptitle("automatic chunk detection under sustained Zipf traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
