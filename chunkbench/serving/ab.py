"""`chunkcache bench`: stock SGLang (prefix caching) vs chunkcache on the same model, same workload, same machine.

Per server, one after the other (stock first); servers the bench starts, or deployed ones (`endpoints`: the bench
then starts and stops none, and empties the chunkcache server's radix tree as it does its own's):
  1. warm-up, not measured: chunkcache stores the KV of every document (the "precomputed chunks" premise of the
     papers); stock gets `[system][document]` in its radix tree for every document that opens a measured prompt,
     which is what prefix caching can reuse in RAG (workloads.chunk_warmup, prefix_warmup).
  2. sequential phase: each request alone (TTFT), once for stock and once per chunkcache (selector, rho).
  3. Poisson phases, one per arrival rate, the first chunkcache configuration against stock; phase k reorders the
     documents (workloads.phase) so no phase replays a prompt already in a radix tree.
Before each chunkcache run (configurations send identical prompts) its radix tree is flushed, the chunk store kept,
and the shared system prefix primed again with one warm-up request: every configuration starts from the same state.
Scores: F1/EM of the answer's first line against gold, and agreement (F1) with stock's answer to the same prompt
(exact prefill: the full-recompute reference). A request counts toward goodput when its F1 >= 80 % of stock's mean
F1 in the sequential phase (SpecCache §3.3).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from .. import scoring
from ..workloads import Request, WorkloadConfig, chunk_warmup, items, phase, prefix_warmup, to_request
from . import ab_report, plots
from .http_client import flush_cache, generate
from .load import replay
from .servers import side_server, up_line

NAMESPACE = "bench"  # chunk-store and radix namespace of every chunkcache request


@dataclass(frozen=True)
class Arm:
    """One chunkcache configuration (selector, rho); `None` selector: the stock side."""
    selector: str | None = None
    ratio: float | None = None

    @property
    def label(self) -> str:
        return "stock" if self.selector is None else f"{self.selector}@{self.ratio:g}"

    def hints(self, request: Request) -> dict | None:
        if self.selector is None:
            return None
        return request.prompt.kv_hints(selector=self.selector, ratio=self.ratio, namespace=NAMESPACE)


@dataclass
class BenchConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    arms: tuple[Arm, ...] = (Arm("prophet", 0.15),)  # chunkcache configurations; the first one runs the load phases
    rates: tuple[float, ...] = (0.05, 0.1)  # Poisson arrival rates, requests/s
    load_requests: int = 12  # requests per arrival rate
    max_new_tokens: int = 24
    model: str = "smollm2-135m-instruct"
    server_config: str | None = None  # YAML for both servers (chunkcache serve --chunkcache-config)
    out: Path = Path("results/bench")
    resume: bool = False  # keep the (side, phase, configuration) runs already in out/requests.jsonl, run the rest
    endpoints: dict[str, str] | None = None  # side -> URL of a deployed server; None: the bench starts both


def run(config: BenchConfig) -> Path:
    from transformers import AutoTokenizer

    from chunkcache.models import resolve_model

    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(config), indent=1, default=str))
    tok = AutoTokenizer.from_pretrained(resolve_model(config.model))
    pool = items(config.workload)
    measured = [("sequential", None, phase(config.workload, pool, 0))]
    for k, rate in enumerate(config.rates, start=1):
        measured.append((f"poisson@{rate:g}", rate, phase(config.workload, pool, k)[: config.load_requests]))
    phases = [(name, rate, [to_request(tok, it) for it in its]) for name, rate, its in measured]
    warmups = {"stock": [to_request(tok, it) for it in prefix_warmup([it for *_, its in measured for it in its])],
            "chunkcache": [to_request(tok, it) for it in chunk_warmup(pool, config.workload.docs)]}
    # re-primes the shared system prefix after a flush (its chunk is a store hit by then)
    prime = warmups["stock"][:1]

    jsonl = out / "requests.jsonl"
    records = [json.loads(line) for line in jsonl.read_text().splitlines()] if config.resume and jsonl.exists() else []
    done = {(r["side"], r["phase"], r["arm"]) for r in records}
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    for side, arms in (("stock", (Arm(),)), ("chunkcache", config.arms)):
        todo = [(name, rate, reqs, arm) for name, rate, reqs in phases for arm in (arms if rate is None else arms[:1])
                if (side, name, arm.label) not in done]
        if not todo:
            continue
        t = time.perf_counter()
        with side_server(out / f"server_{side}.log", url=(config.endpoints or {}).get(side),
                         chunk_reuse=side == "chunkcache", config=config.server_config, model=config.model) as server:
            print(f"{up_line(side, server, time.perf_counter() - t)}; {len(warmups[side])} warm-up requests",
                  flush=True)
            warm(server.url, warmups[side], side == "chunkcache")
            for name, rate, reqs, arm in todo:
                if side == "chunkcache":
                    flush_cache(server.url)
                    warm(server.url, prime, True)
                rows = replay(server.url, reqs, arm.hints, config.max_new_tokens, rate=rate,
                              seed=config.workload.seed, desc=f"{side} {arm.label} {name}")
                for r, req in zip(rows, reqs):
                    r.update(workload=config.workload.spec, side=side, endpoint=server.url, arm=arm.label,
                             selector=arm.selector, ratio=arm.ratio, phase=name, rate=rate,
                             **_scores(r["answer"], req.answers))
                records += rows
                with jsonl.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
    _agreement(records)
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(summarize(config, records))
    return out


def summarize(config: BenchConfig, records: list[dict]) -> str:
    """Write the summary table and the plots of a run's records into its results directory."""
    threshold = ab_report.GOODPUT_FRACTION * ab_report.mean(r["f1"] for r in records
                                                     if r["side"] == "stock" and r["phase"] == "sequential")
    summary = ab_report.markdown(records, config, threshold)
    (config.out / "summary.md").write_text(summary)
    plots.write_all(records, threshold, config.out)
    return summary


