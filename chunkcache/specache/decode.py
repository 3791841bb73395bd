"""Reference SpeCache decoding over an HF transformers Llama / Qwen2 model, one sequence, and the full-precision
greedy decoding it is measured against.

The prompt is prefilled by the unmodified HF forward; its post-RoPE K and V (what SGLang's pool stores) go into
one `LayerCache` per layer. Then (Alg. 2) the first output token x_1 runs alone over that cache: its logits give
the first speculative token s_1, its attention the pairs to prefetch for step 1; its KV is not kept (step 1 feeds
it again). Each step t (Alg. 3) feeds [x_t, s_t] through every layer with `speculative_attention`; per layer,
x_t's K/V are appended (quantised once its group leaves the residual window), s_t's are dropped, and row 1's
top-k becomes that layer's prefetched set for step t+1. Row 0's logits give x_{t+1}, row 1's s_{t+1}. Decoding
is greedy, as the speculative row needs a single guess.

The layer loop calls the HF modules themselves (norms, projections, rotary embedding, MLP), so a difference from
`greedy` comes from the cache alone; with `topk` at least the prompt length every low-bit pair is replaced by its
full-precision one and the tokens are those of `greedy`.

`probe=True` also measures, per step and layer, how many of the exact top-k (x_t's query against every
full-precision key) the prefetched set holds, for the speculative choice and for the stale one (x_{t-1}'s
attention, the cheaper one-row alternative).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import SpeCacheConfig
from ..rope import rotate_half
from .layer_cache import LayerCache, full_bytes
from .step import select_topk, speculative_attention

SUPPORTED_MODELS = ("llama", "qwen2")


@dataclass
class Prefill:
    tokens: list[int]  # the prompt
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: post-RoPE K and V [N, Hkv, D]
    logits: torch.Tensor  # [vocab] float32, after the last prompt token


@dataclass
class Generation:
    tokens: list[int]  # greedy output, ending at the first EOS or at max_new_tokens
    logits: torch.Tensor  # [len(tokens), vocab] float32: row i is what tokens[i] was taken from


@dataclass
class SpeCacheRun(Generation):
    guesses: list[int] = field(default_factory=list)  # guesses[i]: the speculative token guessing tokens[i + 1]
    read_bytes: list[int] = field(default_factory=list)  # per decode step, all layers: device pool read by attention
    fetch_bytes: list[int] = field(default_factory=list)  # per decode step, all layers: host -> device prefetch
    hits: list[float] = field(default_factory=list)  # probe: per step with a choice, mean over layers and KV heads
    stale_hits: list[float] = field(default_factory=list)  # probe: the same for x_{t-1}'s top-k
    device_bytes: int = 0  # the device pool at the end, all layers
    full_bytes: int = 0  # 16-bit KV of the same tokens, all layers

    def speculative_match(self) -> tuple[int, int]:
        """(guesses equal to the token they guessed, guesses made)."""
        pairs = list(zip(self.guesses, self.tokens[1:]))
        return sum(g == t for g, t in pairs), len(pairs)


def check_model(model) -> None:
    config = model.config
    if config.model_type not in SUPPORTED_MODELS:
        raise ValueError(f"SpeCache decoding supports model types {SUPPORTED_MODELS}, not {config.model_type!r}")
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError("SpeCache decoding does not support sliding-window attention layers")


@torch.inference_mode()
def prefill(model, token_ids: list[int]) -> Prefill:
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([token_ids], device=device), use_cache=True, logits_to_keep=1)
    kv = [(k[0].transpose(0, 1), v[0].transpose(0, 1)) for k, v, *_ in out.past_key_values]
    return Prefill(list(token_ids), kv, out.logits[0, -1].float())


@torch.inference_mode()
def greedy(model, pre: Prefill, max_new_tokens: int) -> Generation:
    """Full-precision greedy decoding through the HF forward, continuing `pre`."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache([(k.transpose(0, 1)[None], v.transpose(0, 1)[None]) for k, v in pre.kv], config=model.config)
    eos = _eos(model)
    logits = [pre.logits]
    tokens = [int(pre.logits.argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        step = model(input_ids=torch.tensor([[tokens[-1]]], device=device), past_key_values=cache, use_cache=True)
        logits.append(step.logits[0, -1].float())
        tokens.append(int(logits[-1].argmax()))
    return Generation(tokens, torch.stack(logits))


class SpeCacheDecoder:
    def __init__(self, model, cfg: SpeCacheConfig):
        check_model(model)
        self.model, self.cfg = model.eval(), cfg
        config = model.config
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.max_len = config.max_position_embeddings
        self.eos = _eos(model)

    @torch.inference_mode()
    def generate(self, pre: Prefill, max_new_tokens: int, probe: bool = False) -> SpeCacheRun:
        n = len(pre.tokens)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if n + max_new_tokens + 1 > self.max_len:  # the last step's speculative row sits one past the output
            raise ValueError(f"{n} prompt + {max_new_tokens} new tokens exceed the model's context of {self.max_len}")
        weights = next(self.model.parameters())
        caches = []
        for k, v in pre.kv:
            cache = LayerCache(self.cfg, self.n_kv_heads, self.head_dim, n + max_new_tokens, weights.dtype,
                               weights.device)
            cache.append(k, v)
            caches.append(cache)
        run = SpeCacheRun(tokens=[int(pre.logits.argmax())], logits=pre.logits[None])
        logits = [pre.logits]
        stale: list[torch.Tensor | None] = [None] * len(caches)
        s = int(self._forward([run.tokens[0]], caches, run, stale if probe else None, append=False)[0].argmax())
        run.guesses.append(s)
        while len(run.tokens) < max_new_tokens and run.tokens[-1] not in self.eos:
            out = self._forward([run.tokens[-1], s], caches, run, stale if probe else None, append=True)
            logits.append(out[0])
            run.tokens.append(int(out[0].argmax()))
            s = int(out[1].argmax())
            run.guesses.append(s)
        run.guesses.pop()  # the last guess is of a token never produced
        run.logits = torch.stack(logits)
        run.device_bytes = sum(c.device_bytes() for c in caches)
        run.full_bytes = caches[0].n * full_bytes(self.n_kv_heads, self.head_dim) * len(caches)
        return run

    def _forward(self, ids: list[int], caches: list[LayerCache], run: SpeCacheRun,
                 stale: list[torch.Tensor | None] | None, append: bool) -> torch.Tensor:
        """Rows `ids` at the positions after the cache through every layer; returns their logits [M, vocab].
        With `append` (a decode step), row 0's K/V join the cache and the step's bytes (and, with `stale`, its
        probes) are recorded."""
        inner = self.model.model
        M, n = len(ids), caches[0].n
        device = caches[0].full_k.device
        h = inner.embed_tokens(torch.tensor([ids], device=device))
        cos, sin = inner.rotary_emb(h, torch.arange(n, n + M, device=device)[None])
        cos, sin = cos[0, :, None], sin[0, :, None]  # [M, 1, D] broadcasts over heads
        read = fetched = 0
        hits, stale_hits = [], []
        for l, (layer, cache) in enumerate(zip(inner.layers, caches)):
            attn = layer.self_attn
            x = layer.input_layernorm(h)[0]
            q = attn.q_proj(x).view(M, self.n_heads, self.head_dim)
            k = attn.k_proj(x).view(M, self.n_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(M, self.n_kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if append and stale is not None:
                oracle = self._exact_topk(cache, q, k, v, attn.scaling)
                if oracle.numel():  # nothing low-bit yet, or topk 0: there is no choice to score
                    hits.append(_overlap(cache.prefetched, oracle))
                    stale_hits.append(_overlap(stale[l], oracle))
            read += cache.attention_read_bytes()
            out, probs = speculative_attention(q, k, v, *cache.view(), attn.scaling)
            if append:
                cache.append(k[:1], v[:1])
            fetched += cache.prefetch(select_topk(probs[-1], cache.quantised, self.cfg.topk))
            if stale is not None:
                stale[l] = select_topk(probs[0], cache.quantised, self.cfg.topk)
            h = h + attn.o_proj(out.reshape(1, M, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if append:
            run.read_bytes.append(read)
            run.fetch_bytes.append(fetched)
            if hits:
                run.hits.append(sum(hits) / len(hits))
                run.stale_hits.append(sum(stale_hits) / len(stale_hits))
        return self.model.lm_head(inner.norm(h))[0].float()

    def _exact_topk(self, cache: LayerCache, q, k, v, scale: float) -> torch.Tensor:
        """The top-k of x_t's attention over the full-precision cache, among the tokens that are low-bit now."""
        _, probs = speculative_attention(q[:1], k[:1], v[:1], cache.full_k[: cache.n], cache.full_v[: cache.n], scale)
        return select_topk(probs[0], cache.quantised, self.cfg.topk)


def _overlap(picked: torch.Tensor, exact: torch.Tensor) -> float:
    """Share of the exact top-k [H, k] found in `picked` [H, k'], averaged over heads."""
    found = (exact[:, :, None] == picked[:, None, :]).any(-1).float().mean(-1)
    return float(found.mean())


def _eos(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
