"""`chunkcache bench` and `chunkcache eval`: the `chunkcache.commands` entry points (pyproject.toml) through which
the `chunkcache` CLI finds them. Loaded to list them in its --help, so the harness itself is imported only when one
runs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# --smoke: a few minutes on a 2-core CPU, end to end (CI); the defaults are the full size, run by hand
SMOKE = {"requests": 3, "docs": 2, "words": 60, "pool": 4, "rates": "0.5", "load_requests": 3, "max_new_tokens": 16,
         "clients": "1,2", "closed_requests": 2, "blocks": 1}
FULL = {"requests": 30, "docs": 6, "words": 150, "pool": 12, "rates": "0.03,0.06", "load_requests": 10,
        "max_new_tokens": 16, "clients": "1,4,8,16", "closed_requests": 32, "blocks": 2}


def selector_items(text: str) -> tuple[str, ...]:
    """--selectors: items separated by commas, where a piece with an option but no selector name
    (`spec:per_chunk=true,max_span=8`) is the previous item's next option."""
    items: list[str] = []
    for piece in text.split(","):
        if "=" in piece and ":" not in piece and items:
            items[-1] += "," + piece
        else:
            items.append(piece)
    return tuple(items)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _workload_args(ap: argparse.ArgumentParser) -> None:
    from .synthetic import TASKS

    ap.add_argument("--workload", default="shuffled", help="shuffled | musique[:PATH] | synthetic:TASK (tasks: "
                    f"{', '.join(TASKS)}); bench only: auto (automatic detection's own phases, --phase: "
                    "`chunkcache bench --workload auto --help`), rag (client styles at 1-2K tokens against stock "
                    "and ContextPilot: `chunkcache bench --workload rag --help`)")
    ap.add_argument("--requests", type=int, help="requests (records, cases) per phase")
    ap.add_argument("--docs", type=int, help="documents per prompt")
    ap.add_argument("--words", type=int, help="words per document (musique: truncation)")
    ap.add_argument("--pool", type=int, help="shuffled: documents the requests draw from")
    ap.add_argument("--seed", type=int, default=0, help="synthetic: first seed; shuffled: the draws'; musique: 0 = each record's first documents, else drawn from its passages")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a name `chunkcache model` knows or an HF "
                    "directory; its tokenizer builds the prompts (bench --base-url: the deployed servers' model)")
    ap.add_argument("--config", help="server YAML (chunkcache serve --chunkcache-config)")


def _sized(args: argparse.Namespace, preset: dict) -> dict:
    return {k: getattr(args, k) if getattr(args, k, None) is not None else v for k, v in preset.items()}


