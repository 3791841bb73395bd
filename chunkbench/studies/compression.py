"""Compressed KV in the disk and remote tiers (`store.compress`, chunkcache/store/codec.py): what it saves and what it
costs, per model.

* Bytes per token of a stored 400-token chunk (MuSiQue prose, the model's own KV in bfloat16): K and V as the disk
  and remote tiers write them, and the whole encoding (token ids, header) over the tokens.
* Encode and decode seconds per chunk: `wire.encode` / `wire.decode` (quantise or dequantise, serialise, checksum),
  the fastest of 5 calls: on a busy host a floor, not what one call costs.
* Why K is quantised per channel: K's and V's relative error (Frobenius) on that chunk, K per channel over 32-token
  groups (the codec) against per token over 32-channel groups (as V is).
* Quality on the reference engine (`--cases N`, SmolLM2): per case, full
  recompute, then the default selector (`mix`, stored deviations, overlap 0.15) at rho 0.15 once per codec, each in a
  store of its own whose entries are kept as the disk and remote tiers hand them back (K and V through the codec;
  `none`: as computed), the harness's warm-up included (reference_path.blend). First-token KL(full || blend) paired
  per case against `none`, with its 95 % bootstrap interval (intervals.py), and the relative change of the mean KL
  with a paired percentile-bootstrap interval; `contains`: every gold answer in the reply (needle accuracy).
  `int4-ktoken` is the alternative for K (per token, as V), measured for the comparison only.

```bash
.venv/bin/python -m chunkbench.studies.compression                                   # bytes and timings, SmolLM2-135M
.venv/bin/python -m chunkbench.studies.compression --models smollm2-135m-instruct,gemma-3-270m
OMP_NUM_THREADS=1 .venv/bin/python -m chunkbench.studies.compression --cases 30 --families multikey \
  --out results/compression-multikey.jsonl                                   # resumable: cases done are kept
.venv/bin/python -m chunkbench.studies.compression --report results/compression-*.jsonl
```
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from tqdm import tqdm

from chunkcache.config import SelectConfig
from chunkcache.cpu_dtype import best_seconds
from chunkcache.store import ChunkEntry, ChunkStore
from chunkcache.store.codec import TENSORS, Codec, named
from chunkcache.store.wire import decode, encode
from .. import intervals, scoring
from ..serving.ab import first_line
from ..workloads import DEFAULT_MUSIQUE, WorkloadConfig, items, musique_paragraphs

CHUNK_TOKENS = 400
RATIO = 0.15
# the families of the project's quality tables, with their documents (docs/bench/eval_select.md, realkey.md)
FAMILIES = {"multikey": WorkloadConfig("synthetic:multikey", docs=3, words=250),
            "realkey": WorkloadConfig("synthetic:realkey", docs=8, words=110),
            "musique": WorkloadConfig("musique", docs=5, words=120)}


class KeysPerToken(Codec):
    """The alternative for K, measured against the codec's choice: K per token over channel groups, as V."""

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(TENSORS, (*self.per_token(k), *self.per_token(v))))

    def decode(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(self.from_per_token(t[n], t[f"{n}_scale"], t[f"{n}_zero"]).to(dtype) for n in ("k", "v"))


CODECS: dict[str, Codec | None] = {"none": None, "int8": named("int8"), "int4": named("int4"),
                                   "int4-ktoken": KeysPerToken(4)}


# --- bytes and seconds per chunk -------------------------------------------------------------------------------------

def chunk_entry(model_name: str) -> ChunkEntry:
    """The model's bfloat16 KV of CHUNK_TOKENS tokens of MuSiQue prose (computed right after nothing)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chunkcache.models import resolve_model

    path = resolve_model(model_name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("\n\n".join(musique_paragraphs(DEFAULT_MUSIQUE)[:20]), return_tensors="pt").input_ids
    ids = ids[:, :CHUNK_TOKENS]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    layers = [(k[0].transpose(0, 1), v[0].transpose(0, 1)) for k, v, *_ in cache]  # [T, H, D] each
    return ChunkEntry(key="0" * 32, token_ids=ids[0], k=torch.stack([k for k, _ in layers]).contiguous(),
                      v=torch.stack([v for _, v in layers]).contiguous(), start_pos=0, model_fingerprint="bench")


def chunk_costs(entry: ChunkEntry) -> list[dict]:
    """Bytes per token and the fastest of 5 encodes and decodes of `entry` through each shipped codec."""
    rows = []
    for name in ("none", "int8", "int4"):
        codec = CODECS[name]
        kv = {"k": entry.k, "v": entry.v} if codec is None else codec.encode(entry.k, entry.v)
        data = encode(entry, codec)
        rows.append({"codec": name, "kv_bytes_per_token": sum(t.nbytes for t in kv.values()) / entry.num_tokens,
                     "encoding_bytes_per_token": len(data) / entry.num_tokens,
                     "encode_s": best_seconds(lambda: encode(entry, codec), 5),
                     "decode_s": best_seconds(lambda: decode(data), 5)})
    return rows


def key_axis(entry: ChunkEntry) -> list[dict]:
    """Relative error of K and V through each codec (and through K per token, the alternative)."""
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    rows = []
    for name in ("int8", "int4"):
        for label, codec in ((name, CODECS[name]), (f"{name}-ktoken", KeysPerToken(int(name[3:])))):
            k, v = codec.decode(codec.encode(entry.k, entry.v), entry.dtype)
            rows.append({"codec": label, "k_error": rel(k, entry.k), "v_error": rel(v, entry.v)})
    return rows


# --- quality on the reference engine ---------------------------------------------------------------------------------

class DecodedStore(ChunkStore):
    """Entries kept as the disk and remote tiers hand them back: K and V through `codec` on their way in."""

    def __init__(self, codec: Codec):
        super().__init__()
        self.codec = codec

    def put(self, entry: ChunkEntry) -> bool:
        k, v = self.codec.decode(self.codec.encode(entry.k, entry.v), entry.dtype)
        return super().put(replace(entry, k=k, v=v))


def quality(families: list[str], cases: int, codecs: list[str], out: Path,
            model: str = "smollm2-135m-instruct") -> None:
    from chunkcache.reference import ReferenceBlender
    from ..quality.reference_path import ReferenceMeasure

    done = {(r["family"], r["item"], r["codec"]) for r in read_rows([out])} if out.is_file() else set()
    options = SelectConfig().options["mix"]  # the server's default: stored deviations, overlap 0.15
    measure = ReferenceMeasure(ReferenceBlender.from_pretrained(model), max_new_tokens=24)
    out.parent.mkdir(parents=True, exist_ok=True)
    for family in families:
        pool = items(replace(FAMILIES[family], requests=cases))
        todo = [it for it in pool if any((family, it.id, c) not in done for c in ["full", *codecs])]
        for item in tqdm(todo, desc=f"compression quality {family}", unit="case", initial=len(pool) - len(todo),
                         total=len(pool)):
            ref, full = measure.full(item)  # the reference every blend is measured against, kept or not
            rows = [_row(family, item, "full", full)] if (family, item.id, "full") not in done else []
            for name in (c for c in codecs if (family, item.id, c) not in done):  # a resumed file gains only what it lacks
                codec = CODECS[name]
                measure.blender.store = ChunkStore() if codec is None else DecodedStore(codec)
                rows.append(_row(family, item, name, measure.blended(ref, "mix", RATIO, options)))
            with out.open("a") as f:  # a case's rows land together or not at all
                f.writelines(json.dumps(r) + "\n" for r in rows)


def _row(family: str, item, codec: str, fields: dict) -> dict:
    line = scoring.normalize(first_line(fields["text"]))
    return {"family": family, "item": item.id, "codec": codec, "kl_first": fields["kl_first"],
            "tf_agreement": fields["tf_agreement"], "blend_s": fields.get("blend_s"),
            "contains": float(all(scoring.normalize(a) in line for a in item.answers)), "text": fields["text"]}


def read_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a run killed mid-write: its last case is measured again
                pass
    return rows


def relative_interval(base: list[float], other: list[float]) -> tuple[float, float]:
    """Paired percentile-bootstrap interval of mean(other) / mean(base) - 1 (cases resampled together)."""
    res = stats.bootstrap((np.asarray(base), np.asarray(other)), lambda a, b, axis: b.mean(axis) / a.mean(axis) - 1,
                          paired=True, vectorized=True, n_resamples=intervals.RESAMPLES, method="percentile",
                          confidence_level=intervals.CONFIDENCE, rng=np.random.default_rng(intervals.SEED))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def quality_table(rows: list[dict]) -> list[str]:
    by: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        by.setdefault((r["family"], r["codec"]), {})[r["item"]] = r
    lines = ["| family | codec | n | KL first token | KL - none per case | relative | cases better | contains |",
             "|---|---|---|---|---|---|---|---|"]
    for family in dict.fromkeys(f for f, _ in by):
        base = by.get((family, "none"), {})
        for codec in ["full", *CODECS]:
            mine = by.get((family, codec))
            if not mine:
                continue
            cases = sorted(set(mine) & set(base)) if codec not in ("full", "none") else sorted(mine)
            kl = [mine[c]["kl_first"] for c in cases]
            contains = sum(mine[c]["contains"] for c in cases) / len(cases)
            cells = [family, codec, str(len(cases)), _ci(kl, 4) if codec != "full" else "0", "", "", "",
                     f"{contains:.2f}"]
            if codec not in ("full", "none"):
                b = [base[c]["kl_first"] for c in cases]
                diff = [x - y for x, y in zip(kl, b)]
                low, high = relative_interval(b, kl) if len(cases) > 1 else (math.nan, math.nan)
                cells[4] = _ci(diff, 4, signed=True)
                cells[5] = f"{sum(diff) / sum(b):+.1%} [{low:+.1%}, {high:+.1%}]"
                cells[6] = f"{sum(d < 0 for d in diff)} of {len(cases)}"
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ci(values: list[float], digits: int, signed: bool = False) -> str:
    low, high = intervals.mean_interval(values)
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    return f"{f.format(sum(values) / len(values))} [{f.format(low)}, {f.format(high)}]"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.studies.compression", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct",
                    help="comma-separated, for bytes and timings ('': none, the quality run only)")
    ap.add_argument("--cases", type=int, default=0, help="quality: cases per family (0: no quality run)")
    ap.add_argument("--families", default="multikey,realkey,musique")
    ap.add_argument("--codecs", default="none,int8,int4", help=f"quality: of {', '.join(CODECS)}; none is the base")
    ap.add_argument("--out", type=Path, default=Path("results/compression.jsonl"), help="quality rows (resumable)")
    ap.add_argument("--report", type=Path, nargs="*", help="only print the quality table of these row files")
    args = ap.parse_args()
    if args.report:
        print("\n".join(quality_table(read_rows(args.report))))
        return
    print(f"host: {_cpu_model()}, {torch.get_num_threads()} torch threads\n")
    for model in filter(None, args.models.split(",")):
        entry = chunk_entry(model)
        L, T, H, D = entry.k.shape
        print(f"### {model}: {L} layers, {H} KV heads, head_dim {D}, {entry.dtype}, a {T}-token chunk\n")
        print("| codec | K+V bytes/token | encoding bytes/token | of none | encode s/chunk | decode s/chunk |")
        print("|---|---|---|---|---|---|")
        rows = chunk_costs(entry)
        for r in rows:
            print(f"| {r['codec']} | {r['kv_bytes_per_token']:,.0f} | {r['encoding_bytes_per_token']:,.0f} | "
                  f"{r['encoding_bytes_per_token'] / rows[0]['encoding_bytes_per_token']:.3f} | {r['encode_s']:.4f} | "
                  f"{r['decode_s']:.4f} |")
        print("\n| codec | K relative error | V relative error |\n|---|---|---|")
        for r in key_axis(entry):
            print(f"| {r['codec']} | {r['k_error']:.4f} | {r['v_error']:.4f} |")
        print()
    if args.cases:
        codecs = args.codecs.split(",")
        quality(args.families.split(","), args.cases, codecs, args.out)
        print("\n".join(quality_table(read_rows([args.out]))))


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
