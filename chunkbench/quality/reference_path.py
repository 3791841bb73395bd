"""The reference blender as the quality harness uses it (chunkbench/quality/selector_quality.py, `chunkcache eval`):
selector rows with options and drafts, blends timed as for chunks seen before, greedy answers, and the fidelity of
each blend to full recompute."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from chunkcache.prompt import RagPrompt
from chunkcache.reference import BlendResult, ReferenceBlender
from ..workloads import Item, to_request
from . import fidelity_measures

Run = tuple[str, str, dict]  # (label, selector name, selector options)


def selector_runs(selectors: list[str], drafts: list[str], blender: ReferenceBlender) -> list[Run]:
    """One row per selector item; an item may carry options, `spec:per_chunk=true,max_span=8`. Draft-guided
    selectors get one row per draft (self, self:LAYERS, a model name, an HF directory or a .gguf file), loaded up
    front."""
    runs = []
    for item in selectors:
        name, _, opts = item.partition(":")
        options = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in opts.split(",") if o)}
        if name not in ("spec", "clip"):
            runs.append((item, name, options))
            continue
        for d in drafts:
            draft = load_draft(blender, d)
            label = item if len(drafts) == 1 else f"{item}[{Path(d.partition(':')[0]).name}:{draft.n_layers}]"
            runs.append((label, name, {**options, "draft": draft}))
    return runs


def load_draft(blender: ReferenceBlender, spec: str):
    """`model[:LAYERS]` as --drafts names it."""
    model, _, layers = spec.partition(":")
    return blender.draft(model, int(layers) if layers else None)


def split(prompt: RagPrompt) -> tuple[list[int], list[list[int]], list[int]]:
    """(prefix, chunks, query) ids of a built prompt, as the reference blender takes them."""
    ids, spans = prompt.input_ids, prompt.token_spans
    return ids[: spans[0][0]], [ids[s:e] for s, e in spans], ids[spans[-1][1]:]


def blend(blender: ReferenceBlender, parts, name: str, ratio: float, options: dict) -> BlendResult:
    """One blend (`cold=true`: a chunk's first blend, _blend_cold). Selectors that keep per-chunk data in the store
    (clip, per_chunk) run twice, so the one that counts is timed as for a chunk seen before. A deviation the chunks
    remember (mix's stored_deviation) is warmed in two other orders instead: the same order would store the very
    deviation the measured blend then reads, which a server sees only when a prompt repeats, not when its chunks
    come back reordered."""
    if options.get("cold"):
        return _blend_cold(blender, parts, name, ratio, {k: v for k, v in options.items() if k != "cold"})
    if options.get("stored_deviation"):
        return _blend_stored_deviation(blender, parts, name, ratio, options)
    warm = name == "clip" or bool(options.get("per_chunk"))
    for _ in range(1 + warm):
        result = blender.blend(*parts, selector=name, ratio=ratio, **options)
    return result


def _blend_cold(blender: ReferenceBlender, parts, name: str, ratio: float, options: dict) -> BlendResult:
    """`cold=true` (the harness's option, not the selector's): the chunks' first blend anywhere, in a store of its
    own, so every chunk but the first is away from home with nothing remembered (mix's first reuse)."""
    from chunkcache.store import ChunkStore

    kept, blender.store = blender.store, ChunkStore()
    try:
        return blender.blend(*parts, selector=name, ratio=ratio, **options)
    finally:
        blender.store = kept


def _blend_stored_deviation(blender: ReferenceBlender, parts, name: str, ratio: float, options: dict) -> BlendResult:
    remember_deviations(blender, parts, name, ratio, options)
    result = blender.blend(*parts, selector=name, ratio=ratio, **options)
    if "kv_deviation" in result.passes:
        raise RuntimeError(f"the measured blend of {len(parts[1])} chunks ran the deviation pass: some chunk had no "
                           "stored deviation after the warm-up")
    return result


def remember_deviations(blender: ReferenceBlender, parts, selector, ratio: float, options: dict) -> None:
    """The chunks' stored deviations for a blend of `parts` (selector: a name with `options`, or an instance with
    none), from two other orders: reversed, then rotated by one. The reversed order stores every chunk but the last,
    each measured after the chunks that follow it in the measured prompt (none of those that precede it there); the
    rotation stores the last, measured after all the others but the first. The measured prompt's first chunk is at
    home there (exact KV, no deviation needed). Two chunks have no such orders (rotating is reversing): the measured
    blend would measure its own deviation, and is refused."""
    prefix, chunks, query = parts
    for order in (chunks[::-1], chunks[1:] + chunks[:1]):
        blender.blend(prefix, order, query, selector=selector, ratio=ratio, **options)


def blend_seconds(result: BlendResult) -> float:
    """The blend's time with its chunks already stored: a blend that missed chunks has its whole fill (the exact
    prefix's with the chunks') and their storing left out."""
    t = result.timings
    return t["total"] - (t.get("fill", 0.0) if result.chunk_misses else 0.0) - t.get("learn", 0.0)


def rho_used(result: BlendResult) -> float:
    """The share of the reused context the blend recomputed: the request's rho, or the one an adaptive budget chose."""
    ctx = result.layout.context_mask()
    return int(ctx[result.recomputed].sum()) / max(int(ctx.sum()), 1)


def answer(blender: ReferenceBlender, result: BlendResult, max_new_tokens: int) -> str:
    return blender.tokenizer.decode(blender.generate(result, max_new_tokens), skip_special_tokens=True)


def greedy_ids(blender: ReferenceBlender, result: BlendResult, reference: list[int],
               max_new_tokens: int, forced_logits: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """(the blend's greedy answer, its argmax at each position of `reference` teacher-forced): `reference` itself
    when the two argmaxes agree at every position (greedy decoding would produce the same tokens, one pass instead
    of one per token), else decoded step by step. `forced_logits`: the result's teacher_forced_logits on
    `reference`, when the caller has them already."""
    if forced_logits is None:
        forced_logits = blender.teacher_forced_logits(result, reference)
    forced = forced_logits.argmax(-1).tolist()
    ids = list(reference) if forced == list(reference) else blender.generate(result, max_new_tokens)
    return ids, forced


def kl_logits(full: torch.Tensor, blended: torch.Tensor) -> float:
    """Exact KL(full || blended) in nats of the next-token distributions of two logit vectors."""
    p, q = full.double().log_softmax(-1), blended.double().log_softmax(-1)
    return max(float((p.exp() * (p - q)).sum()), 0.0)


@dataclass
class FullRecompute:
    """Full prefill of one case: what its blends are measured against."""
    parts: tuple[list[int], list[list[int]], list[int]]
    result: BlendResult
    continuation: list[int]  # greedy answer token ids


class ReferenceMeasure:
    """`chunkcache eval` rows of the reference path: answer text, teacher-forced agreement and first-token KL
    against full recompute, timings."""

    def __init__(self, blender: ReferenceBlender, max_new_tokens: int):
        self.blender = blender
        self.max_new_tokens = max_new_tokens

    def full(self, item: Item) -> tuple[FullRecompute, dict]:
        b = self.blender
        parts = split(to_request(b.tokenizer, item).prompt)
        result = b.full_prefill(*parts)
        ref = FullRecompute(parts, result, b.generate(result, self.max_new_tokens))
        # measured like any blend: a real check of the teacher-forced pass against step-by-step greedy decoding
        forced = b.teacher_forced_logits(result, ref.continuation).argmax(-1).tolist()
        return ref, self._fields(result, ref.continuation, forced, ref, full_s=result.timings["total"],
                                 tokens=result.layout.n, rho_used=1.0)

    def blended(self, ref: FullRecompute, name: str, ratio: float, options: dict) -> dict:
        res = blend(self.blender, ref.parts, name, ratio, options)
        return self.measured(res, ref, select_s=res.timings["features"] + res.timings["select"],
                             blend_s=blend_seconds(res), full_s=ref.result.timings["total"],
                             recomputed=int(res.recomputed.numel()), rho_used=rho_used(res))

    def measured(self, res: BlendResult, ref: FullRecompute, **timings) -> dict:
        """A blend's row: its greedy answer, agreement and first-token KL against `ref`, and `timings`."""
        return self._fields(res, *greedy_ids(self.blender, res, ref.continuation, self.max_new_tokens), ref, **timings)

    def _fields(self, res: BlendResult, ids: list[int], forced: list[int], ref: FullRecompute, **timings) -> dict:
        return {"text": self.blender.tokenizer.decode(ids, skip_special_tokens=True),
                "tf_agreement": fidelity_measures.agreement(forced, ref.continuation),
                "kl_first": kl_logits(ref.result.logits, res.logits), **timings}
