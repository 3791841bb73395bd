"""The fidelity estimate (chunkcache/blend/fidelity.py): measured on the reference engine, fitted, judged.

`collect` blends each case with the server's default selector (`mix`, stored deviations, overlap 0.15) at every rho
of RATIOS and keeps, per (case, rho), the first-token KL of the blend against full recompute, whether its greedy first
token is full's, and its answer (needle found, same answer as full); per case, the evidence the selector read before
any recompute (fidelity.Evidence) and the tokens each rho recomputed, from which `fit` and `judge` compute the signals.
The evidence is read once per case: the first blend's features are served again to the blends at the other rho (the
same chunks and stored deviations give the same values), so a case runs one query pass. Rows stream to OUT.jsonl
(rowlog.py) and the evidence to OUT.evidence/, so a cut-short run goes on with --resume.

Every third case (seed or MuSiQue record index divisible by 3: `role`) is a fit case, the others are held out.
`fit` fits the estimator on the fit cases of row files (a quantile regression of log KL, a logistic one of the first
token's agreement, a margin calibrated by cross-validation) and writes the coefficients file; `judge` chooses rho for
each held-out case with fidelity.smallest_ratio under each bound and reports, per family, the share of cases whose
measured KL exceeds it (Wilson interval), the mean rho chosen, needle accuracy and agreement with full recompute.

    OMP_NUM_THREADS=1 .venv/bin/python -m chunkbench.quality.fidelity_fit collect --family multikey --seed 1000 \
        --requests 150 --out results/fidelity/multikey.jsonl --resume
    .venv/bin/python -m chunkbench.quality.fidelity_fit fit results/fidelity/*.jsonl      # writes configs/fidelity.json
    .venv/bin/python -m chunkbench.quality.fidelity_fit judge results/fidelity/*.jsonl \
        --ttft multikey=results/cal_ttft/multikey.txt     # TTFT column: ttft_shuffled at the family's size
    .venv/bin/python -m chunkbench.quality.fidelity_fit judge --unseen results/fidelity/unseen/*.jsonl
                                                          # cases collected after the fit, every one judged
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from scipy import sparse
from scipy.optimize import linprog, minimize
from tqdm import tqdm

from chunkcache.blend import fidelity
from chunkcache.blend.fidelity import FLOOR, Signals, evidence, signals
from chunkcache.select.mix import MixSelector
from .. import intervals, scoring
from ..serving.ab import first_line
from ..workloads import Item, WorkloadConfig, items, to_request
from .reference_path import blend_seconds, greedy_ids, kl_logits, remember_deviations, split
from .rowlog import RowLog

RATIOS = fidelity.RATIOS
BOUNDS = (0.01, 0.02, 0.03, 0.05, 0.1, 0.2)  # max_kl bounds a first-token estimate is calibrated and judged at
COVERS = 16  # answer tokens a fitted estimate bounds by default (fidelity.Model.covers): docs/calibration.md says why
# the bounds an estimate over several answer tokens is calibrated at: the largest KL over 16 tokens runs about ten
# times the first token's on SmolLM2's cases (docs/calibration.md)
ANSWER_BOUNDS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
TERMS = ("deviation_left", "deviation")  # the estimate's signals (docs/bench/fidelity.md: why these)
STORE_BYTES = 512 << 20  # the chunk store of a collecting process (three run side by side in 24 GiB)
# the server's default selector (chunkcache/configs/default.yaml)
DEFAULT = {"stored_deviation": True, "overlap": 0.15}


@dataclass(frozen=True)
class Family:
    spec: str
    docs: int
    words: int


# the sizes of each family's committed quality tables (docs/bench: eval_select.md, realkey.md, musique.md)
FAMILIES = {"multikey": Family("synthetic:multikey", 3, 250), "realkey": Family("synthetic:realkey", 8, 110),
            "musique": Family("musique", 5, 120)}


class Recorded:
    """`mix` serving, in a case's later blends, the features its first blend read: the memo of every feature is
    filled before select, so the engine runs no pass for them (prompt_text and the stored deviation included)."""

    name = "mix"

    def __init__(self, inner: MixSelector):
        self.inner = inner
        self.values: dict | None = None

    @property
    def needs(self):
        return self.inner.needs if self.values is None else ()

    def select(self, layout, ratio, features):
        if self.values is not None:
            features.values.update(self.values)
        selection = self.inner.select(layout, ratio, features)
        if self.values is None:
            self.values = dict(features.values)
        return selection


def case_items(family: Family, seed: int, requests: int, draw: int = 0) -> list[Item]:
    """`requests` cases from `seed` (synthetic: seeds; MuSiQue: records from index `seed`, their documents drawn
    with seed `draw` when it is not 0)."""
    if family.spec == "musique":
        return items(WorkloadConfig(family.spec, seed + requests, family.docs, family.words, seed=draw))[seed:]
    return items(WorkloadConfig(family.spec, requests, family.docs, family.words, seed=seed))


def collect(args) -> None:
    from chunkcache.reference import ReferenceBlender
    from chunkcache.store import ChunkStore

    family = FAMILIES[args.family]
    out = Path(args.out)
    evidence_dir = out.with_suffix(".evidence")
    identity = {"family": args.family, "model": args.model, "ratios": list(RATIOS), "options": DEFAULT,
                "max_new_tokens": args.max_new_tokens, **({"draw": args.draw} if args.draw else {})}
    log = RowLog(out, identity, args.resume)
    cases = case_items(family, args.seed, args.requests, args.draw)
    # a case's chunks are all the store must hold (and what a realkey or MuSiQue case shares with earlier ones)
    blender = ReferenceBlender.from_pretrained(args.model, store=ChunkStore(host_bytes=STORE_BYTES))
    for item in tqdm(cases, desc=f"{args.family} seed {args.seed}", unit="case"):
        file = evidence_dir / f"{item.id}.pt"
        missing = missing_ratios(log, family.spec, item.id, file)
        for row in measure(blender, item, file, family.spec, args.max_new_tokens, missing) if missing else ():
            log.append(row)


def missing_ratios(log: RowLog, task: str, item: str, file: Path) -> tuple[float, ...]:
    """The rho of the grid a case has no usable row at, which a resumed run measures (all of them for a case not
    measured yet; none for one measured): a row is usable with its signals or the evidence file they come from."""
    keys = {r: (task, item, "mix", r, "reference") for r in RATIOS}
    return tuple(r for r, k in keys.items() if k not in log or ("signals" not in log.rows[k] and not file.is_file()))


def measure(blender, item: Item, file: Path, task: str, max_new_tokens: int,
            ratios: Sequence[float] = RATIOS) -> list[dict]:
    """One case: full recompute; the chunks' deviations remembered from two other orders; a blend at rho 0 (the
    forced tokens only: its features are the case's evidence, its logits naive reuse's); then a blend per rho, its
    KL against full's at each token of full's greedy answer (teacher-forced: row 0 is the first token's)."""
    return measure_parts(blender, split(to_request(blender.tokenizer, item).prompt), item.id, item.answers, file, task,
                         max_new_tokens, ratios)


def measure_parts(blender, parts, item: str, answers: tuple[str, ...], file: Path, task: str,
                  max_new_tokens: int, ratios: Sequence[float] = RATIOS) -> list[dict]:
    """`measure` on a prompt already split into (prefix, chunks, query) ids; without `answers` (a served request's
    prompt: nobody knows its answer) a row's needle and F1 columns are None."""
    full = blender.full_prefill(*parts)
    full_ids = blender.generate(full, max_new_tokens)
    full_forced = blender.teacher_forced_logits(full, full_ids)
    full_line = first_line(blender.tokenizer.decode(full_ids, skip_special_tokens=True))
    selector = Recorded(MixSelector(**DEFAULT))
    remember_deviations(blender, parts, selector.inner, 0.0, {})
    naive = blender.blend(*parts, selector=selector, ratio=0.0)
    if "kv_deviation" in naive.passes:
        raise RuntimeError(f"{item}: the measured blend ran the deviation pass after the warm-up")
    case_evidence = evidence(naive.layout, naive.scores, selector.values)
    rows, recomputed = [], {}
    for ratio in ratios:
        res = blender.blend(*parts, selector=selector, ratio=ratio)
        recomputed[ratio] = res.recomputed
        forced = blender.teacher_forced_logits(res, full_ids)
        line = first_line(blender.tokenizer.decode(greedy_ids(blender, res, full_ids, max_new_tokens, forced)[0],
                                                   skip_special_tokens=True))
        rows.append({"task": task, "item": item, "selector": "mix", "ratio": ratio, "path": "reference",
                     "kl": kl_logits(full.logits, res.logits),
                     "answer_kls": [round(kl_logits(f, b), 7) for f, b in zip(full_forced, forced)],
                     "blend_s": round(blend_seconds(res), 5), "full_s": round(full.timings["total"], 5),
                     "agree": float(int(res.logits.argmax()) == int(full.logits.argmax())),
                     "contains": _contains(line, answers), "full_contains": _contains(full_line, answers),
                     "same": scoring.exact_match(line, full_line),
                     "f1": scoring.best_f1(line, answers) if answers else None,
                     "answer": line, "full_answer": full_line,
                     "signals": asdict(signals(case_evidence, res.recomputed))})
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"evidence": case_evidence, "recomputed": recomputed,
                "naive_logits": naive.logits.half(), "naive_kl": kl_logits(full.logits, naive.logits)}, file)
    return rows


