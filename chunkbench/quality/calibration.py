"""`chunkcache calibrate`: a fidelity estimator for the user's own model, fitted on cases measured on that model,
judged on cases it did not fit, and written where the server finds it (the calibrations file, matched to the served
weights by fingerprint: chunkcache.blend.fidelity.Coefficients.model).

Cases come from the repository's data (synthetic multikey needles, realkey needles in MuSiQue prose, MuSiQue
questions), from the user's documents (`--documents`: a folder of .txt/.md files, whose paragraphs hide the needles,
or a JSONL of passages and questions: chunkbench.workloads), or from the server's own traffic (`--served`: the cases
file of its online audit, written with `audit.keep_prompts`: each prompt split at its chunks as the server blended it,
without answers, so its rows have no needle column). Each case is measured on the reference engine as
fidelity_fit.measure does (full recompute, then a `mix` blend at each rho of the grid, the KL against full's at each
token of full's answer); every third case is fitted (fidelity_fit.role), the others judged. The work directory keeps
each family's rows and evidence, so a run cut short goes on where it stopped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from chunkcache.blend import fidelity
from chunkcache.config import home
from chunkcache.hashing import model_fingerprint
from ..workloads import Item, WorkloadConfig, items, musique_records
from .fidelity_fit import (ANSWER_BOUNDS, BOUNDS, COVERS, FAMILIES, RATIOS, STORE_BYTES, DEFAULT, FitSettings,
                           Family, case_items, cases_of, fit_model, fitted_on, judge_table, load_points, measure,
                           measure_parts, missing_ratios, role, write_model)
from .rowlog import RowLog

MAX_NEW_TOKENS = 24  # full recompute's answer, which the blends are scored on (at least COVERS)
DOCUMENTS = Family("documents", 5, 120)  # a user's documents: passages per case and words per passage


@dataclass(frozen=True)
class Served:
    """A request a server's audit kept with its prompt (audit.keep_prompts), split into the (prefix, chunks, query)
    ids the reference engine blends: the prefix before its first chunk, each chunk with the tokens after it up to
    the next one (the separators the server recomputed), the query after its last chunk."""

    id: str
    parts: tuple[list[int], list[list[int]], list[int]]


def served_cases(path: str | Path, limit: int) -> list[Served]:
    """The first `limit` audited cases of a server's `audit.cases` file that hold their prompt."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                case = json.loads(line)
                ids, spans = case.get("prompt_ids"), case.get("chunk_spans")
                flat = [int(x) for span in spans or () for x in span]
            except (ValueError, AttributeError, TypeError):
                raise ValueError(f"{path}:{n}: not an audited case (a JSON object per line)") from None
            if ids is None:
                continue  # written without audit.keep_prompts
            if (not spans or len(flat) != 2 * len(spans) or flat != sorted(flat) or flat[0] < 0
                    or flat[-1] >= len(ids) or any(s == e for s, e in spans)):
                raise ValueError(f"{path}:{n}: chunk_spans {spans} are not sorted, disjoint spans before the last of "
                                 f"its {len(ids)} prompt tokens")
            starts = [s for s, _ in spans]
            chunks = [ids[s:t] for s, t in zip(starts, starts[1:])] + [ids[spans[-1][0]:spans[-1][1]]]
            out.append(Served(f"served{len(out)}", (ids[: starts[0]], chunks, ids[spans[-1][1]:])))
            if len(out) == limit:
                break
    if not out:
        raise ValueError(f"{path}: no audited case holds its prompt: serve with audit.keep_prompts: true beside "
                         "audit.cases (and audit.rate > 0) to collect them")
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="chunkcache calibrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: chunkcache calibrate --model gemma-3-270m --cases 90   (then restart the server: it "
               "estimates with the calibration of the weights it serves)")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="model name (`chunkcache model`) or a local HF model directory (default: %(default)s)")
    ap.add_argument("--families", default=None,
                    help=f"repository case families, comma-separated, of {', '.join(FAMILIES)} (default: all; with "
                         "--documents: none)")
    ap.add_argument("--documents", metavar="PATH",
                    help="the user's documents as a family of cases: a folder of .txt/.md files (needles hidden in "
                         "their paragraphs) or a JSONL of {\"passages\": [...], \"question\": ..., \"answers\": [...]}")
    ap.add_argument("--served", metavar="FILE",
                    help="the server's own traffic as a family of cases: its online audit's cases file, written with "
                         "audit.keep_prompts: true (docs/calibration.md)")
    ap.add_argument("--cases", type=int, default=60,
                    help="cases per family: a third fitted, the rest judged (default: %(default)s)")
    ap.add_argument("--covers", type=int, default=COVERS,
                    help="answer tokens the estimate bounds: the largest KL over the first COVERS tokens of full "
                         "recompute's answer; 1: the first token only (default: %(default)s)")
    ap.add_argument("--bounds", default=None, help="the max_kl bounds the margin is calibrated and judged at, "
                    f"comma-separated (default: {','.join(map(str, BOUNDS))}, and "
                    f"{','.join(map(str, ANSWER_BOUNDS))} with --covers above 1)")
    ap.add_argument("--target", type=float, default=0.1,
                    help="share of each family's fit cases allowed over each bound (default: %(default)s)")
    ap.add_argument("--workdir", help="where the measured cases are kept (default: "
                    "$CHUNKCACHE_HOME/calibration/MODEL-FINGERPRINT)")
    ap.add_argument("--out", help="the calibrations file the estimator is written to (default: the server's, "
                    "select.calibration: $CHUNKCACHE_HOME/fidelity.json)")
    ap.add_argument("--fresh", action="store_true", help="measure every case again (default: go on from the "
                    "work directory's cases)")
    ap.add_argument("--measured-only", action="store_true", help="measure nothing: fit and judge the cases the work "
                    "directory holds (another --covers or --target on the same cases, or a run cut short)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.fresh and args.measured_only:
        ap.error("--fresh measures every case again, --measured-only none: give one")
    if args.cases < 3:
        ap.error("--cases must be at least 3 (a third of them are fitted)")
    if args.covers < 1:
        ap.error("--covers must be at least 1")
    try:
        args.bounds = (tuple(sorted(float(b) for b in args.bounds.split(","))) if args.bounds
                       else ANSWER_BOUNDS if args.covers > 1 else BOUNDS)
    except ValueError:
        ap.error(f"--bounds: comma-separated numbers, got {args.bounds!r}")
    if any(b <= 0 for b in args.bounds):
        ap.error("--bounds must be > 0")
    if args.families is None:
        args.families = "" if args.documents or args.served else ",".join(FAMILIES)
    unknown = [f for f in args.families.split(",") if f and f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if not args.families and not args.documents and not args.served:
        ap.error("no cases: name --families, --documents or --served")
    return args


def plan(args: argparse.Namespace) -> dict[str, tuple[Family, list[Item] | list[Served]]]:
    """family name -> (its settings, its cases), built before anything is measured (bad documents fail here)."""
    out = {}
    for name in filter(None, args.families.split(",")):
        family = FAMILIES[name]
        first = 0 if family.spec == "musique" else 1000
        cases = min(args.cases, musique_records()) if name == "musique" else args.cases
        out[name] = (family, case_items(family, first, cases))
    if args.documents:
        spec = f"documents:{Path(args.documents).expanduser().resolve()}"
        family = Family(spec, DOCUMENTS.docs, DOCUMENTS.words)
        seed = 1000 if Path(args.documents).is_dir() else 0
        out["documents"] = (family, items(WorkloadConfig(spec, args.cases, family.docs, family.words, seed=seed)))
    if args.served:
        path = Path(args.served).expanduser().resolve()
        out["served"] = (Family(f"served:{path}", 0, 0), served_cases(path, args.cases))
    return out


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        cases = plan(args)
    except (ValueError, OSError) as e:
        print(f"chunkcache calibrate: {e}", file=sys.stderr)
        return 2
    from chunkcache.models import resolve_model
    from chunkcache.reference import ReferenceBlender
    from chunkcache.store import ChunkStore

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    fingerprint = model_fingerprint(model_dir)
    name = Path(model_dir).name
    label = f"{name}@{fingerprint[:12]}"
    workdir = Path(args.workdir).expanduser() if args.workdir else home() / "calibration" / label
    out = fidelity.calibrations(args.out)
    max_new_tokens = max(MAX_NEW_TOKENS, args.covers)
    total = sum(len(c) for _, c in cases.values())
    print(f"calibrating {name} ({model_dir}, fingerprint {fingerprint[:12]}): {total} cases "
          f"({', '.join(f'{f} {len(c)}' for f, (_, c) in cases.items())}), {len(RATIOS)} blends each, KL over "
          f"{args.covers} answer token(s); work directory {workdir}; the estimator goes to {out}", flush=True)

    blender = ReferenceBlender.from_pretrained(model_dir, store=ChunkStore(host_bytes=STORE_BYTES))
    logs, todo = {}, []
    for fam, (family, its) in cases.items():
        settings = {"family": fam, "model": name, "fingerprint": fingerprint, "ratios": list(RATIOS),
                    "options": DEFAULT, "max_new_tokens": max_new_tokens, "task": family.spec}
        if not args.fresh:
            _widen_grid(workdir / f"{fam}.jsonl", settings)
        logs[fam] = RowLog(workdir / f"{fam}.jsonl", settings, resume=not args.fresh)
        todo.append([(fam, family, item, missing) for item in its
                     if (missing := RATIOS if args.fresh else
                         missing_ratios(logs[fam], family.spec, item.id, _evidence(workdir, fam, item)))])
    # the families' cases in turn: a run cut short has fit and judged cases of every family
    todo = [case for turn in itertools.zip_longest(*todo) for case in turn if case is not None]
    if todo and args.measured_only:
        print(f"{total - len(todo)} of {total} cases measured; fitting and judging those", flush=True)
    elif todo:
        print(f"{total - len(todo)} of {total} cases measured already; measuring {len(todo)}", flush=True)
        bar = tqdm(todo, unit="case", file=sys.stderr)
        for n, (fam, family, item, missing) in enumerate(bar):
            started = time.monotonic()
            file = _evidence(workdir, fam, item)
            rows = (measure_parts(blender, item.parts, item.id, (), file, family.spec, max_new_tokens, missing)
                    if isinstance(item, Served) else measure(blender, item, file, family.spec, max_new_tokens, missing))
            for row in rows:
                logs[fam].append(row)
            if n == 0 and len(todo) > 1:
                took = time.monotonic() - started
                bar.write(f"time estimate: {took:.0f} s for the first case, about "
                          f"{took * (len(todo) - 1) / 60:.0f} min for the other {len(todo) - 1} on this host "
                          "(interrupt at any time: the next run goes on from here)")
    return report(args, logs, name, label, fingerprint, out)


def _widen_grid(path: Path, settings: dict) -> None:
    """A work directory's row file measured on an earlier, smaller grid (before 0.6 and 0.8) under otherwise the same
    settings takes the grid of now: its rows are kept, and each case is measured at the rho it lacks only."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    found = json.loads(lines[0])["identity"] if lines else {}
    grid = found.get("ratios")
    if (isinstance(grid, list) and set(grid) < set(RATIOS)
            and {k: v for k, v in found.items() if k != "ratios"} == {k: v for k, v in settings.items()
                                                                        if k != "ratios"}):
        path.write_text(json.dumps({"identity": {**found, "ratios": list(RATIOS)}}) + "\n" + "".join(lines[1:]))


def _evidence(workdir: Path, family: str, item: Item | Served) -> Path:
    return workdir / f"{family}.evidence" / f"{item.id}.pt"


def report(args, logs: dict[str, RowLog], name: str, label: str, fingerprint: str, out: Path) -> int:
    """Fit on the fit cases, judge the others, print the table, write the estimator."""
    measured = cases_of(load_points([str(log.path) for log in logs.values()]))
    fit_cases = {k: v for k, v in measured.items() if role(k[1]) == "fit"}
    judged = {k: v for k, v in measured.items() if role(k[1]) == "judge"}
    settings = FitSettings(target=args.target, covers=args.covers, bounds=args.bounds)
    if len(fit_cases) < 2 or not judged:  # each case's held-out estimate is fitted on the others
        print(f"chunkcache calibrate: {len(fit_cases)} fit and {len(judged)} judged cases measured; the fit needs two "
              "fit cases and the judgement one: measure more (--cases, without --measured-only)", file=sys.stderr)
        return 1
    try:
        entry = fit_model(fit_cases, settings, fitted_on(fit_cases, name, settings), fingerprint)
    except RuntimeError as e:
        print(f"chunkcache calibrate: the fit failed on {len(fit_cases)} fit cases: {e}; measure more cases "
              "(--cases)", file=sys.stderr)
        return 1
    model = fidelity.parse_model(label, entry)
    families = {k[0] for k in measured}
    cost = {fam: _time_over_full(v for k, v in measured.items() if k[0] == fam) for fam in families}
    print(f"\nfitted on {len(fit_cases)} cases, judged on {len(judged)} it did not see (KL over {args.covers} answer "
          "token(s); time: the blend's over full recompute's on the reference engine):\n")
    print("\n".join(judge_table(judged, model, cost, args.bounds, cost_label="time / full's")))
    write_model(out, label, entry, settings)
    print(f"\nwrote {label} to {out}: a server serving these weights estimates with it from its next start "
          f"(report: fidelity.fitted_for = {label!r})")
    return 0


def _time_over_full(cases) -> dict[float, float]:
    """rho -> median over the cases of the blend's time over full recompute's on the reference engine (rho 1: a
    request computed in full)."""
    cases = list(cases)
    ratio = {r: statistics.median(c[r].row["blend_s"] / c[r].row["full_s"] for c in cases) for r in RATIOS}
    return {**ratio, 1.0: 1.0}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
