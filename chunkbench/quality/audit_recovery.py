"""The online audit keeping a wrong estimate honest in a live server: MODEL served with another model's fidelity
coefficients installed as if they were its own (a calibrations file entry carrying MODEL's fingerprint), every
blended request audited (`audit.rate: 1`), each request bounded by `--max-kl`. Printed per window of audited requests,
from the audit's own cases file: the share over their bound and the margin in force, so the widening and the window
after it can be read; the server's /metrics counters at the end.

    python -m chunkbench.quality.audit_recovery --model gemma-3-270m --wrong smollm2-135m-instruct \\
        --family realkey --requests 80 --max-kl 0.05 --window 20 --out results/audit_recovery

One request at a time, each followed by its audit (the scheduler audits when idle), the next sent once the audit
counter moved: the windows are in request order. The cases are the family's at seeds 2000 and up (MuSiQue: records
from 0), none of them a calibration's.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import requests
import yaml
from transformers import AutoTokenizer

from chunkcache.blend import fidelity
from chunkcache.hashing import model_fingerprint
from chunkcache.models import resolve_model
from .. import intervals
from ..serving.http_client import generate
from ..serving.servers import start_server
from ..workloads import to_request
from .fidelity_fit import FAMILIES, FitSettings, case_items, write_model


def audited(url: str) -> float:
    """chunkcache_audit_requests_total on the server's /metrics (0 before the first audit)."""
    text = requests.get(url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^chunkcache_audit_requests_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def wrong_calibration(path: Path, model_dir: Path, wrong: str) -> str:
    """Write `wrong`'s shipped estimator into a calibrations file as the one fitted on `model_dir`'s weights; its
    label."""
    fingerprint = model_fingerprint(model_dir)
    entry = json.loads(fidelity.PACKAGED.read_text())["models"][wrong]
    entry = {**entry, "fingerprint": fingerprint,
             "fitted_on": f"deliberately wrong: {wrong}'s shipped estimator installed for {model_dir.name}"}
    label = f"{wrong}-on-{model_dir.name}@{fingerprint[:12]}"
    write_model(path, label, entry, FitSettings())
    return label


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.quality.audit_recovery", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--wrong", default="smollm2-135m-instruct", help="the shipped estimator installed for --model")
    ap.add_argument("--family", choices=FAMILIES, default="realkey")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--max-kl", type=float, default=0.05)
    ap.add_argument("--window", type=int, default=20, help="audit.window: the requests judging the promise")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(resolve_model(args.model))
    label = wrong_calibration(out / "fidelity.json", model_dir, args.wrong)
    cases_file = out / "cases.jsonl"
    cases_file.unlink(missing_ok=True)
    config = out / "audit.yaml"
    config.write_text(yaml.safe_dump({
        "select": {"calibration": str(out / "fidelity.json")},
        "audit": {"rate": 1.0, "window": args.window, "keep": 8, "cases": str(cases_file)}}))
    family = FAMILIES[args.family]
    items = case_items(family, 0 if family.spec == "musique" else 2000, args.requests)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print(f"{model_dir.name} estimating with {label}; {len(items)} {args.family} requests at max_kl {args.max_kl}, "
          f"every blended one audited, window {args.window}", flush=True)
    with start_server(out / "server.log", chunk_reuse=True, config=str(config), model=str(model_dir)) as server:
        for item in items:
            prompt = to_request(tokenizer, item).prompt
            before = audited(server.url)
            res = generate(server.url, prompt.input_ids, 1, prompt.kv_hints(selector="mix", max_kl=args.max_kl))
            if (res.report or {}).get("fidelity", {}).get("kl") is None:
                continue  # computed in full or without an estimate: nothing to audit
            deadline = time.monotonic() + 60
            while audited(server.url) <= before and time.monotonic() < deadline:
                time.sleep(0.2)
        metrics = requests.get(server.url + "/metrics", timeout=30).text
    report(cases_file, args.window)
    print("\n" + "\n".join(line for line in metrics.splitlines()
                           if line.startswith("chunkcache_audit_") and not line.startswith("chunkcache_audit_kl_error")))


def report(cases_file: Path, window: int) -> None:
    """Per window of audited requests in order: over their bound, with its interval, and the margin in force."""
    cases = [json.loads(line) for line in cases_file.read_text().splitlines() if line.strip()]
    print(f"\n{len(cases)} audited requests\n")
    print("| audited | over their bound [95 % Wilson] | margin in force (first - last) | chosen rho (mean) |")
    print("|---|---|---|---|")
    for start in range(0, len(cases), window):
        part = cases[start: start + window]
        over = sum(c["unsafe"] for c in part)
        low, high = intervals.wilson(over, len(part))
        print(f"| {start + 1}-{start + len(part)} | {over}/{len(part)} = {over / len(part):.2f} [{low:.2f}, "
              f"{high:.2f}] | {part[0]['margin']:g} - {part[-1]['margin']:g} | "
              f"{sum(c['ratio'] for c in part) / len(part):.3f} |")


if __name__ == "__main__":
    main()
