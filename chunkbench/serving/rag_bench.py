"""Chunk reuse at the sizes RAG sends, against stock SGLang: `chunkcache bench --workload rag`.

Prompts of 1-2K tokens: 4-5 passages of 150-250 words drawn with Zipf popularity from a pool (in-repository prose
from chunkbench.synthetic, one fact per passage), a question about one of them. Two servers are up, stock
(`--no-chunk-reuse`) and chunkcache (`--auto-chunks`); requests go one at a time, the arms of a request in an order
that rotates, so machine noise hits every arm alike. Each arm is a client style, in its own namespace or
`cache_salt` (no arm's KV helps another's):

  stock         the passages in `<document>` tags in a system message, the question as the user message, streamed
                chat to the stock server (its radix cache shares the system prompt, and any identical lead)
  auto          the same request to the chunkcache server, nothing marked: automatic detection
  ingest        the same request, after every passage of the pool was sent to `/chunkcache/ingest` (its own layout)
  alone         the same request, after every passage was sent as a request of its own (one document, one token)
  layout        `chunkcache.prompt.build`'s prompt (system, `Documents:` and the passages in the user turn) as plain
                ids to the stock server: the oracle of the two arms below, whose prompt it is
  hinted        that prompt to chunkcache with `kv_hints` marking each passage (/generate, streamed)
  documents     the chat `chunkcache.documents` API (the server builds that prompt)
  contextpilot  ContextPilot's `optimize(docs, query)` (PyPI `contextpilot`, MLSys 2026: it reorders the passages so
                the plain prefix cache shares them, exact KV) in front of the stock server; needs a venv of its own
                (`--contextpilot-python`), else the arm is left out

With `--base-url URL --stock-url URL` the arms go to deployed servers instead (the stock side's arms to --stock-url,
the others to --base-url, which needs `--auto-chunks` for the auto arm) and the bench starts none; their answers
then carry radix-cached tokens only where the servers run with `--enable-cache-report`, and no floor is printed
(its rates would be timed on this host). The summary names each arm's endpoint.

Before the measured requests every passage of the pool passes through every arm once (warm: the steady state of
popular passages; ingest and alone warm their own way). TTFT is the first streamed token. Printed per size: each
arm's median TTFT and its speed-up over its oracle (stock, or layout for hinted and documents), the share of the
prompt reused, the blend's stages, its fixed costs (TTFT less the recompute pass, against the oracle's TTFT), its
floor (chunkbench.serving.floor at the oracle's rates), and how many greedy answers equal the oracle's.

    chunkcache bench --workload rag --sizes 1200:4,2000:5 --requests 12 --contextpilot-python ../cpvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

import requests

from .auto_bench import zipf_sample
from .http_client import chat, drain, fell_back, generate
from .ab_report import endpoint_lines
from .servers import endpoint_args, endpoints, side_server

ARMS = ("stock", "auto", "ingest", "alone", "layout", "hinted", "documents", "contextpilot")
ORACLE = {"auto": "stock", "ingest": "stock", "alone": "stock", "contextpilot": "stock", "hinted": "layout",
          "documents": "layout"}
STOCK_SIDE = ("stock", "layout", "contextpilot")  # the arms sent to the stock server; the others to chunkcache's
SALTS = {"auto": "rag-auto", "ingest": "rag-ingest", "alone": "rag-alone", "contextpilot": "rag-contextpilot"}
SYSTEM = "Answer the question using the documents."
PROMPT_OVERHEAD = 70  # tokens of a prompt besides its passages: template, system line, tags, question


class ContextPilot:
    """ContextPilot's `optimize` in a process of its own venv (chunkbench/serving/contextpilot_worker.py)."""

    def __init__(self, python: str, log: Path):
        worker = Path(__file__).with_name("contextpilot_worker.py")
        with log.open("w") as err:  # its progress lines
            self.proc = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True)

    def optimize(self, docs: list[str], query: str) -> tuple[list[dict], float]:
        self.proc.stdin.write(json.dumps({"docs": docs, "query": query}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return answer["messages"], answer["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def pool_of(tok, size: int, passages: int, pool: int, seed: int) -> list[tuple[str, str]]:
    """(passage, the question its fact answers) for the size's pool: prose of ~(size - overhead) / passages tokens."""
    from chunkbench.synthetic import filler_passage

    rng = random.Random(f"{seed}-{size}")
    count = lambda s: len(tok.encode(s, add_special_tokens=False))  # noqa: E731
    tokens = (size - PROMPT_OVERHEAD) // passages
    out = []
    for i in range(pool):
        record, code = f"R{size}-{i:02d}", rng.randint(1000, 9999)
        text = filler_passage(rng, tokens, [f"The access code of record {record} is {code}."], count)
        out.append((text, f"What is the access code of record {record}?"))
    return out


def system_messages(docs: list[str], question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM + "\n\n" + "\n".join(f"<document>{d}</document>" for d in docs)},
            {"role": "user", "content": question}]


class Arms:
    """Sends one request of an arm; `warm` passes a pool through it first."""

    def __init__(self, tok, stock_url: str, cc_url: str, max_new_tokens: int, pilot: ContextPilot | None):
        self.tok, self.stock, self.cc, self.n, self.pilot = tok, stock_url, cc_url, max_new_tokens, pilot

    def url(self, arm: str) -> str:
        return self.stock if arm in STOCK_SIDE else self.cc

    def send(self, arm: str, docs: list[str], question: str, n: int | None = None):
        """(Outcome, extra fields of the row)."""
        from chunkcache import prompt

        n, url = n or self.n, self.url(arm)
        if arm in ("stock", "auto", "ingest", "alone"):
            body = {"messages": system_messages(docs, question), "max_tokens": n}
            return chat(url, {**body, **({"cache_salt": SALTS[arm]} if arm in SALTS else {})}), {}
        if arm == "contextpilot":
            messages, seconds = self.pilot.optimize(docs, question)
            return chat(url, {"messages": messages, "max_tokens": n, "cache_salt": SALTS[arm]}), \
                {"optimize_s": seconds}
        if arm == "documents":
            return chat(url, {"messages": [{"role": "system", "content": prompt.DEFAULT_SYSTEM},
                                           {"role": "user", "content": question}], "max_tokens": n,
                              "chunkcache": {"documents": docs, "namespace": "rag-documents"}}), {}
        built = prompt.build(self.tok, docs, question)
        if arm == "layout":
            return generate(url, built.input_ids, n), {}
        return generate(url, built.input_ids, n, built.kv_hints(namespace="rag-hinted")), {}

    def warm(self, arm: str, pool: list[tuple[str, str]], per_request: int) -> float:
        """Every passage of the pool through the arm once; returns the seconds it took."""
        t = time.perf_counter()
        docs = [d for d, _ in pool]
        if arm == "ingest":
            for start in range(0, len(docs), 8):
                r = requests.post(self.cc + "/chunkcache/ingest", json={"documents": docs[start:start + 8],
                                                                        "cache_salt": SALTS[arm]}, timeout=1800)
                r.raise_for_status()
        elif arm == "alone":
            for d in docs:
                self.send(arm, [d], "Summarize the document.", n=1)
        else:
            for start in range(0, len(docs), per_request):
                group = (docs[start:] + docs)[:per_request]
                self.send(arm, group, pool[start][1], n=1)
        return time.perf_counter() - t


def run(args, tok, arms: Arms, chosen: list[str], out) -> None:
    for size, per_request in args.sizes:
        pool = pool_of(tok, size, per_request, args.pool, args.seed)
        for arm in chosen:
            seconds = arms.warm(arm, pool, per_request)
            drain(arms.cc)
            print(f"size {size}: {arm} warmed with {len(pool)} passages in {seconds:.1f} s", flush=True)
        rng = random.Random(f"{args.seed}-{size}-requests")
        weights = [1 / (i + 1) ** args.zipf for i in range(len(pool))]
        for i in range(args.requests):
            picked = zipf_sample(rng, weights, per_request)
            rng.shuffle(picked)
            docs, question = [pool[j][0] for j in picked], pool[picked[rng.randrange(per_request)]][1]
            order = chosen[i % len(chosen):] + chosen[: i % len(chosen)]
            for arm in order:
                # the chunkcache server measures deferred deviations and learns when idle: never while a request of
                # either server is timed (two schedulers on the cores slow each other several times over)
                drain(arms.cc)
                o, extra = arms.send(arm, docs, question)
                row = {"size": size, "i": i, "arm": arm, "endpoint": arms.url(arm), "prompt_tokens": o.prompt_tokens,
                       "ttft_s": o.ttft_s, "text": o.text, "cached_tokens": o.cached_tokens, "report": o.report,
                       "fallback": fell_back(o.report), **extra}
                out.write(json.dumps(row) + "\n")
                out.flush()
            print(f"size {size}: request {i + 1}/{args.requests}", flush=True)


def summarize(rows: list[dict], floors: dict | None = None) -> str:
    """Per size, one line per arm (see the module's docstring)."""
    med = statistics.median
    lines = []
    for size in sorted({r["size"] for r in rows}):
        at = [r for r in rows if r["size"] == size]
        by = {arm: {r["i"]: r for r in at if r["arm"] == arm} for arm in ARMS}
        lines.append(f"\n~{size} tokens: {len({r['i'] for r in at})} requests per arm")
        lines.append(f"{'arm':<13}{'tokens':>7}{'TTFT s':>8}{'speed-up':>9}{'reused':>8}{'cached':>8}{'copy s':>7}{'feat s':>7}"
                     f"{'sel s':>7}{'other s':>8}{'recomp s':>9}{'fixed/oracle':>13}{'floor/TTFT':>11}{'same':>7}"
                     f"{'full':>6}")
        for arm in ARMS:
            mine = by[arm]
            if not mine:
                continue
            oracle = by.get(ORACLE.get(arm, ""), {})
            ttft = med(r["ttft_s"] for r in mine.values())
            reps = [r["report"] for r in mine.values() if r["report"] and "stages_s" in r["report"]]
            stage = lambda *k: med(sum(x["stages_s"].get(s, 0.0) for s in k) for x in reps) if reps else None  # noqa
            reused = med(r["report"].get("reused_tokens", 0) / r["prompt_tokens"] if r["report"] else 0.0
                         for r in mine.values())
            cached = med(r["cached_tokens"] / r["prompt_tokens"] for r in mine.values())
            oracle_s = med(r["ttft_s"] for r in oracle.values()) if oracle else None
            blended = [r for r in mine.values() if r["report"] and "stages_s" in r["report"]]
            fixed = (f"{med(r['ttft_s'] - r['report']['stages_s']['recompute'] for r in blended) / oracle_s:.0%}"
                     if blended and oracle_s else "")
            same = (f"{sum(mine[i]['text'] == oracle[i]['text'] for i in mine if i in oracle)}/{len(mine)}"
                    if oracle else "")
            full = sum(r["fallback"] for r in mine.values())
            speed = f"{oracle_s / ttft:.2f}x" if oracle_s else "1.00x"
            fl = (floors or {}).get((size, arm))
            cells = [stage("copy"), stage("features"), stage("select"),
                     stage("detect", "plan", "lookup", "fill", "learn"), stage("recompute")]
            lines.append(f"{arm:<13}{med(r['prompt_tokens'] for r in mine.values()):>7.0f}{ttft:>8.3f}{speed:>9}"
                         f"{reused:>8.0%}{cached:>8.0%}" + "".join(f"{c:>7.3f}" if c is not None else f"{'':>7}" for c in cells[:3])
                         + (f"{cells[3]:>8.3f}{cells[4]:>9.3f}" if cells[3] is not None else f"{'':>17}")
                         + f"{fixed:>13}{(f'{fl / ttft:.2f}' if fl else ''):>11}{same:>7}{full:>6}")
    return "\n".join(lines + endpoint_lines(rows))


def floors_of(rows: list[dict], model_dir: str, dtype: str) -> dict:
    """(size, arm) -> the median blended request's floor at its oracle's median TTFT (chunkbench.serving.floor)."""
    from .floor import Shape, causal_attention_s, copy_bandwidth, floor

    shape, med, out = Shape.of_model(model_dir, dtype), statistics.median, {}
    for size in sorted({r["size"] for r in rows}):
        at = [r for r in rows if r["size"] == size]
        n = int(med(r["prompt_tokens"] for r in at))
        attention = causal_attention_s(shape, n)
        for arm, oracle in ORACLE.items():
            reps = [r["report"] for r in at if r["arm"] == arm and r["report"] and "stages_s" in r["report"]]
            stock = [r["ttft_s"] for r in at if r["arm"] == oracle]
            if not reps or not stock:
                continue
            bandwidth = copy_bandwidth(int(med(x["reused_tokens"] for x in reps)) * shape.kv_bytes_per_token)
            out[size, arm] = med(floor(shape, n, med(stock), x["recomputed_tokens"], x["attended_pairs"],
                                       x["reused_tokens"], attention, bandwidth).total_s for x in reps)
    return out


def report(out_dir: Path, model_dir: str | None = None, dtype: str = "bfloat16") -> str:
    rows = [json.loads(line) for line in (out_dir / "rows.jsonl").open()]
    text = summarize(rows, floors_of(rows, model_dir, dtype) if model_dir else None)
    (out_dir / "summary.txt").write_text(text + "\n")
    return text


def _sizes(text: str) -> list[tuple[int, int]]:
    """--sizes: TOKENS:PASSAGES items, comma-separated."""
    try:
        return [(int(t), int(p)) for t, p in (item.split(":") for item in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes wants TOKENS:PASSAGES items, comma-separated; got {text!r}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="chunkcache bench --workload rag", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="rag")
    ap.add_argument("--sizes", type=_sizes, default=_sizes("1000:4,1500:4,2000:5"),
                    help="prompt sizes and passages per prompt, TOKENS:PASSAGES comma-separated (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=12, help="measured requests per size (default: %(default)s)")
    ap.add_argument("--pool", type=int, default=16, help="passages per size the requests draw from (default: "
                    "%(default)s)")
    ap.add_argument("--zipf", type=float, default=1.0, help="popularity exponent over the pool (default: %(default)s)")
    ap.add_argument("--arms", default=",".join(ARMS), help="client styles to measure, comma-separated (default: all; "
                    "see above)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="greedy answer length, for the agreement with the "
                    "oracle (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a name `chunkcache model` knows or an HF "
                    "directory: the servers' model, whose tokenizer builds the prompts (default: %(default)s)")
    ap.add_argument("--config", help="the chunkcache server's YAML (chunkcache serve --chunkcache-config)")
    ap.add_argument("--contextpilot-python", metavar="PYTHON", help="the Python of a venv with `pip install "
                    "contextpilot==0.5.0` (its pins clash with ours); without it the contextpilot arm is left out")
    ap.add_argument("--out", help="results directory (default results/rag-TIME)")
    ap.add_argument("--report", metavar="DIR", help="only summarize an earlier run's rows.jsonl")
    endpoint_args(ap)
    args = ap.parse_args(argv)
    deployed = endpoints(args, ap) or {}
    from chunkcache.models import resolve_model

    from chunkcache.config import Config
    from sglang_patch.serve.launcher import server_settings

    model_dir = str(resolve_model(args.model))
    dtype = server_settings(model_dir, Config.load(args.config)).get("dtype", "bfloat16")
    if args.report:
        print(report(Path(args.report), model_dir, dtype))
        return 0
    from transformers import AutoTokenizer

    chosen = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(chosen) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    if "contextpilot" in chosen and not args.contextpilot_python:
        print("contextpilot arm left out: pass --contextpilot-python (a venv with contextpilot installed)")
        chosen.remove("contextpilot")
    for arm in chosen:  # an arm needs its oracle
        if ORACLE.get(arm) and ORACLE[arm] not in chosen:
            chosen.insert(0, ORACLE[arm])
    out_dir = Path(args.out or f"results/rag-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pilot = ContextPilot(args.contextpilot_python, out_dir / "contextpilot.log") if "contextpilot" in chosen else None
    try:
        # --enable-cache-report: chat answers carry the radix tree's cached tokens (ContextPilot's gain)
        with side_server(out_dir / "stock.log", url=deployed.get("stock"), chunk_reuse=False, model=args.model,
                         extra=("--enable-cache-report",)) as stock, \
                side_server(out_dir / "chunkcache.log", url=deployed.get("chunkcache"), chunk_reuse=True,
                            model=args.model, config=args.config, auto_chunks=True,
                            extra=("--enable-cache-report",)) as cc:
            with (out_dir / "rows.jsonl").open("w") as out:
                run(args, tok, Arms(tok, stock.url, cc.url, args.max_new_tokens, pilot), chosen, out)
    finally:
        if pilot:
            pilot.close()
    print(report(out_dir, None if deployed else model_dir, dtype))
    print(f"\nresults in {out_dir}")
    return 0