def _contains(line: str, answers) -> float | None:
    """RULER-style: every gold answer appears in the reply's first line (None without answers)."""
    if not answers:
        return None
    normalized = scoring.normalize(line)
    return float(all(scoring.normalize(a) in normalized for a in answers))


@dataclass(frozen=True)
class Point:
    """One measured blend: a case at one rho."""

    family: str
    item: str
    signals: Signals
    row: dict  # the collected row: kl, answer_kls, agree, contains, full_contains, same, f1


def measured(row: dict, covers: int) -> float:
    """The KL an estimator covering `covers` answer tokens bounds: the largest over the first `covers` tokens of
    full's answer (row 0, the first token's, is `kl`; an answer shorter than `covers` counts the tokens it has)."""
    return row["kl"] if covers == 1 else max(row["answer_kls"][:covers])


def load_points(paths: list[str]) -> list[Point]:
    """Every (case, rho) of the row files with its signals: the row's own (`signals`, written at collection or by
    `pack`), else computed by fidelity.signals from the case's evidence beside the file (a case with neither is
    left out)."""
    points = []
    for path in map(Path, paths):
        family = identity(path)["family"]
        for item, rs in _by_item(path).items():
            if all("signals" in r for r in rs):
                points += [Point(family, item, Signals(**r["signals"]), r) for r in rs]
                continue
            file = path.with_suffix(".evidence") / f"{item}.pt"
            if file.is_file():
                case = torch.load(file, weights_only=False)
                points += [Point(family, item, signals(case["evidence"], case["recomputed"][r["ratio"]]), r)
                           for r in rs]
    return points