def load_run(out: Path) -> tuple[BenchConfig, list[dict]]:
    """The config and records of an earlier run's results directory."""
    if not (out / "requests.jsonl").is_file():
        raise FileNotFoundError(f"{out} holds no requests.jsonl: not a bench results directory")
    raw = json.loads((out / "config.json").read_text())
    config = BenchConfig(workload=WorkloadConfig(**raw["workload"]), arms=tuple(Arm(**a) for a in raw["arms"]),
                         rates=tuple(raw["rates"]), load_requests=raw["load_requests"],
                         max_new_tokens=raw["max_new_tokens"], model=raw["model"],
                         server_config=raw["server_config"], out=out, endpoints=raw.get("endpoints"))
    return config, [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


def warm(url: str, requests: list[Request], hinted: bool) -> None:
    """Send the unmeasured warm-up requests, one new token each, and wait for all of them."""
    # selector "none": warm-up only stores chunks, its own recompute set does not matter. A few at a time: the
    # server batches them; measured phases start only after all are done.
    arm = Arm("none", 0.0) if hinted else Arm()
    with ThreadPoolExecutor(max_workers=4) as pool:
        jobs = [pool.submit(generate, url, r.prompt.input_ids, 1, arm.hints(r)) for r in requests]
        for j in tqdm(jobs, desc="warm-up", unit="doc", leave=False):
            j.result()


def _scores(answer: str, golds: tuple[str, ...]) -> dict:
    line = first_line(answer)
    return {"f1": scoring.best_f1(line, golds), "em": scoring.best_em(line, golds)}


def first_line(text: str) -> str:
    """What is scored: the first non-empty line (the model may ramble on after the answer)."""
    return next((s for s in text.strip().splitlines() if s.strip()), "")


def _agreement(records: list[dict]) -> None:
    """F1 of each answer against stock's answer to the same prompt (same phase, same request)."""
    reference = {(r["phase"], r["request"]): first_line(r["answer"]) for r in records if r["side"] == "stock"}
    for r in records:
        r["agreement"] = scoring.f1(first_line(r["answer"]), reference[r["phase"], r["request"]])
