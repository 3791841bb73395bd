"""SpeCache decoding on the reference path: memory and quality against full-precision decoding.

For each synthetic needle case: one HF prefill, full-precision greedy decoding from it, then SpeCache decoding from
the same prefill for every bit width (and top-k) asked. Prints, per configuration:
- memory: device-pool bytes per token against 16-bit KV (the low-bit copy alone, and everything the pool holds at
  these contexts: residual and prefetch buffers included), bytes attention reads per decode step, host->device
  bytes prefetched per step;
- prediction: top-k hit rate (share of the exact top-k of x_t's attention over full-precision keys that the
  speculative token had prefetched; "stale": had x_{t-1}'s attention chosen instead), speculative-token match rate;
- quality: greedy outputs identical to full precision, tokens before the first divergence, answers agreeing with
  full precision's (the numbers they name), needles retrieved (all answers present).

Byte counts assume a 16-bit pool and host copy whatever dtype the model runs in (float32 here, for exact
comparison); on CPU both memories are RAM, so bytes are counted, not timed.

    .venv/bin/python -m chunkbench.studies.specache_study                               # 2 x 10 needle cases, b = 1, 2
    .venv/bin/python -m chunkbench.studies.specache_study --topk 64,0                   # with the low-bit-only ablation
    .venv/bin/python -m chunkbench.studies.specache_study --n 1 --chunks 2 --max-new-tokens 6 --threads 1  # toy size

`--server` runs the same cases through SGLang's engine instead (decode.specache, sglang_patch/decode/specache.py), one
engine at a time: stock SGLang, then SpeCache for every configuration, greedy, one request at a time. It prints the
pool's bytes per token as the server allocates them (the pool's own dtype, bfloat16 by default), bytes attention
read per decode step against stock's, host->device bytes per step, the speculative-token match rate, agreement
with stock's greedy output and needles retrieved, and seconds per request (the prefill is the same on both sides;
CPU seconds say nothing about PCIe prefetch):

    .venv/bin/python -m chunkbench.studies.specache_study --server --n 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from chunkbench import synthetic
from chunkcache.config import SpeCacheConfig
from chunkcache.models import resolve_model
from chunkcache.specache.decode import SpeCacheDecoder, greedy, prefill
from chunkcache.specache.layer_cache import full_bytes, lowbit_bytes


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.studies.specache_study", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=10, help="cases per task")
    ap.add_argument("--tasks", default="single,multikey", help="synthetic tasks (needle retrieval)")
    ap.add_argument("--chunks", type=int, default=6, help="passages per prompt, 256-512 tokens each")
    ap.add_argument("--bits", default="1,2")
    ap.add_argument("--topk", default="64", help="prefetched pairs per layer per KV head; several give rows each")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--residual", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=24, help="needle answers need ~20")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seed", type=int, default=0, help="first case seed")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="results/specache.json")
    ap.add_argument("--server", action="store_true", help="decode in SGLang's engine against stock SGLang")
    ap.add_argument("--dtype", default="bfloat16", help="--server: the engines' dtype (and the KV pool's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    configs = {f"b={b} k={k}": SpeCacheConfig(bits=int(b), group=args.group, residual=args.residual, topk=int(k))
               for b in args.bits.split(",") for k in args.topk.split(",")}
    if args.server:
        return serve(args, path, tok, configs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    decoders = {label: SpeCacheDecoder(model, cfg) for label, cfg in configs.items()}
    cases = [(task, seed) for task in args.tasks.split(",") for seed in range(args.seed, args.seed + args.n)]
    rows: dict[str, list[dict]] = {"full": [], **{label: [] for label in configs}}
    t0 = time.perf_counter()
    for task, seed in tqdm(cases, desc="cases", unit="case"):
        case = synthetic.generate(task, seed, n_chunks=args.chunks, count=count)
        prefix, chunks, query = synthetic.prompt(case, tok)
        pre = prefill(model, prefix + sum(chunks, []) + query)
        full = greedy(model, pre, args.max_new_tokens)
        text = tok.decode(full.tokens, skip_special_tokens=True)
        rows["full"].append({"task": task, "seed": seed, "prompt": len(pre.tokens), "text": text,
                             "correct": case.correct(text)})
        for label, decoder in decoders.items():
            run = decoder.generate(pre, args.max_new_tokens, probe=True)
            out = tok.decode(run.tokens, skip_special_tokens=True)
            same = next((i for i, (a, b) in enumerate(zip(run.tokens, full.tokens)) if a != b),
                        min(len(run.tokens), len(full.tokens)))
            matched, guessed = run.speculative_match()
            rows[label].append({
                "task": task, "seed": seed, "text": out, "correct": case.correct(out),
                "agree": case.extract(out) == case.extract(text), "identical": run.tokens == full.tokens,
                "prefix_share": same / len(full.tokens), "spec_match": [matched, guessed],
                "hits": run.hits, "stale_hits": run.stale_hits, "read_bytes": run.read_bytes,
                "fetch_bytes": run.fetch_bytes, "device_bytes": run.device_bytes, "full_bytes": run.full_bytes,
            })
        out_path = Path(args.out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))  # a cut-short run keeps its cases
    report(rows, configs, model.config, args, time.perf_counter() - t0)
    print(f"per-case results: {args.out}")


def report(rows: dict[str, list[dict]], configs: dict[str, SpeCacheConfig], config, args, seconds: float) -> None:
    L, H = config.num_hidden_layers, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fb = full_bytes(H, D) * L
    full = rows["full"]
    n = len(full)
    prompt = statistics.mean(r["prompt"] for r in full)
    print(f"\n{args.model}: {n} cases ({args.tasks}), {prompt:.0f} prompt tokens on average, up to "
          f"{args.max_new_tokens} new tokens, g={args.group}, R={args.residual}; {seconds:.0f} s")
    print(f"full precision: needles retrieved {sum(r['correct'] for r in full)}/{n}; 16-bit KV "
          f"{fb} B/token ({fb * prompt / 2**20:.1f} MiB at the mean prompt)\n")
    head = (f"{'config':<12}{'low-bit/16b':>12}{'pool/16b':>10}{'read/step':>11}{'vs 16b':>8}{'fetch/step':>12}"
            f"{'hit':>7}{'stale':>7}{'spec':>7}{'identical':>11}{'prefix':>8}{'agree':>8}{'needles':>9}")
    print(head)
    print("-" * len(head))
    for label, cfg in configs.items():
        rs = rows[label]
        lowbit = lowbit_bytes(cfg, H, D, cfg.group) / cfg.group * L / fb
        pool = statistics.mean(r["device_bytes"] / r["full_bytes"] for r in rs)
        read = [b for r in rs for b in r["read_bytes"]]
        read16 = [(f["prompt"] + i) * fb for r, f in zip(rs, full) for i in range(len(r["read_bytes"]))]
        fetch = [b for r in rs for b in r["fetch_bytes"]]
        hits = [h for r in rs for h in r["hits"]]
        stale = [h for r in rs for h in r["stale_hits"]]
        spec = sum(r["spec_match"][0] for r in rs) / max(1, sum(r["spec_match"][1] for r in rs))
        print(f"{label:<12}{lowbit:>12.3f}{pool:>10.3f}{_mib(read):>11}{sum(read) / max(1, sum(read16)):>8.3f}"
              f"{_mib(fetch):>12}{_share(hits):>7}{_share(stale):>7}{spec:>7.3f}"
              f"{sum(r['identical'] for r in rs):>8}/{n:<2}{_mean([r['prefix_share'] for r in rs]):>8.3f}"
              f"{sum(r['agree'] for r in rs):>5}/{n:<2}{sum(r['correct'] for r in rs):>6}/{n:<2}")
    print("\nlow-bit/16b: codes + float16 params per token; pool/16b: the whole device pool at the end of decoding "
          "(+ residual, + k-pair buffers) over 16-bit KV of the same tokens; read/step: MiB attention reads from the "
          "pool per decode step (vs 16b: over reading 16-bit KV); fetch/step: MiB host->device; hit/stale: share "
          "of the exact top-k prefetched (speculative / previous token's choice); spec: speculative token = next "
          "token; identical: greedy output equal to full precision; prefix: share of tokens before the first "
          "divergence; agree: same answer as full precision; needles: answer correct")


def serve(args, path, tok, configs: dict[str, SpeCacheConfig]) -> None:
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    cases = [synthetic.generate(task, seed, n_chunks=args.chunks, count=count)
             for task in args.tasks.split(",") for seed in range(args.seed, args.seed + args.n)]
    prompts = []
    for case in cases:
        prefix, chunks, query = synthetic.prompt(case, tok)
        prompts.append(prefix + sum(chunks, []) + query)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    results: dict[str, dict] = {}
    for label, cfg in [("stock", None), *configs.items()]:
        with _engine(path, cfg, args.dtype) as engine:
            outs = []
            for ids in tqdm(prompts, desc=label, unit="case"):  # one at a time: batch 1 decoding
                t = time.perf_counter()
                out = engine.generate(input_ids=ids, sampling_params=params)
                outs.append({"ids": out["output_ids"], "text": tok.decode(out["output_ids"], skip_special_tokens=True),
                             "seconds": time.perf_counter() - t})
            info = engine.get_server_info()["internal_states"][0].get("specache") if cfg else None
        results[label] = {"outs": outs, "specache": info}
        out_path = Path(args.out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    stock = results["stock"]["outs"]
    n = len(cases)
    print(f"\n{args.model} in SGLang ({args.dtype}): {n} cases ({args.tasks}), "
          f"{statistics.mean(map(len, prompts)):.0f} prompt tokens on average, {args.max_new_tokens} new tokens, "
          f"g={args.group}, R={args.residual}; stock: needles {sum(c.correct(o['text']) for c, o in zip(cases, stock))}"
          f"/{n}, {statistics.mean(o['seconds'] for o in stock):.2f} s/request")
    head = (f"{'config':<12}{'B/token':>9}{'vs stock':>10}{'read vs stock':>15}{'fetch/step':>12}{'spec':>7}"
            f"{'identical':>11}{'agree':>8}{'needles':>9}{'s/request':>11}")
    print(head)
    print("-" * len(head))
    for label in configs:
        info, outs = results[label]["specache"], results[label]["outs"]
        steps = max(1, info["tokens"])
        print(f"{label:<12}{info['lowbit_bytes_per_token']:>9}{info['lowbit_ratio']:>10.3f}"
              f"{info['read_bytes'] / max(1, info['stock_read_bytes']):>15.3f}"
              f"{info['fetch_bytes'] / steps / 2**20:>11.2f}M{info['spec_matches'] / max(1, info['spec_guesses']):>7.3f}"
              f"{sum(o['ids'] == s['ids'] for o, s in zip(outs, stock)):>8}/{n:<2}"
              f"{sum(c.extract(o['text']) == c.extract(s['text']) for c, o, s in zip(cases, outs, stock)):>5}/{n:<2}"
              f"{sum(c.correct(o['text']) for c, o in zip(cases, outs)):>6}/{n:<2}"
              f"{statistics.mean(o['seconds'] for o in outs):>11.2f}")
    print("\nB/token: low-bit codes + float16 params per token, all layers (stock: the pool's dtype); read vs stock: "
          "bytes attention read from the pool over what stock's decode reads; fetch/step: full-precision pairs "
          "moved into the prefetch set per request-step; spec: speculative token = next input; identical: greedy "
          "output equal to stock's; agree: same answer; needles: answer correct")


@contextmanager
def _engine(path, cfg: SpeCacheConfig | None, dtype: str):
    """An in-process SGLang engine with this host's `chunkcache serve` settings, SpeCache on when `cfg` is given."""
    import tempfile

    import sglang as sgl

    from chunkcache.config import Config
    from sglang_patch.serve.launcher import prepare_environment, server_settings
    from sglang_patch.serve.shutdown import shutdown_engine

    with tempfile.TemporaryDirectory() as tmp:
        raw = {} if cfg is None else {"decode": {"specache": {**dataclasses.asdict(cfg), "enabled": True}}}
        yaml_path = Path(tmp) / "chunkcache.yaml"
        yaml_path.write_text(yaml.safe_dump(raw))
        prepare_environment(yaml_path)
        config = Config.load(yaml_path)
        settings = {k: v for k, v in server_settings(path, config, chunk_reuse=False).items() if k not in ("host", "port")}
        engine = sgl.Engine(**{**settings, "dtype": dtype, "max_total_tokens": 16384}, log_level="error")
        try:
            yield engine
        finally:
            shutdown_engine(engine)  # sparing this process's resource tracker (sglang_patch.serve.shutdown)


def _mib(values: list[int]) -> str:
    return f"{_mean(values) / 2**20:.2f}" if values else "-"


def _share(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f}" if values else "-"  # topk 0 chooses nothing


def _mean(values) -> float:
    return statistics.mean(values) if values else float("nan")


if __name__ == "__main__":
    main()
