"""`chunkcache eval`: answer quality of selectors x recompute budgets rho on a data set, against the gold answers and
against full recompute, through the torch reference blender (default) or a live chunkcache server.

Reference path: full recompute is the unmodified HF prefill; blends are timed with their chunks already stored.
Server path: full recompute is a request without hints (stock SGLang's own prefill on the same server); each
(selector, rho) runs in its own namespace so no request is an exact radix hit on another's prompt.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from . import scoring
from .ab import first_line
from .report import mean
from .workloads import WorkloadConfig, items, phase, to_request

RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3)
FIXED = ("none", "full")  # selectors whose recompute set does not depend on rho: one row each


@dataclass
class EvalConfig:
    workload: WorkloadConfig = field(default_factory=lambda: WorkloadConfig(spec="synthetic:bridge", requests=10,
                                                                           docs=3, words=250))
    selectors: tuple[str, ...] = ("none", "epic", "cacheblend", "prophet", "spec", "clip")
    ratios: tuple[float, ...] = RATIOS
    drafts: tuple[str, ...] = ("self",)  # for spec / clip, and the Jaccard analysis
    path: str = "reference"  # reference | server
    analyses: bool = False  # layer-wise KV deviation and top-20 % Jaccard overlap (reference path)
    max_new_tokens: int = 24
    model: str = "smollm2-135m-instruct"
    server_config: str | None = None  # server path: YAML for `chunkcache serve --config`
    out: Path | None = None  # JSON of every row (and the analyses)


def run(config: EvalConfig) -> dict:
    if config.path not in ("reference", "server"):
        raise ValueError(f"path must be 'reference' or 'server', got {config.path!r}")
    pool = phase(config.workload, items(config.workload), 0)
    rows = (_reference(config, pool) if config.path == "reference" else _server(config, pool))
    result = {"config": asdict(config), "rows": rows, "table": table(rows)}
    if config.analyses:
        from .analysis import analyse

        result["analyses"] = analyse(config, pool)
    if config.out:
        config.out.parent.mkdir(parents=True, exist_ok=True)
        config.out.write_text(json.dumps(result, indent=1, default=str))
    return result


def _reference(config: EvalConfig, pool) -> list[dict]:
    from ..reference import ReferenceBlender
    from .reference_path import answer, blend, blend_seconds, selector_runs, split

    blender = ReferenceBlender.from_pretrained(config.model)
    runs = selector_runs(list(config.selectors), list(config.drafts), blender)
    rows = []
    for item in tqdm(pool, desc=f"{config.workload.spec} (reference)", unit="case"):
        parts = split(to_request(blender.tokenizer, item).prompt)
        full = blender.full_prefill(*parts)
        ref = answer(blender, full, config.max_new_tokens)
        rows.append(_row(item, "full", None, ref, ref, full_s=full.timings["total"], tokens=full.layout.n))
        for label, name, options in runs:
            for ratio in _ratios(name, config.ratios):
                res = blend(blender, parts, name, ratio, options)
                rows.append(_row(item, label, ratio, answer(blender, res, config.max_new_tokens), ref,
                                 select_s=res.timings["select"], blend_s=blend_seconds(res),
                                 full_s=full.timings["total"], recomputed=int(res.recomputed.numel())))
    return rows


def _server(config: EvalConfig, pool) -> list[dict]:
    from transformers import AutoTokenizer

    from ..models import resolve_model
    from .client import generate
    from .servers import Server

    tok = AutoTokenizer.from_pretrained(resolve_model(config.model))
    out_dir = config.out.parent if config.out else Path("results")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with Server(out_dir / "eval_server.log", chunk_reuse=True, config=config.server_config,
                model=config.model) as server:
        for item in tqdm(pool, desc=f"{config.workload.spec} (server)", unit="case"):
            prompt = to_request(tok, item).prompt
            full = generate(server.url, prompt.input_ids, config.max_new_tokens)
            rows.append(_row(item, "full", None, full.text, full.text, ttft_s=full.ttft_s,
                             tokens=full.prompt_tokens))
            for name in config.selectors:
                for ratio in _ratios(name, config.ratios):
                    hints = prompt.kv_hints(selector=name, ratio=ratio, namespace=f"eval-{name}-{ratio}")
                    o = generate(server.url, prompt.input_ids, config.max_new_tokens, hints)
                    rep = o.report or {}
                    rows.append(_row(item, name, ratio, o.text, full.text, ttft_s=o.ttft_s,
                                     select_s=rep.get("select_s"), blend_s=rep.get("blend_s"),
                                     recomputed=rep.get("recomputed_tokens")))
    return rows


def _ratios(name: str, ratios: tuple[float, ...]) -> tuple[float, ...]:
    return ratios[:1] if name in FIXED else ratios


def _row(item, selector: str, ratio: float | None, text: str, reference: str, **extra) -> dict:
    line, ref = first_line(text), first_line(reference)
    normalized = scoring.normalize(line)
    return {"item": item.id, "selector": selector, "ratio": None if selector in FIXED else ratio, "answer": text,
            "f1": scoring.best_f1(line, item.answers), "em": scoring.best_em(line, item.answers),
            # RULER-style: every gold answer appears in the reply (the 135M model answers in full sentences)
            "contains": float(all(scoring.normalize(a) in normalized for a in item.answers)),
            "agreement": scoring.f1(line, ref), "same": scoring.exact_match(line, ref), **extra}


def table(rows: list[dict]) -> list[dict]:
    """One line per (selector, rho), in run order: means over items."""
    keys: dict[tuple, list[dict]] = {}
    for r in rows:
        keys.setdefault((r["selector"], r["ratio"]), []).append(r)
    out = []
    for (selector, ratio), rs in keys.items():
        line = {"selector": selector, "ratio": ratio, "n": len(rs)}
        for k in ("f1", "em", "contains", "agreement", "same", "select_s", "blend_s", "ttft_s", "full_s"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                line[k] = mean(vals)
        out.append(line)
    return out


def markdown(result: dict) -> str:
    cfg = result["config"]
    wl = cfg["workload"]
    timing = "TTFT s" if cfg["path"] == "server" else "blend s"
    lines = [f"### `{wl['spec']}` quality sweep ({cfg['path']} path, model `{cfg['model']}`, {wl['requests']} cases, "
             f"{wl['docs']} documents of ~{wl['words']} words)", "",
             f"| selector | rho | n | F1 | EM | contains | agreement | same as full | select s | {timing} |",
             "|" + "---|" * 10]
    for t in result["table"]:
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:g}"
        time_s = t.get("ttft_s") if cfg["path"] == "server" else t.get("blend_s", t.get("full_s"))
        lines.append(f"| {t['selector']} | {ratio} | {t['n']} | {t['f1']:.3f} | {t['em']:.3f} | {t['contains']:.3f} "
                     f"| {t['agreement']:.3f} | {t['same']:.3f} | {_fmt(t.get('select_s'))} | {_fmt(time_s)} |")
    if "analyses" in result:
        from .analysis import markdown as analyses_markdown

        lines += ["", analyses_markdown(result["analyses"])]
    return "\n".join(lines) + "\n"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"
