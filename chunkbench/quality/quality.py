"""`chunkcache eval`: answer quality of selectors x recompute budgets rho on a data set, against the gold answers and
against full recompute, through the torch reference blender (default) or a live chunkcache server.

Per case: full recompute (the `full` row, the oracle), then one blend per (selector, rho), each scored on
* task accuracy: F1 / EM of the reply's first line against the gold answers, and `contains` (every gold answer
  appears in the reply: RULER-style, since the small model answers in full sentences);
* agreement with full recompute's reply: F1 and identical text ("same as full");
* fidelity that degrades gracefully (fidelity.py): teacher-forced agreement on full's answer, and the KL divergence
  of the first answer token's distribution;
* cost: selection and blend time (reference path, chunks already stored) or TTFT (server path).
Every table cell is a mean over cases with a 95 % bootstrap interval (intervals.py). Rows go to OUT.jsonl as they
finish (rowlog.py), so `resume` continues a cut-short sweep.

Reference path (reference_path.py): full recompute is the unmodified HF prefill. Server path (server_path.py): full
recompute is a request without hints, stock SGLang's own prefill on the same server. The two build the same prompt
(layout and chunk spans) from a case; a selector that depends only on the layout (epic) picks the same tokens on both.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from .. import intervals, scoring
from ..serving.ab import first_line
from ..serving.ab_report import mean
from ..workloads import Item, WorkloadConfig, items, phase
from .rowlog import RowLog

RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3)
FIXED = ("none", "full")  # selectors whose recompute set does not depend on rho: one row each
ORACLE = "full"  # the full-recompute row of every case; the blended `full` selector, if asked for, is "full-blend"
# (row key, column header) of the quality columns, in table order
COLUMNS = (("f1", "F1"), ("em", "EM"), ("contains", "contains"), ("agreement", "agreement"), ("same", "same as full"),
           ("tf_agreement", "TF agreement"), ("kl_first", "KL first token"))
TIMINGS = ("select_s", "blend_s", "ttft_s", "full_s")
BUDGET = "rho_used"  # share of the reused context recomputed: the request's rho, or an adaptive budget's choice

Step = tuple[str, str, float | None, dict]  # (row label, selector, rho, selector options)


@dataclass
class EvalConfig:
    workload: WorkloadConfig = field(default_factory=lambda: WorkloadConfig(spec="synthetic:bridge", requests=100,
                                                                           docs=3, words=250))
    selectors: tuple[str, ...] = ("none", "epic", "cacheblend", "prophet", "spec", "clip")
    ratios: tuple[float, ...] = RATIOS
    drafts: tuple[str, ...] = ("self",)  # for spec / clip, and the Jaccard analysis
    path: str = "reference"  # reference | server
    analyses: bool = False  # layer-wise KV deviation and top-20 % Jaccard overlap (reference path)
    max_new_tokens: int = 24
    model: str = "smollm2-135m-instruct"  # server path with server_url: the server's model (for its tokenizer)
    server_config: str | None = None  # server path: YAML for `chunkcache serve --chunkcache-config`
    server_url: str | None = None  # server path: a running chunkcache server to use instead of starting one
    top_logprobs: int = 20  # server path: KL over full's top-k first-token logprobs plus one bucket for the rest
    confidence: float = intervals.CONFIDENCE  # of every table cell's bootstrap interval
    resamples: int = intervals.RESAMPLES  # bootstrap resamples per interval
    out: Path | None = None  # JSON of every row; the rows also stream to OUT.jsonl, the table goes to OUT.md
    resume: bool = False  # keep the rows OUT.jsonl already holds (same measurement) and run only the others


def rows_path(out: Path | None) -> Path | None:
    return None if out is None else out.with_suffix(".jsonl")


def identity(config: EvalConfig) -> dict:
    """What must not change between a run and its resumption (the cases, selectors, rho and path may: they are part
    of each row's key)."""
    workload = asdict(config.workload)
    del workload["requests"]  # more cases extend a sweep: case ids do not depend on the count
    return {"workload": workload, "model": config.model, "max_new_tokens": config.max_new_tokens,
            "drafts": list(config.drafts), "server_config": config.server_config, "top_logprobs": config.top_logprobs}


def run(config: EvalConfig) -> dict:
    if config.path not in ("reference", "server"):
        raise ValueError(f"path must be 'reference' or 'server', got {config.path!r}")
    if config.resume and config.out is None:
        raise ValueError("resume needs out: the rows to resume are in OUT.jsonl")
    pool = phase(config.workload, items(config.workload), 0)
    log = RowLog(rows_path(config.out), identity(config), config.resume)
    with contextlib.ExitStack() as stack:
        if config.path == "reference":
            from chunkcache.reference import ReferenceBlender
            from .reference_path import ReferenceMeasure, selector_runs

            measure = ReferenceMeasure(ReferenceBlender.from_pretrained(config.model), config.max_new_tokens)
            runs = selector_runs(list(config.selectors), list(config.drafts), measure.blender)
        else:
            from .server_path import server_runs

            measure = None  # the server starts only if a row is missing
            runs = server_runs(list(config.selectors))
        plan: list[Step] = [(ORACLE, ORACLE, None, {})] + [
            (f"{ORACLE}-blend" if label == ORACLE else label, name, ratio, options)
            for label, name, options in runs for ratio in _ratios(name, config.ratios)]
        todo = [(item, [s for s in plan if _key(config, item, s) not in log]) for item in pool]
        todo = [(item, steps) for item, steps in todo if steps]
        if todo and config.path == "server":
            measure = stack.enter_context(_server_measure(config))
        _measure(config, measure, todo, log, total=len(pool) * len(plan))
    rows = [log.rows[_key(config, item, s)] for s in plan for item in pool]
    result = {"config": asdict(config), "rows": rows,
              "table": table(rows, confidence=config.confidence, resamples=config.resamples)}
    if config.analyses:
        from .analysis import analyse

        result["analyses"] = analyse(config, pool)
    if config.out:
        config.out.write_text(json.dumps(result, indent=1, default=str))
        config.out.with_suffix(".md").write_text(markdown(result))
    return result


def _measure(config: EvalConfig, measure, todo: list[tuple[Item, list[Step]]], log: RowLog, total: int) -> None:
    """Run the missing rows, case by case; full recompute runs for every case with a missing row (its blends are
    measured against it) but is logged only where its own row is missing."""
    done = total - sum(len(steps) for _, steps in todo)
    with tqdm(total=total, initial=done, desc=f"{config.workload.spec} ({config.path})", unit="row") as bar:
        for item, steps in todo:
            bar.set_postfix_str(item.id)
            ref, full_fields = measure.full(item)
            for label, name, ratio, options in steps:
                fields = full_fields if label == ORACLE else measure.blended(ref, name, ratio, options)
                log.append(_row(config, item, label, name, ratio, fields, full_fields["text"]))
                bar.update()


@contextlib.contextmanager
def _server_measure(config: EvalConfig):
    from transformers import AutoTokenizer

    from chunkcache.models import resolve_model
    from .server_path import ServerMeasure
    from ..serving.servers import start_server

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.model))
    with contextlib.ExitStack() as stack:
        url = config.server_url
        if url is None:
            log_dir = config.out.parent if config.out else Path("results")
            log_dir.mkdir(parents=True, exist_ok=True)
            url = stack.enter_context(start_server(log_dir / "eval_server.log", chunk_reuse=True,
                                                   config=config.server_config, model=config.model)).url
        yield ServerMeasure(url, tokenizer, config.max_new_tokens, config.top_logprobs)


