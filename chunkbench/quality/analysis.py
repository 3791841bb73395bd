"""The two analyses SpecCache uses to justify a deep, draft-guided selector, on the reference blender:

* layer-wise KV deviation (Fig. 2): cosine distance between naively reused chunk KV (selector `none`: every
  context token from the store) and fully recomputed KV, per layer, averaged over context tokens;
* top-20 % overlap (Fig. 3): Jaccard similarity between the context tokens a draft ranks highest (SpecCache's
  deep hidden-state norm, Eq. 1) and those the target's own deep layers rank highest, next to the shallow-deep
  baseline inside the target (hidden-state norm at one layer vs the deep average, and layer 1 vs deeper layers).
"""

from __future__ import annotations

import math

import torch
from tqdm import tqdm

from ..workloads import to_request

TOP = 0.2


def analyse(config, pool) -> dict:
    from chunkcache.reference import ReferenceBlender
    from .reference_path import load_draft, split

    blender = ReferenceBlender.from_pretrained(config.model)
    drafts = {d: load_draft(blender, d) for d in config.drafts}
    n_layers = blender.n_layers
    probe = sorted({1, max(1, n_layers // 3), max(1, 2 * n_layers // 3), n_layers})
    dev_k, dev_v, overlaps = [], [], {}
    for item in tqdm(pool, desc="analyses", unit="case"):
        parts = split(to_request(blender.tokenizer, item).prompt)
        full = blender.full_prefill(*parts)
        reused = blender.blend(*parts, selector="none")
        ctx = full.layout.context_mask()
        k, v = _deviation(full.past_key_values, reused.past_key_values, ctx)
        dev_k.append(k)
        dev_v.append(v)
        layers = _layer_norms(blender, full.layout.token_ids)  # [L, N]: hidden-state norm after each layer
        deep = layers[n_layers - max(1, round(n_layers / 3)):].mean(0)
        pairs = {f"target L{p} vs target deep": layers[p - 1] for p in probe}
        for name, draft in drafts.items():
            # the spec selector's scores: the draft's Eq. 1 importance, projected onto target tokens
            scores = blender.blend(*parts, selector="spec", ratio=TOP, draft=draft).scores
            pairs[f"draft {name} ({draft.n_layers} layers) vs target deep"] = scores
        for label, scores in pairs.items():
            overlaps.setdefault(label, []).append(jaccard(scores, deep, ctx))
        for p in probe[1:]:
            overlaps.setdefault(f"target L1 vs target L{p}", []).append(jaccard(layers[0], layers[p - 1], ctx))
    return {
        "kv_deviation": {"k": torch.tensor(dev_k).mean(0).tolist(), "v": torch.tensor(dev_v).mean(0).tolist()},
        "jaccard_top20": {label: sum(v) / len(v) for label, v in overlaps.items()},
    }


def jaccard(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, top: float = TOP) -> float:
    """Jaccard similarity of the top `top` share of the masked tokens under scores a and b."""
    idx = mask.nonzero().flatten()
    k = max(1, math.ceil(top * idx.numel()))
    sa = set(idx[a.float()[idx].topk(k).indices].tolist())
    sb = set(idx[b.float()[idx].topk(k).indices].tolist())
    return len(sa & sb) / len(sa | sb)


def _deviation(full_cache, reused_cache, ctx: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per layer, mean over context tokens of 1 - cos(full, reused), heads flattened; for K and for V."""
    ks, vs = [], []
    for (kf, vf, *_), (kr, vr, *_) in zip(full_cache, reused_cache):
        for out, f, r in ((ks, kf, kr), (vs, vf, vr)):
            f, r = (x[0].transpose(0, 1).flatten(1).float() for x in (f, r))  # [B,H,T,D] -> [T, H*D]
            out.append(max(0.0, float((1 - torch.nn.functional.cosine_similarity(f, r, dim=1))[ctx].mean())))
    return ks, vs


@torch.inference_mode()
def _layer_norms(blender, ids: torch.Tensor) -> torch.Tensor:
    out = blender.model(input_ids=ids[None].to(blender.device), output_hidden_states=True, logits_to_keep=1)
    return torch.stack([h[0].float().norm(dim=-1) for h in out.hidden_states[1:]]).cpu()


def markdown(analyses: dict) -> str:
    dev = analyses["kv_deviation"]
    n = len(dev["k"])
    step = max(1, n // 10)
    shown = sorted(set(range(0, n, step)) | {n - 1})
    lines = ["#### Layer-wise KV deviation, naive reuse vs full recompute (mean cosine distance over context tokens)",
             "", "| layer | " + " | ".join(str(i + 1) for i in shown) + " |", "|---|" + "---|" * len(shown),
             "| K | " + " | ".join(f"{dev['k'][i]:.4f}" for i in shown) + " |",
             "| V | " + " | ".join(f"{dev['v'][i]:.4f}" for i in shown) + " |", "",
             f"#### Jaccard overlap of the top-{TOP:.0%} context tokens", "",
             # two independent random top-p sets overlap by p^2 n, so their Jaccard is about p / (2 - p)
             f"Two random top-{TOP:.0%} sets would score {TOP / (2 - TOP):.3f}.", "",
             "| pair | Jaccard |", "|---|---|"]
    lines += [f"| {label} | {value:.3f} |" for label, value in analyses["jaccard_top20"].items()]
    return "\n".join(lines)
