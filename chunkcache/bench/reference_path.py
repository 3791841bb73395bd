"""The reference blender as the quality harness uses it (benchmarks/selector_quality.py, `chunkcache eval`):
selector rows with options and drafts, blends timed as for chunks seen before, greedy answers."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..prompt import RagPrompt
from ..reference import BlendResult, ReferenceBlender

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
    """One blend. Selectors that keep per-chunk data in the store (clip, per_chunk) run twice, so the one that
    counts is timed as for a chunk seen before."""
    warm = name == "clip" or bool(options.get("per_chunk"))
    for _ in range(1 + warm):
        result = blender.blend(*parts, selector=name, ratio=ratio, **options)
    return result


def blend_seconds(result: BlendResult) -> float:
    """The blend's time with its chunks already stored (computing and storing missed chunks left out)."""
    t = result.timings
    return t["total"] - t.get("compute_chunks", 0.0) - t.get("store", 0.0)


def answer(blender: ReferenceBlender, result: BlendResult, max_new_tokens: int) -> str:
    return blender.tokenizer.decode(blender.generate(result, max_new_tokens), skip_special_tokens=True)