def _ratios(name: str, ratios: tuple[float, ...]) -> tuple[float, ...]:
    return ratios[:1] if name in FIXED else ratios


def _key(config: EvalConfig, item: Item, step: Step) -> tuple:
    label, name, ratio, _ = step
    return config.workload.spec, item.id, label, None if name in FIXED else ratio, config.path


def _row(config: EvalConfig, item: Item, label: str, name: str, ratio: float | None, fields: dict,
         reference: str) -> dict:
    text = fields["text"]
    line, ref = first_line(text), first_line(reference)
    normalized = scoring.normalize(line)
    return {"task": config.workload.spec, "item": item.id, "selector": label,
            "ratio": None if name in FIXED else ratio, "path": config.path, "answer": text,
            "f1": scoring.best_f1(line, item.answers), "em": scoring.best_em(line, item.answers),
            # RULER-style: every gold answer appears in the reply (the 135M model answers in full sentences)
            "contains": float(all(scoring.normalize(a) in normalized for a in item.answers)),
            "agreement": scoring.f1(line, ref), "same": scoring.exact_match(line, ref),
            **{k: v for k, v in fields.items() if k != "text"}}


def table(rows: list[dict], confidence: float = intervals.CONFIDENCE,
          resamples: int = intervals.RESAMPLES) -> list[dict]:
    """One line per (selector, rho), in row order: means over cases, and their intervals under "ci"."""
    keys: dict[tuple, list[dict]] = {}
    for r in rows:
        keys.setdefault((r["selector"], r["ratio"]), []).append(r)
    out = []
    for (selector, ratio), rs in keys.items():
        line: dict = {"selector": selector, "ratio": ratio, "n": len(rs), "ci": {}}
        for k in [k for k, _ in COLUMNS] + list(TIMINGS) + [BUDGET]:
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                line[k] = mean(vals)
                line["ci"][k] = list(intervals.mean_interval(vals, confidence, resamples))
        out.append(line)
    return out