def bench(argv: list[str]) -> int:
    """A/B benchmark against stock prefix caching: TTFT, throughput, goodput, quality."""
    from .serving.ab import Arm, BenchConfig
    from .serving.servers import endpoint_args, endpoints
    from .workloads import WorkloadConfig

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload")
    pre.add_argument("--base-url")
    known = pre.parse_known_args(argv)[0]
    workload = known.workload
    if workload == "auto":  # its own phases and options: chunkbench/serving/auto_bench.py
        if known.base_url:
            print("chunkcache bench: error: --workload auto starts servers configured for its phases (--auto-chunks, "
                  "the store's budget); deployed servers (--base-url) are measured by the other workloads and modes",
                  file=sys.stderr)
            return 2
        from .serving.auto_bench import main

        return main(argv)
    if workload == "rag":  # client styles at RAG sizes, ContextPilot beside: chunkbench/serving/rag_bench.py
        from .serving.rag_bench import main

        return main(argv)
    ap = argparse.ArgumentParser(
        prog="chunkcache bench", description="Stock SGLang prefix caching vs chunkcache, same model and workload. "
        "--mode ab: sequential (TTFT, quality) and Poisson phases, one server after the other. --mode closed: "
        "throughput and TTFT at fixed concurrencies, both servers up, the sides alternating in short blocks.",
        epilog="~3K-token prompts: --mode closed --docs 8 --words 380 --pool 16; ~7K: --docs 17 --words 380 --pool 24 "
        "(the default model has an 8192-token context).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _workload_args(ap)
    ap.add_argument("--mode", choices=("ab", "closed"), default="ab", help="which comparison (see above)")
    from chunkcache.config import Config

    ap.add_argument("--selectors", default=Config().select.selector, help="chunkcache selectors (comma-separated); "
                    "the default is the server's")
    ap.add_argument("--ratios", default="0.15", help="recompute budgets rho; every selector x rho is one "
                    "chunkcache configuration, the first one runs the Poisson phases and the closed loop")
    ap.add_argument("--rates", help=f"ab: Poisson arrival rates, req/s (default {FULL['rates']}; empty: none)")
    ap.add_argument("--load-requests", type=int, help="ab: requests per arrival rate")
    ap.add_argument("--clients", help=f"closed: client counts (default {FULL['clients']})")
    ap.add_argument("--closed-requests", type=int, help=f"closed: requests per block (default "
                    f"{FULL['closed_requests']}; several times the largest client count, or the tail dominates)")
    ap.add_argument("--blocks", type=int, help=f"closed: (stock, chunkcache) block pairs per client count (default "
                    f"{FULL['blocks']})")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: a few minutes on a CPU (CI)")
    ap.add_argument("--out", help="results directory (default results/bench[-closed]-WORKLOAD-TIME)")
    ap.add_argument("--report", metavar="DIR", help="only rewrite the summaries and plots of an earlier run's results "
                    "(ab, closed or both, from their JSONL)")
    ap.add_argument("--resume", action="store_true", help="ab: continue a cut-short run in --out (same arguments): "
                    "the side / phase / configuration runs already in its requests.jsonl are kept")
    endpoint_args(ap)
    args = ap.parse_args(argv)
    deployed = endpoints(args, ap)
    if args.report:
        return _report(Path(args.report))
    size = _sized(args, SMOKE if args.smoke else FULL)
    arms = tuple(Arm(s, r) for s in args.selectors.split(",") for r in _floats(args.ratios))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = "bench" if args.mode == "ab" else "bench-closed"
    out = Path(args.out or f"results/{name}-{args.workload.replace(':', '-').replace('/', '_')}-{stamp}")
    workload = WorkloadConfig(args.workload, size["requests"], size["docs"], size["words"], size["pool"], args.seed)
    if args.mode == "closed":
        from .serving.closed_loop import ClosedConfig, run

        config = ClosedConfig(workload=workload, arm=arms[0], clients=tuple(int(n) for n in size["clients"].split(",")),
                              requests=size["closed_requests"], blocks=size["blocks"],
                              max_new_tokens=size["max_new_tokens"], model=args.model, server_config=args.config,
                              out=out, endpoints=deployed)
    else:
        from .serving.ab import run

        config = BenchConfig(workload=workload, arms=arms, rates=_floats(size["rates"]),
                             load_requests=size["load_requests"], max_new_tokens=size["max_new_tokens"],
                             model=args.model, server_config=args.config, out=out, resume=args.resume,
                             endpoints=deployed)
    print(f"results in {run(config)}")
    return 0


def _report(out: Path) -> int:
    """Re-render whichever runs the directory holds: an ab run, a closed-loop run or both."""
    from .serving import ab, closed_loop, closed_report

    renders = {"requests.jsonl": lambda: ab.summarize(*ab.load_run(out)),
               closed_loop.RECORDS: lambda: closed_report.write(*closed_loop.load_run(out))}
    summaries = [render() for name, render in renders.items() if (out / name).is_file()]
    if not summaries:
        raise FileNotFoundError(f"{out} holds none of {', '.join(renders)}: not a bench results directory")
    print("\n".join(summaries))
    return 0


def evaluate(argv: list[str]) -> int:
    """Quality sweep of selectors x rho, plus the SpecCache analyses."""
    from .quality.quality import RATIOS, EvalConfig, markdown, run
    from .workloads import WorkloadConfig

    ap = argparse.ArgumentParser(prog="chunkcache eval", description="Quality of selectors x rho against gold "
                                 "answers and full recompute (reference blender or a live server): accuracy, "
                                 "agreement, teacher-forced agreement and first-token KL, each with a 95 % "
                                 "bootstrap interval over cases.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _workload_args(ap)
    ap.set_defaults(workload="synthetic:bridge")
    ap.add_argument("--selectors", default="none,epic,cacheblend,prophet,spec,clip,mix", help="comma-separated; an "
                    "item may carry options: mix:mass=0.5,layer=2 (reference path)")
    ap.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS))
    ap.add_argument("--drafts", default="self", help="drafts for spec/clip and the overlap analysis: self, "
                    "self:LAYERS, a model name, an HF directory or a .gguf file (name:LAYERS)")
    ap.add_argument("--path", choices=("reference", "server"), default="reference")
    ap.add_argument("--analyses", action="store_true", help="add the layer-wise KV deviation and top-20 %% "
                    "Jaccard overlap analyses (reference model)")
    ap.add_argument("--server-url", help="server path: a running chunkcache server (same --model) instead of "
                    "starting one")
    ap.add_argument("--top-logprobs", type=int, default=EvalConfig.top_logprobs, help="server path: the "
                    "first-token KL is computed over full recompute's top-k logprobs plus one bucket for the rest")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--out", help="JSON file of every row; rows also stream to OUT.jsonl as they finish, and the "
                    "table is written to OUT.md")
    ap.add_argument("--resume", action="store_true", help="continue a cut-short run: keep the rows OUT.jsonl holds "
                    "(same settings; more cases, selectors or rho may be added) and run only the others")
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = ap.parse_args(argv)
    # 100 cases: at 8 one answer moved a cell by 12.5 points, noise rather than a curve
    size = _sized(args, {**(SMOKE if args.smoke else {"requests": 100, "docs": 3, "words": 250, "pool": 12}),
                         "max_new_tokens": 16 if args.smoke else 24})
    config = EvalConfig(
        workload=WorkloadConfig(args.workload, size["requests"], size["docs"], size["words"], size["pool"], args.seed),
        selectors=selector_items(args.selectors), ratios=_floats(args.ratios), drafts=tuple(args.drafts.split(",")),
        path=args.path, analyses=args.analyses, max_new_tokens=size["max_new_tokens"], model=args.model,
        server_config=args.config, server_url=args.server_url, top_logprobs=args.top_logprobs,
        out=Path(args.out) if args.out else None, resume=args.resume)
    result = run(config)
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=str)
        print()
    else:
        print(markdown(result))
    return 0


def calibrate(argv: list[str]) -> int:
    """Fit the fidelity estimate (max_kl) on your own model's cases and install it for the server."""
    try:
        from .quality.calibration import main
    except ImportError as e:  # the fit's statistics are the harness's extra
        print(f"chunkcache calibrate needs the harness's extra (pip install 'chunkcache[bench]'): {e}",
              file=sys.stderr)
        return 2
    return main(argv)