def _by_item(path: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines()[1:]:
        if line.strip():
            row = json.loads(line)
            out.setdefault(row["item"], []).append(row)
    return out


def pack(args) -> None:
    """Write each row's signals into its file (from the evidence beside it), so the rows fit and judge on their own:
    a file small enough to keep where the evidence is not."""
    for path in map(Path, args.paths):
        head = path.read_text().split("\n", 1)[0]
        points = load_points([str(path)])
        lines = [head] + [json.dumps({**p.row, "signals": asdict(p.signals)}) for p in points]
        path.write_text("\n".join(lines) + "\n")
        print(f"{path}: {len(points)} rows with their signals")


def identity(path: str | Path) -> dict:
    """A row file's identity line (rowlog.RowLog): the family, model and settings its cases were collected with."""
    with open(path) as f:
        return json.loads(f.readline())["identity"]


def model_of(paths: list[str]) -> str:
    """The one model the row files were collected on (their identity lines)."""
    names = {identity(path)["model"] for path in paths}
    if len(names) != 1:
        raise ValueError(f"the row files hold cases of {len(names)} models ({sorted(names)}): fit and judge one at a "
                         "time")
    return names.pop()


def grid_of(paths: list[str]) -> tuple[float, ...]:
    """The rho every row file was collected at (their identity lines): what a fit on them covers (files collected
    before the grid reached 0.8 hold five)."""
    grids = [set(identity(path)["ratios"]) for path in paths]
    return tuple(sorted(set.intersection(*grids)))


def role(item: str) -> str:
    """"fit" for every third case (seed or MuSiQue record index divisible by 3), "judge" for the others: a rule fixed
    before any case was measured, so the two sets are disjoint however far a collection gets."""
    return "fit" if _number(item) % 3 == 0 else "judge"


def _number(item: str) -> int:
    """A case's seed or record index: the number its id ends with ("multikey1003" -> 1003)."""
    return int(re.search(r"(\d+)$", item).group(1))


def cases_of(points: list[Point], ratios: Sequence[float] = RATIOS) -> dict[tuple[str, str], dict[float, Point]]:
    """(family, item) -> rho -> point, for the cases measured at every rho of `ratios` (those only)."""
    out: dict[tuple[str, str], dict[float, Point]] = {}
    for p in points:
        out.setdefault((p.family, p.item), {})[p.row["ratio"]] = p
    return {k: {r: v[r] for r in ratios} for k, v in out.items() if set(ratios) <= set(v)}


def design(points: list[Point], terms: tuple[str, ...]) -> np.ndarray:
    """Rows [1, log max(signal, FLOOR) for each term], as fidelity.Linear reads them."""
    return np.array([[1.0] + [math.log(max(float(getattr(p.signals, t)), FLOOR)) for t in terms] for p in points])


def log_kl(points: list[Point], covers: int) -> np.ndarray:
    return np.array([math.log(max(measured(p.row, covers), FLOOR)) for p in points])


def quantile_regression(x: np.ndarray, y: np.ndarray, quantile: float) -> np.ndarray:
    """Coefficients minimising the pinball loss at `quantile` (the linear programme of Koenker and Bassett)."""
    n, k = x.shape
    cost = np.concatenate([np.zeros(k), np.full(n, quantile), np.full(n, 1 - quantile)])
    a = sparse.hstack([sparse.csr_matrix(x), sparse.eye(n), -sparse.eye(n)])
    res = linprog(cost, A_eq=a, b_eq=y, bounds=[(None, None)] * k + [(0, None)] * (2 * n), method="highs")
    if not res.success:
        raise RuntimeError(f"quantile regression failed: {res.message}")
    return res.x[:k]


def logistic_regression(x: np.ndarray, y: np.ndarray, ridge: float = 1e-3) -> np.ndarray:
    """Maximum-likelihood logistic coefficients, a small ridge on the weights (not the intercept) keeping them finite
    when the fit cases separate."""
    def loss(b):
        z = x @ b
        penalty = ridge * float(b[1:] @ b[1:])
        return float(np.sum(np.logaddexp(0, z) - y * z)) / len(y) + penalty, \
            x.T @ (1 / (1 + np.exp(-z)) - y) / len(y) + 2 * ridge * np.concatenate([[0], b[1:]])
    return minimize(loss, np.zeros(x.shape[1]), jac=True, method="L-BFGS-B").x


def choose(estimates: dict[float, float], bound: float, margin: float) -> float | None:
    """fidelity.smallest_ratio over precomputed log-KL estimates per rho (the grid capped at its largest rho)."""
    return next((r for r in sorted(estimates) if estimates[r] + margin <= math.log(bound)), None)


def held_out(cases: dict, terms: tuple[str, ...], quantile: float, folds: int,
             covers: int = 1) -> dict[tuple[str, str], dict]:
    """Each fit case's log-KL estimate per rho by a fit on the other folds (cases dealt to folds in turn)."""
    keys = sorted(cases)
    held: dict[tuple[str, str], dict[float, float]] = {}
    for f in range(folds):
        train = [p for i, k in enumerate(keys) if i % folds != f for p in cases[k].values()]
        beta = quantile_regression(design(train, terms), log_kl(train, covers), quantile)
        for i, k in enumerate(keys):
            if i % folds == f:
                held[k] = {r: float(design([p], terms)[0] @ beta) for r, p in cases[k].items()}
    return held


def calibrate(cases: dict, terms: tuple[str, ...], quantile: float, target: float, folds: int,
              covers: int = 1, bounds: tuple[float, ...] = BOUNDS) -> float:
    """The smallest margin (log KL, steps of 0.05) at which choosing rho by the estimate lets at most `target` of each
    family's fit cases exceed the bound, at every bound of BOUNDS (the goal holds per bound, not pooled over them),
    every case estimated by a fit on the other folds. Choosing the smallest rho that meets a bound favours a rho the
    estimate underrates, so a quantile fitted over all rho alone exceeds the bound more often than 1 - quantile, and
    a fit pooled over families is looser on some than on others: the margin pays for both."""
    held = held_out(cases, terms, quantile, folds, covers)
    families = {k[0] for k in cases}
    for margin in np.arange(0, 5, 0.05):
        worst = max(_exceeded({k: c for k, c in cases.items() if k[0] == family}, held, margin, bound, covers)
                    for family in families for bound in bounds)
        if worst <= target:
            return float(margin)
    raise RuntimeError("no margin below 5 keeps the fit cases' exceedance at the target")


def compare(args) -> None:
    """Cross-validated pinball loss (lower is better) and coverage of each term set on the fit cases."""
    cases = {k: v for k, v in cases_of(load_points(args.paths), grid_of(args.paths)).items() if role(k[1]) == "fit"}
    print(f"{len(cases)} fit cases; {args.folds}-fold cross-validation at quantile {args.quantile}, KL over "
          f"{args.covers} answer token(s)\n")
    print("| terms | pinball loss | share of blends over the estimate |\n|---|---|---|")
    for terms in (tuple(t.split(",")) for t in args.sets.split(";")):
        held = held_out(cases, terms, args.quantile, args.folds, args.covers)
        residual = np.array([math.log(max(measured(p.row, args.covers), FLOOR)) - held[k][r] for k, c in cases.items()
                             for r, p in c.items()])
        loss = np.mean(np.maximum(args.quantile * residual, (args.quantile - 1) * residual))
        print(f"| {', '.join(terms)} | {loss:.4f} | {np.mean(residual > 0):.3f} |")


def _exceeded(cases: dict, estimates: dict, margin: float, bound: float, covers: int = 1) -> float:
    """Share of the cases whose rho chosen under `bound` has a measured KL over it."""
    chosen = [(k, choose(estimates[k], bound, margin)) for k in cases]
    return sum(r is not None and measured(cases[k][r].row, covers) > bound for k, r in chosen) / len(chosen)


@dataclass(frozen=True)
class FitSettings:
    terms: tuple[str, ...] = TERMS  # the Signals fields the estimate reads
    quantile: float = 0.9
    target: float = 0.1  # share of each family's fit cases allowed over each bound
    folds: int = 5
    covers: int = 1  # answer tokens the KL estimate bounds (fidelity.Model.covers)
    bounds: tuple[float, ...] = BOUNDS  # the max_kl bounds the margin is calibrated at


def fit_model(cases: dict, settings: FitSettings, fitted_on: str, fingerprint: str | None = None) -> dict:
    """A coefficients file's model entry fitted on `cases` (cases_of: the fit cases only); one covering the answer
    holds a first-token estimator fitted on the same cases (`first_token`: what a request's kl_over: first_token
    reads), its margin calibrated at the first-token bounds (BOUNDS)."""
    points = [p for case in cases.values() for p in case.values()]
    terms = settings.terms
    kl = quantile_regression(design(points, terms), log_kl(points, settings.covers), settings.quantile)
    agree = logistic_regression(design(points, terms), np.array([p.row["agree"] for p in points]))
    margin = calibrate(cases, terms, settings.quantile, settings.target, settings.folds, settings.covers,
                       settings.bounds)
    return {
        "quantile": settings.quantile,
        "kl": {"intercept": round(float(kl[0]), 4), "weights": {t: round(float(w), 4) for t, w in zip(terms, kl[1:])}},
        "margin": round(margin, 2),
        "agree": {"intercept": round(float(agree[0]), 4),
                  "weights": {t: round(float(w), 4) for t, w in zip(terms, agree[1:])}},
        "fitted_on": fitted_on,
        "covers": settings.covers,
        "fingerprint": fingerprint,
        "ratios": sorted({r for case in cases.values() for r in case}),
        **({"first_token": fit_model(cases, replace(settings, covers=1, bounds=BOUNDS),
                                     fitted_on.replace(f"KL over {settings.covers} answer token(s)",
                                                       "KL over 1 answer token(s)"), fingerprint)}
           if settings.covers > 1 else {}),
    }


def fitted_on(cases: dict, model: str, settings: FitSettings) -> str:
    """The entry's `fitted_on` line: model, engine, selector, grid and the cases by family."""
    families = sorted({k[0] for k in cases})
    where = "; ".join(f"{f} {sum(k[0] == f for k in cases)} cases "
                      f"({_ids(sorted(_number(k[1]) for k in cases if k[0] == f))})" for f in families)
    grid = ", ".join(map(str, sorted({r for case in cases.values() for r in case})))
    return (f"{model}, reference engine, float32; mix with the server defaults (stored deviations, overlap 0.15) at "
            f"rho {grid}; KL over {settings.covers} answer token(s); {where}: every third seed "
            "/ record, chunkbench/quality/fidelity_fit.py role(); docs/bench/fidelity.md")


def write_model(path: Path, name: str, entry: dict, settings: FitSettings) -> None:
    """Write (or replace) `name`'s entry in the coefficients file at `path`, keeping its other models; the file's
    doc lines are the shipped file's, the margin's naming these settings."""
    known = json.loads(path.read_text()) if path.is_file() else {"default": name, "models": {}}
    doc = dict(json.loads(fidelity.PACKAGED.read_text())["doc"])
    doc["margin"] = (f"added to the log KL estimate: the smallest (steps of 0.05) at which choosing rho by "
                     f"smallest_ratio let at most {settings.target:g} of each family's fit cases exceed the bound, "
                     f"at each of the bounds {', '.join(map(str, settings.bounds))}, each case estimated by a fit on "
                     f"the other {settings.folds - 1} of {settings.folds} folds")
    out = {"doc": doc, "default": known["default"], "models": {**known["models"], name: entry}}
    fidelity.parse(out)  # what the server will read
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


def fit(args) -> None:
    grid = grid_of(args.paths)
    cases = {k: v for k, v in cases_of(load_points(args.paths), grid).items() if role(k[1]) == "fit"}
    if not cases:
        raise SystemExit(f"no fit case (seed or record divisible by 3) measured at every rho of {grid} in "
                         f"{args.paths}")
    settings = FitSettings(tuple(args.terms.split(",")), args.quantile, args.target, args.folds, args.covers,
                           ANSWER_BOUNDS if args.covers > 1 else BOUNDS)
    name = model_of(args.paths)
    entry = fit_model(cases, settings, fitted_on(cases, name, settings))
    write_model(Path(args.out), name, entry, settings)
    print(json.dumps({name: entry}, indent=1))


def _ids(numbers: list[int]) -> str:
    """3, 6, 9, ... as "3-9 step 3" runs where they are regular."""
    return f"{numbers[0]}-{numbers[-1]} step 3" if numbers == list(range(numbers[0], numbers[-1] + 1, 3)) else \
        ", ".join(map(str, numbers))


def read_ttft(path: str) -> dict[float, float]:
    """rho -> median TTFT over stock's, from the table `chunkbench.serving.ttft_shuffled --selectors mix --ratio
    R1,R2,..` prints (its sides SELECTOR@RHO; the side at rho 1 is what a request computed in full costs there)."""
    text = Path(path).read_text()
    stock = re.search(r"^stock\s+([\d.]+)\s", text, re.M)
    sides = {float(rho): float(t) for rho, t in re.findall(r"^\S+@([\d.]+)\s+([\d.]+)\s", text, re.M)}
    if stock is None or not set(RATIOS) | {1.0} <= set(sides):
        raise ValueError(f"{path}: expected stock's TTFT and a side at each rho of {RATIOS} and at 1")
    return {rho: t / float(stock.group(1)) for rho, t in sides.items()}


def judge_table(cases: dict, model: fidelity.Model, ttft: dict[str, dict[float, float]],
                bounds: tuple[float, ...] = BOUNDS, cost_label: str = "TTFT / stock's") -> list[str]:
    """The calibration table: per family and bound, rho chosen by `model`'s estimate for each of `cases`, the share
    whose KL (over the answer tokens the model covers) exceeds the bound with its Wilson interval, the mean rho, the
    cost (`ttft`: family -> rho -> time over the baseline's, `cost_label`), needles and answers against full
    recompute's."""
    lines = [f"| family | bound | n | KL over {model.covers} token(s) > bound [95 % Wilson] | mean rho | in full | "
             f"{cost_label} | best fixed rho | oracle mean rho | needle / full's | first token = full's | "
             "same answer as full |", "|---" * 12 + "|"]
    order = list(FAMILIES)  # the repository's families first, in their order, then a user's
    for family in sorted({k[0] for k in cases}, key=lambda f: order.index(f) if f in order else len(order)):
        mine = [c for k, c in cases.items() if k[0] == family]
        kl = (lambda row: measured(row, model.covers))
        grid = model.ratios
        for bound in bounds:
            picked = [(c, fidelity.smallest_ratio(lambda r, c=c: c[r].signals, bound, model)) for c in mine]
            rows = [c[r].row if r is not None else None for c, r in picked]
            full = [c[grid[0]].row for c in mine]
            n = len(mine)
            over = sum(r is not None and kl(r) > bound for r in rows)
            low, high = intervals.wilson(over, n)
            rho = [1.0 if r is None else r for _, r in picked]
            cost = f"{_mean(ttft[family][r] for r in rho):.2f}" if family in ttft else "-"
            oracle = [next((r for r in grid if kl(c[r].row) <= bound), 1.0) for c in mine]
            fixed = next((r for r in grid if sum(kl(c[r].row) > bound for c in mine) <= 0.1 * n), None)
            needle = (f"{_mean(r['contains'] if r else f['full_contains'] for r, f in zip(rows, full)):.2f} / "
                      f"{_mean(f['full_contains'] for f in full):.2f}"
                      if family != "musique" and all(f["full_contains"] is not None for f in full) else "")
            lines.append(
                f"| {family} | {bound} | {n} | {over / n:.3f} [{low:.3f}, {high:.3f}] | {_mean(rho):.3f} | "
                f"{sum(r is None for _, r in picked)} | {cost} | {fixed if fixed is not None else f'> {grid[-1]}'} | "
                f"{_mean(oracle):.3f} | {needle} | {_mean(r['agree'] if r else 1.0 for r in rows):.2f} | "
                f"{_mean(r['same'] if r else 1.0 for r in rows):.2f} |")
    return lines


def judge(args) -> None:
    name = model_of(args.paths)
    coefficients = fidelity.load(args.coefficients)
    # judging a model with another's estimator is what a server never does (it estimates nothing without its own):
    # this asks how far the default model's coefficients would be off
    model = coefficients.model(name) or coefficients.model()
    print(f"{name}'s cases, judged with {model.name}'s estimator" + (" (it has none of its own)"
                                                                       if model.name != name else "") + "\n")
    cases = {k: v for k, v in cases_of(load_points(args.paths), model.ratios).items()
             if args.unseen or role(k[1]) == "judge"}
    print(f"cases judged: {'every case (collected after the fit)' if args.unseen else 'the held-out ones (role)'}\n")
    ttft = {family: read_ttft(path) for family, path in (t.split("=", 1) for t in args.ttft)}
    print("\n".join(judge_table(cases, model, ttft, ANSWER_BOUNDS if model.covers > 1 else BOUNDS)))


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.quality.fidelity_fit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="measure cases on the reference engine")
    c.add_argument("--family", choices=FAMILIES, required=True)
    c.add_argument("--seed", type=int, default=1000, help="first seed (MuSiQue: first record index)")
    c.add_argument("--requests", type=int, default=20)
    c.add_argument("--draw", type=int, default=0, help="MuSiQue: each record's documents drawn at random from its "
                   "passages with this seed (other cases of the same records); 0: its first ones, in file order")
    c.add_argument("--model", default="smollm2-135m-instruct")
    c.add_argument("--max-new-tokens", type=int, default=24)
    c.add_argument("--out", required=True)
    c.add_argument("--resume", action="store_true")
    f = sub.add_parser("fit", help="fit the estimator on the fit cases of row files, write the coefficients file")
    f.add_argument("paths", nargs="+", help="collect's OUT.jsonl files (their evidence beside them)")
    f.add_argument("--terms", default=",".join(TERMS), help="the Signals fields the estimate reads")
    f.add_argument("--quantile", type=float, default=0.9)
    f.add_argument("--target", type=float, default=0.1, help="share of fit cases allowed over each bound")
    f.add_argument("--folds", type=int, default=5)
    f.add_argument("--covers", type=int, default=COVERS, help="answer tokens the KL estimate bounds (the largest KL "
                   "over the first COVERS tokens of full recompute's answer); 1: the first token (default: "
                   "%(default)s)")
    f.add_argument("--out", default=str(fidelity.PACKAGED), help="the coefficients file: the rows' model's entry is "
                   "written, the others kept")
    j = sub.add_parser("judge", help="choose rho by the estimate for the held-out cases, per family and bound")
    j.add_argument("paths", nargs="+")
    j.add_argument("--coefficients", default=str(fidelity.PACKAGED))
    j.add_argument("--unseen", action="store_true", help="the files' cases were all collected after the estimator "
                   "was fitted (a blind judgement): judge every case, not only the held-out ones")
    j.add_argument("--ttft", action="append", default=[], metavar="FAMILY=PATH",
                   help="the TTFT column: ttft_shuffled's table at the family's prompt size (read_ttft)")
    m = sub.add_parser("compare", help="cross-validated pinball loss of term sets on the fit cases")
    m.add_argument("paths", nargs="+")
    m.add_argument("--sets", required=True, help="term sets: 'a,b;a,c'")
    m.add_argument("--quantile", type=float, default=0.9)
    m.add_argument("--folds", type=int, default=5)
    m.add_argument("--covers", type=int, default=1, help="answer tokens the KL bounds")
    p = sub.add_parser("pack", help="write each row's signals into its file, so it needs no evidence files")
    p.add_argument("paths", nargs="+")
    args = ap.parse_args()
    {"collect": collect, "fit": fit, "judge": judge, "compare": compare, "pack": pack}[args.cmd](args)


if __name__ == "__main__":
    main()