def markdown(result: dict) -> str:
    cfg = result["config"]
    wl = cfg["workload"]
    server = cfg["path"] == "server"
    timing = "TTFT s" if server else "blend s"
    kl = (f"over full's top-{cfg['top_logprobs']} first-token logprobs plus one bucket for the rest of the vocabulary "
          "(SGLang returns top-k logprobs; a lower bound of the exact KL)" if server else "exact, over the vocabulary")
    lines = [f"### `{wl['spec']}` quality sweep ({cfg['path']} path, model `{cfg['model']}`, {wl['requests']} cases, "
             f"{wl['docs']} documents of ~{wl['words']} words)", "",
             f"Cells: mean over cases [{cfg['confidence']:.0%} percentile-bootstrap interval, {cfg['resamples']} "
             "resamples]. Accuracy: F1 / EM of the reply's first line against gold, `contains`: every gold answer in "
             "the reply. Agreement: F1 against full recompute's reply; same as full: identical text. TF agreement: "
             "share of full's greedy answer tokens that are the blended model's argmax when fed full's answer. KL "
             f"first token: KL(full || blended) of the first answer token's distribution in nats, {kl}. rho used: "
             "share of the reused context recomputed (below rho where an adaptive budget chose less).", "",
             "| selector | rho | n | rho used | " + " | ".join(h for _, h in COLUMNS) + f" | select s | {timing} |",
             "|" + "---|" * (len(COLUMNS) + 6)]
    for t in result["table"]:
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:g}"
        time_key = "ttft_s" if server else ("blend_s" if "blend_s" in t else "full_s")
        cells = [_cell(t, k) for k, _ in COLUMNS] + [_cell(t, "select_s"), _cell(t, time_key)]
        lines.append(f"| {t['selector']} | {ratio} | {t['n']} | {_cell(t, BUDGET)} | " + " | ".join(cells) + " |")
    if "analyses" in result:
        from .analysis import markdown as analyses_markdown

        lines += ["", analyses_markdown(result["analyses"])]
    return "\n".join(lines) + "\n"


def _cell(line: dict, key: str) -> str:
    if key not in line:
        return "-"
    low, high = line["ci"][key]
    return f"{line[key]:.3f} [{low:.3f}, {high:.3f}]"
