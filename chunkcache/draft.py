"""In-process draft / auxiliary model: a small HF decoder that reads the prompt and yields the features the
draft-guided selectors need (SpecCache hidden-state norms, CacheClip query attention).

`load("self", target=...)` reuses the target's own modules truncated to its first L layers: no weight is copied.
Any other name or path loads a separate model on the target's device, possibly with another tokenizer.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

KV = torch.Tensor  # [2, L, T, H_kv, D] (K post-RoPE), token-major per layer like the chunk store's entries


@dataclass
class Draft:
    model: nn.Module  # HF decoder stack without LM head (e.g. LlamaModel), possibly a truncated view
    tokenizer: Any  # None: the target's own tokenizer (same vocabulary, target ids are fed as they are)
    name: str  # what it was loaded from ("self", a model name, a file name); `fingerprint` adds depth and dtype

    @property
    def n_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def fingerprint(self) -> str:
        return f"{self.name}:{self.n_layers}:{next(self.model.parameters()).dtype}"

    @torch.no_grad()
    def importance(self, ids: torch.Tensor, deep_fraction: float = 1 / 3) -> torch.Tensor:
        """SpecCache Eq. 1: per token, the mean L2 norm of its hidden states over the deep layers D..S (the last
        `deep_fraction` of the S layers run). h^(l) is what HF's `hidden_states[l]` holds: the output of layer l,
        the last one after the final norm."""
        s = self.n_layers
        d = s - max(1, round(s * deep_fraction)) + 1
        norms: list[torch.Tensor] = []
        with _hooked(self.model.layers[d - 1 : s - 1], lambda out: norms.append(out[0].float().norm(dim=-1))):
            out = self.model(input_ids=ids[None].to(self.device), use_cache=False)
        norms.append(out.last_hidden_state[0].float().norm(dim=-1))
        return torch.stack(norms).mean(0).cpu()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, past: KV | None = None) -> KV:
        """KV of `ids` computed right after `past` (positions continue from it); `past` itself not included."""
        cache = _to_cache(past)
        start = 0 if past is None else past.shape[2]
        pos = torch.arange(start, start + ids.numel(), device=self.device)[None]
        self.model(input_ids=ids[None].to(self.device), past_key_values=cache, position_ids=pos, use_cache=True)
        return _from_cache(cache)[:, :, start:]

    @torch.no_grad()
    def query_attention(self, past: KV, query_ids: torch.Tensor) -> torch.Tensor:
        """[T_past] float: last-layer softmax attention from each query token (run after `past`) to each past
        token, averaged over query tokens and heads (CacheClip's selection signal)."""
        start = past.shape[2]
        pos = torch.arange(start, start + query_ids.numel(), device=self.device)[None]
        attn = self.model.layers[self.n_layers - 1].self_attn
        weights: list[torch.Tensor] = []
        with _eager(self.model, attn), _hooked([attn], weights.append, index=1):
            self.model(input_ids=query_ids[None].to(self.device), past_key_values=_to_cache(past), position_ids=pos)
        # [1, heads, Q, T_past + Q]: keep the past columns, average over heads and query tokens
        return weights[0][0, ..., :start].float().mean(dim=(0, 1)).cpu()


def _to_cache(kv: KV | None) -> DynamicCache:
    if kv is None:
        return DynamicCache()
    # cache layers are [B, H, T, D]
    return DynamicCache(ddp_cache_data=[(k.transpose(0, 1)[None], v.transpose(0, 1)[None]) for k, v in zip(*kv)])


def _from_cache(cache: DynamicCache) -> KV:
    ks, vs = zip(*[(k[0].transpose(0, 1), v[0].transpose(0, 1)) for k, v, *_ in cache])
    return torch.stack([torch.stack(ks), torch.stack(vs)])


@contextmanager
def _hooked(modules: Iterable[nn.Module], sink: Callable[[Any], object], index: int = 0) -> Iterator[None]:
    """Hand output[index] of each module's forward to `sink` (modules returning a bare tensor count as a
    1-tuple), for the duration of the block."""

    def hook(module, args, out):
        sink((out if isinstance(out, tuple) else (out,))[index])

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _eager(*modules: nn.Module) -> Iterator[None]:
    """Run with eager attention (the only one that returns weights, and whose masks are additive) in these
    modules, leaving the config they may share with the target untouched."""
    configs = [m.config for m in modules]
    for m in modules:
        m.config = copy.copy(m.config)
        m.config._attn_implementation = "eager"
    try:
        yield
    finally:
        for m, c in zip(modules, configs):
            m.config = c


def truncated(decoder: nn.Module, n_layers: int) -> nn.Module:
    """A view of an HF decoder stack that runs only its first n_layers: parameters and modules are shared."""
    total = len(decoder.layers)
    if not 1 <= n_layers <= total:
        raise ValueError(f"a self draft needs 1..{total} layers, got {n_layers}")
    view = copy.copy(decoder)
    view._modules = dict(decoder._modules)
    view.layers = nn.ModuleList(list(decoder.layers)[:n_layers])
    view.config = copy.copy(decoder.config)
    view.config.num_hidden_layers = n_layers
    return view


def load(
    model: str = "self",
    layers: int | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    target: nn.Module | None = None,
) -> Draft:
    """A draft from DraftConfig fields. "self" truncates `target` (an HF *ForCausalLM or decoder) to `layers`
    (default a third of its depth) and keeps its dtype and device; anything else is a model name known to
    `chunkcache.models`, an HF directory, or a .gguf file, loaded on `device` in `dtype` and run to `layers`."""
    if model == "self":
        if target is None:
            raise ValueError('the "self" draft needs the target model')
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else target
        n = layers or max(1, math.ceil(len(decoder.layers) / 3))
        return Draft(truncated(decoder, n), None, "self")
    from transformers import AutoModelForCausalLM

    where, gguf = _locate(model)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    full = AutoModelForCausalLM.from_pretrained(where, gguf_file=gguf, dtype=dtype).to(device).eval()
    decoder = full.get_decoder()
    n = layers or len(decoder.layers)
    return Draft(truncated(decoder, n), load_tokenizer(model), Path(model).name)


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    where, gguf = _locate(model)
    return AutoTokenizer.from_pretrained(where, gguf_file=gguf)


def _locate(model: str) -> tuple[Path, str | None]:
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return path.parent, path.name
    from .models import resolve_model

    return resolve_model(model), None
