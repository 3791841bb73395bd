"""TTFT of chunk reuse vs stock SGLang prefix caching on the shuffled-chunk RAG workload, measured in one run.

Workload: a fixed pool of documents (~380 words each); every request takes 8 of them in a fresh random order plus a
question. Stock requests (no hints) use SGLang's radix prefix cache; chunkcache requests carry the chunk hints. Both
go to one engine started with the chunkcache backend (the stock path is SGLang's own code, untouched), alternating,
so machine noise hits both sides alike. TTFT = wall time of a 1-token generation.

    .venv/bin/python -m chunkbench.serving.ttft_shuffled --requests 5 --selectors none,epic,prophet,spec
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from chunkcache.blend.request import STAGES

FILL = ("detect", "plan", "lookup", "fill", "learn")  # the stages before the copy: the request's fill column
WORDS = ("the river city north market council bridge winter harvest museum library station engineer doctor "
         "garden history mountain festival report village").split()


def make_docs(tok, n_docs: int, words: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [tok.encode(f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(words))
                       + f" The archive number of document {i} is {10000 + 37 * i}.\n", add_special_tokens=False)
            for i in range(n_docs)]


def hints(spans, selector, ratio, namespace=None):
    return {"protocol_version": "1", "message_id": "bench", "actions": [{
        "action_id": "c", "action_type": "chunkcache.chunks", "action_version": "1",
        # one namespace per selector: otherwise a selector's request would be an exact radix hit on the previous one's
        "payload": {"token_spans": spans, "selector": selector, "ratio": ratio,
                    "namespace": namespace or selector}}]}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.serving.ttft_shuffled", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5, help="measured requests per side")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--docs", type=int, default=12, help="document pool the requests draw from")
    ap.add_argument("--words", type=int, default=380)
    ap.add_argument("--ratio", default="0.15", help="rho, or a comma-separated list: each selector at each rho is a side "
                    "(SELECTOR@RHO), in its own namespace")
    ap.add_argument("--selectors", default="none,epic,prophet")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model name (`chunkcache model`) or HF directory")
    ap.add_argument("--dtype", help="model dtype on both sides (default: the server's, see chunkcache.config)")
    ap.add_argument("--profile", metavar="FILE", help="after the measured requests, run --requests more of the first "
                    "selector's with py-spy sampling the scheduler into FILE (collapsed stacks) and print the costliest "
                    "functions")
    ap.add_argument("--first-reuse", type=int, default=0, metavar="N", help="N more requests of the first selector, "
                    "each a chunk's first reuse away from home: in a fresh namespace, right after the request that "
                    "computed its chunks (not counted), against a later reuse of the same chunks once the server has "
                    "measured their deviations")
    ap.add_argument("--config", help="server YAML, a path or a packaged name (chunkcache/configs/default.yaml's "
                    "keys), e.g. selector options (select.options.spec.per_chunk)")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (SGLang's --tp-size; on a CPU "
                    "each rank takes an equal share of the cores)")
    ap.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (SGLang's; needed on a CPU with "
                    "more ranks than NUMA nodes, where SGLang cannot size it from memory)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from chunkbench.serving.http_client import wait_measured
    from chunkbench.serving.floor import Shape, causal_attention_s
    from chunkcache.config import Config
    from chunkcache.models import resolve_model
    from sglang_patch.serve.launcher import prepare_environment, server_settings
    from sglang_patch.serve.shutdown import shutdown_engine

    prepare_environment(args.config)
    import sglang as sgl
    from tqdm import tqdm

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    settings = server_settings(path, Config.load(args.config))
    del settings["host"], settings["port"]
    if args.dtype:
        settings["dtype"] = args.dtype
    settings["tp_size"] = args.tp_size
    if args.max_total_tokens:
        settings["max_total_tokens"] = args.max_total_tokens
    docs = make_docs(tok, args.docs, args.words, args.seed)
    prefix = tok.encode("<|im_start|>system\nAnswer using the documents.<|im_end|>\n<|im_start|>user\n",
                        add_special_tokens=False)
    rng = random.Random(args.seed)
    ratios = [float(r) for r in args.ratio.split(",")]
    # side label -> (selector, rho)
    sides = {(name if len(ratios) == 1 else f"{name}@{ratio:g}"): (name, ratio)
             for name in args.selectors.split(",") for ratio in ratios}
    selectors = list(sides)

    def request(order):
        ids, spans = list(prefix), []
        for i in order:
            spans.append([len(ids), len(ids) + len(docs[i])])
            ids += docs[i]
        ids += tok.encode(f"What is the archive number of document {order[0]}?<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)
        return ids, spans

    shape = Shape.of_model(path, settings.get("dtype", "bfloat16"))
    # stock's attention, timed before the server starts (nothing else runs then), at the prompts' length
    attention = causal_attention_s(shape, len(request(list(range(args.chunks)))[0]))
    engine = sgl.Engine(**settings, log_level="error")

    def timed(ids, kv_hints=None):
        t = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0}, kv_hints=kv_hints)
        return time.perf_counter() - t, out["meta_info"].get("chunkcache")

    # warm-up: every document enters the chunk store once per selector (chunk keys include the namespace; misses
    # are computed standalone and stored), and each selector's draft/auxiliary model is loaded; then the same orders
    # rotated by one, so that every document has also been blended away from the place it was computed (where what
    # a selector keeps per chunk, e.g. mix's stored_deviation, is learned): the measured requests see chunks seen before
    for rotate in (0, 1):
        for name in selectors:
            for start in range(0, args.docs, args.chunks):
                order = [(start + j) % args.docs for j in range(args.chunks)]
                ids, spans = request(order[rotate:] + order[:rotate])
                timed(ids, hints(spans, *sides[name], name))
    wait_measured(engine.get_server_info)
    rows = {name: [] for name in ["stock", *selectors]}
    stages = {name: [] for name in selectors}
    n_tokens = []
    for _ in tqdm(range(args.requests), desc="requests"):
        order = rng.sample(range(args.docs), args.chunks)
        ids, spans = request(order)
        n_tokens.append(len(ids))
        rows["stock"].append(timed(ids)[0])
        for name in selectors:
            seconds, info = timed(ids, hints(spans, *sides[name], name))
            rows[name].append(seconds)
            stages[name].append(info)
    first_reuse = measure_first_reuse(args, sides[selectors[0]], timed, request, rng, engine) \
        if args.first_reuse else None
    if args.profile:
        from chunkbench.serving.pyspy import print_top, sampled

        pid = engine.get_server_info()["internal_states"][0]["chunkcache"]["scheduler_pid"]
        with sampled(pid, args.profile):
            for _ in range(args.requests):
                ids, spans = request(rng.sample(range(args.docs), args.chunks))
                timed(ids, hints(spans, *sides[selectors[0]], selectors[0]))
    shutdown_engine(engine)  # sparing this process's resource tracker (sglang_patch.serve.shutdown)

    stock = statistics.median(rows["stock"])
    tokens = statistics.median(n_tokens)
    print(f"\nprompt tokens: median {tokens}; {args.chunks} chunks; rho={args.ratio}; {args.requests} requests per "
          f"side; dtype {settings['dtype'] if 'dtype' in settings else 'model default'}; tp {args.tp_size}")
    # ms/token: stock's TTFT per prompt token against the blend's recompute pass per recomputed token (the
    # per-token efficiency target: a recomputed token costs at most what stock pays per prompt token)
    print(f"{'side':<10}{'TTFT median s':>15}{'speed-up vs stock':>19}{'hits':>6}{'recomputed':>12}"
          f"{'fill s':>8}{'copy s':>8}{'features s':>12}{'select s':>10}{'recompute s':>13}{'ms/token':>10}")
    print(f"{'stock':<10}{stock:>15.3f}{1.0:>19.2f}{'':>6}{'':>12}{'':>8}{'':>8}{'':>12}{'':>10}{'':>13}"
          f"{1e3 * stock / tokens:>10.3f}")
    for name in selectors:
        med = statistics.median(rows[name])
        infos = [i for i in stages[name] if i and "fallback" not in i]
        fallbacks = sum(1 for i in stages[name] if not i or "fallback" in i)
        reasons = sorted({f"{(i or {}).get('fallback', 'no report')}: {(i or {}).get('detail', '')[:160]}"
                          for i in stages[name] if not i or "fallback" in i})
        def m(*keys, sub=False):
            vals = [sum(i["stages_s"][k] for k in keys) if sub else i[keys[0]] for i in infos]
            return statistics.median(vals) if vals else float("nan")
        print(f"{name:<10}{med:>15.3f}{stock / med:>19.2f}{m('chunk_hits'):>6.0f}{m('recomputed_tokens'):>12.0f}"
              f"{m(*FILL, sub=True):>8.3f}{m('copy', sub=True):>8.3f}{m('features', sub=True):>12.3f}"
              f"{m('select', sub=True):>10.3f}{m('recompute', sub=True):>13.3f}"
              f"{1e3 * m('recompute', sub=True) / m('recomputed_tokens'):>10.3f}"
              + (f"  {fallbacks} of {len(stages[name])} computed in full ({'; '.join(reasons)})" if fallbacks
                 else ""))
    print_floor(shape, tokens, attention, stock, rows, stages, selectors)
    if first_reuse:
        first, later = (statistics.median(t) for t in first_reuse)
        print(f"\n{selectors[0]}: a chunk's first reuse away from home {first:.3f} s, a later reuse of the same chunks "
              f"{later:.3f} s (medians of {args.first_reuse}): first/later {first / later:.2f}")
    if args.profile:
        print_top(args.profile)


def measure_first_reuse(args, side: tuple[str, float], timed, request, rng, engine) -> tuple[list[float], list[float]]:
    from chunkbench.serving.http_client import wait_measured

    (name, ratio), first, later = side, [], []
    for i in range(args.first_reuse):
        namespace = f"first-reuse-{i}"
        order = rng.sample(range(args.docs), args.chunks)
        ids, spans = request(order)
        timed(ids, hints(spans, name, ratio, namespace))  # computes and stores every chunk
        ids, spans = request(order[len(order) // 2:] + order[: len(order) // 2])  # every chunk elsewhere
        first.append(timed(ids, hints(spans, name, ratio, namespace))[0])
        wait_measured(engine.get_server_info)
        ids, spans = request(rng.sample(order, len(order)))
        later.append(timed(ids, hints(spans, name, ratio, namespace))[0])
    return first, later


def print_floor(shape, tokens: int, attention: float, stock: float, rows: dict, stages: dict,
                selectors: list[str]) -> None:
    """Each selector's median request against its floor (chunkbench.serving.floor), per stage, at rates measured in
    this run on this host: stock's attention before the server started, the copy bandwidth after it stopped."""
    from chunkbench.serving.floor import copy_bandwidth, floor

    print(f"\nfloor at stock's rates on this host ({shape.layers} layers, {shape.dtype}): stock {stock:.3f} s = "
          f"causal attention {attention:.3f} s (timed here) + the rest {stock - attention:.3f} s")
    print(f"{'side':<10}{'TTFT s':>8}{'floor s':>9}{'floor/TTFT':>12}{'recompute s':>13}{'its floor':>11}"
          f"{'copy s':>8}{'its floor':>11}{'fill+features+select s':>24}{'rest s':>8}")
    for name in selectors:
        infos = [i for i in stages[name] if i and "fallback" not in i]
        if not infos:
            continue
        bandwidth = copy_bandwidth(int(statistics.median(i["reused_tokens"] for i in infos)) * shape.kv_bytes_per_token)
        med = statistics.median
        fl = [floor(shape, int(tokens), stock, i["recomputed_tokens"], i["attended_pairs"], i["reused_tokens"],
                    attention, bandwidth) for i in infos]
        ttft = med(rows[name])
        s = {k: med(i["stages_s"][k] for i in infos) for k in STAGES}
        total = med(f.total_s for f in fl)
        print(f"{name:<10}{ttft:>8.3f}{total:>9.3f}{total / ttft:>12.2f}{s['recompute']:>13.3f}"
              f"{med(f.recompute_s for f in fl):>11.3f}{s['copy']:>8.3f}{med(f.copy_s for f in fl):>11.3f}"
              f"{sum(s[k] for k in FILL) + s['features'] + s['select']:>24.3f}{ttft - sum(s.values()):>8.3f}")


if __name__ == "__main__":
    main()
