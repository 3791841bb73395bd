"""Pure-PyTorch blended prefill on HF transformers Llama / Qwen2 models: the oracle for tests, the CPU quality harness.

One request is `[prefix][chunk 1]...[chunk k][query]`. Its KV lives in one buffer per layer whose slot index is
the token's position in the prompt. The prefix KV is computed exactly; each chunk's KV comes from the store
(computed once for the chunk alone right after the same prefix) with K re-rotated to where the chunk now sits;
then the selected tokens run through every layer, layer by layer, as a sparse query set: at each layer their fresh
K/V overwrite their slots first, then each attends to every slot at or before its own position. So a recomputed
token sees the reused KV of unselected tokens and the fresh KV of selected ones, never a later token, and the cost
is O(M * N) for M selected tokens, not O(N^2).

The layer loop calls the HF modules themselves (projections, norms, MLP, rotary embedding), so any numeric
difference from `full_prefill` (the unmodified HF forward) comes from the blending alone.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import select as selectors
from .align import decode_with_offsets
from .draft import Draft
from .draft import load as load_draft
from .hashing import chunk_key, model_fingerprint, prefix_key
from .rope import RopeSpec, rerotate, rotate_half
from .select.base import Features, Layout, Selector
from .store import ChunkEntry, ChunkStore

SUPPORTED_MODELS = ("llama", "qwen2")
# padded tokens per batch when computing missing chunks; bounds the batch's KV buffer
CHUNK_BATCH_TOKENS = 8192
# attention scores materialised at once (query rows x keys x heads); bounds memory on long prompts
ATTENTION_TILE_ELEMENTS = 1 << 24

TokenIds = Sequence[int] | torch.Tensor


@dataclass
class BlendResult:
    logits: torch.Tensor  # [vocab] float32: next-token logits after the last prompt token
    recomputed: torch.Tensor  # [M] int64, sorted prompt indices whose KV was computed in this prompt's context
    reused_tokens: int  # chunk tokens whose KV came from the store, re-rotated and not recomputed
    past_key_values: object  # transformers DynamicCache holding the whole prompt; `generate` continues from it
    layout: Layout
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage, and "total"
    chunk_hits: int = 0  # chunks found in the store
    chunk_misses: int = 0  # chunks computed standalone (and inserted)
    scores: torch.Tensor | None = None  # the selector's per-token scores, if it has any


class ReferenceBlender:
    def __init__(self, model, model_dir: str | os.PathLike, store: ChunkStore | None = None, namespace: str = "default"):
        config = model.config
        if config.model_type not in SUPPORTED_MODELS:
            raise ValueError(f"model type {config.model_type!r} is not supported; expected one of {SUPPORTED_MODELS}")
        if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
            raise ValueError("sliding-window attention layers are not supported by the reference blender")
        self.rope = RopeSpec.from_config(config)
        self.model = model.eval()
        self.config = config
        self.model_dir = str(model_dir)
        self.fingerprint = model_fingerprint(model_dir)
        self.store = store if store is not None else ChunkStore(model_fingerprint=self.fingerprint)
        self.namespace = namespace
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = self.rope.head_dim
        self.max_len = config.max_position_embeddings
        self._tokenizer = None
        self._drafts: dict[tuple[str, int | None], Draft] = {}

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | os.PathLike,
        store: ChunkStore | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        namespace: str = "default",
    ) -> "ReferenceBlender":
        """`model_path`: a model name known to `chunkcache.models` or an HF model directory."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from .models import resolve_model

        path = resolve_model(model_path)
        RopeSpec.from_config(AutoConfig.from_pretrained(path))  # refuse an unsupported RoPE before loading weights
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, path, store=store, namespace=namespace)

    # ---- public API -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def full_prefill(self, prefix_ids: TokenIds, chunks_ids: Sequence[TokenIds], query_ids: TokenIds) -> BlendResult:
        """The unmodified HF forward over the whole prompt: what blending is measured against."""
        t0 = time.perf_counter()
        layout = self._layout(prefix_ids, chunks_ids, query_ids)
        out = self.model(input_ids=layout.token_ids[None].to(self.device), use_cache=True, logits_to_keep=1)
        total = time.perf_counter() - t0
        return BlendResult(
            logits=out.logits[0, -1].float(),
            recomputed=torch.arange(layout.n),
            reused_tokens=0,
            past_key_values=out.past_key_values,
            layout=layout,
            timings={"prefill": total, "total": total},
        )

    @torch.inference_mode()
    def blend(
        self,
        prefix_ids: TokenIds,
        chunks_ids: Sequence[TokenIds],
        query_ids: TokenIds,
        selector: str | Selector = "none",
        ratio: float = 0.15,
        **selector_options,
    ) -> BlendResult:
        t_start = time.perf_counter()
        timings: dict[str, float] = {}
        layout = self._layout(prefix_ids, chunks_ids, query_ids)
        if isinstance(selector, str):
            selector = selectors.create(selector, **selector_options)
        elif selector_options:
            raise ValueError("selector options go to the selector's constructor; pass a name, not an instance")
        ids = layout.token_ids.to(self.device)
        P, N = layout.prefix_len, layout.n
        k_buf, v_buf = self._kv_buffers(1, N)

        with _timed(timings, "prefix"):
            if P:
                self._forward(ids[None, :P], torch.arange(P, device=self.device), k_buf[:, :, :P], v_buf[:, :, :P])
        with _timed(timings, "lookup"):
            pkey = prefix_key(layout.token_ids[:P])
            chunks = [layout.token_ids[s:e] for s, e in layout.chunk_spans]
            keys = [chunk_key(self.fingerprint, self.namespace, pkey, c) for c in chunks]
            entries = {key: self._load(key, c) for key, c in zip(keys, chunks)}
            n_missed = sum(entries[key] is None for key in keys)
        with _timed(timings, "compute_chunks"):
            missing = {key: c for key, c in zip(keys, chunks) if entries[key] is None}
            computed = self._compute_chunks(missing, k_buf, v_buf, P)
        with _timed(timings, "store"):
            for entry in computed:
                self.store.put(entry)
                entries[entry.key] = entry
        with _timed(timings, "assemble"):
            for key, (s, e) in zip(keys, layout.chunk_spans):
                entry = entries[key]
                cached_at = torch.arange(entry.start_pos, entry.start_pos + e - s)
                k_buf[:, 0, s:e] = rerotate(entry.k.to(self.device, self.dtype), s - entry.start_pos, self.rope, cached_at)
                v_buf[:, 0, s:e] = entry.v.to(self.device, self.dtype)
        with _timed(timings, "select"):
            features = _RequestFeatures(self, layout, k_buf, v_buf, [entries[k] for k in keys])
            selection = selector.select(layout, ratio, features)
            for entry in features.grown_entries():  # persist selector features (the disk tier copies on put)
                self.store.put(entry)
        recomputed = self._recompute_set(layout, selection.indices)
        with _timed(timings, "recompute"):
            sel = recomputed.to(self.device)
            h = self._forward(ids[None, sel], sel, k_buf, v_buf)
            logits = self._logits(h[:, -1])
        n_ctx_recomputed = int(layout.context_mask()[recomputed].sum())
        timings["total"] = time.perf_counter() - t_start
        return BlendResult(
            logits=logits,
            recomputed=recomputed,
            reused_tokens=int(layout.context_mask().sum()) - n_ctx_recomputed,
            past_key_values=self._cache(k_buf, v_buf),
            layout=layout,
            timings=timings,
            chunk_hits=len(keys) - n_missed,
            chunk_misses=n_missed,
            scores=selection.scores,
        )

    @torch.inference_mode()
    def generate(self, result: BlendResult, max_new_tokens: int) -> list[int]:
        """Greedy continuation through the HF forward, from a copy of the result's cache (the result is unchanged)."""
        from transformers import DynamicCache

        cache = DynamicCache([(k, v) for k, v, *_ in result.past_key_values], config=self.config)
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if max_new_tokens <= 0:
            return []
        token = int(result.logits.argmax())
        out = [token]
        while len(out) < max_new_tokens and token not in eos and cache.get_seq_length() + 1 < self.max_len:
            step = self.model(input_ids=torch.tensor([[token]], device=self.device), past_key_values=cache, use_cache=True)
            token = int(step.logits[0, -1].argmax())
            out.append(token)
        return out

    @torch.inference_mode()
    def teacher_forced_logits(self, result: BlendResult, continuation: Sequence[int]) -> torch.Tensor:
        """[T, vocab] float32 logits for a given continuation of T tokens: row t predicts `continuation[t]` from the
        prompt and `continuation[:t]` (row 0 is `result.logits`); one HF forward over a copy of the result's cache,
        so a blended prompt is scored on another run's greedy tokens (the result is unchanged)."""
        from transformers import DynamicCache

        rows = [result.logits[None]]
        if len(continuation) > 1:
            cache = DynamicCache([(k, v) for k, v, *_ in result.past_key_values], config=self.config)
            ids = torch.tensor([list(continuation[:-1])], device=self.device)
            rows.append(self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float())
        return torch.cat(rows)[: len(continuation)]

    def draft(self, model: str | None = None, layers: int | None = None, dtype: str = "float32") -> Draft:
        """The draft model for draft-guided selectors, loaded once ("self", the default: this model's first
        `layers` layers, a third of them by default)."""
        model = model or "self"
        if (model, layers) not in self._drafts:
            self._drafts[model, layers] = load_draft(model, layers, dtype, self.device, target=self.model)
        return self._drafts[model, layers]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    # ---- request assembly -------------------------------------------------------------------------------------

    def _layout(self, prefix_ids: TokenIds, chunks_ids: Sequence[TokenIds], query_ids: TokenIds) -> Layout:
        prefix = _as_ids(prefix_ids, "prefix")
        chunks = [_as_ids(c, f"chunk {i}") for i, c in enumerate(chunks_ids)]
        query = _as_ids(query_ids, "query")
        for i, c in enumerate(chunks):
            if c.numel() == 0:
                raise ValueError(f"chunk {i} is empty")
        if query.numel() == 0:
            raise ValueError("the query is empty: it must hold at least the last prompt token")
        token_ids = torch.cat([prefix, *chunks, query])
        if token_ids.numel() > self.max_len:
            raise ValueError(f"prompt of {token_ids.numel()} tokens exceeds the model's context of {self.max_len}")
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        spans, pos = [], prefix.numel()
        for c in chunks:
            spans.append((pos, pos + c.numel()))
            pos += c.numel()
        return Layout(token_ids=token_ids, prefix_len=prefix.numel(), chunk_spans=tuple(spans),
                      query_span=(pos, token_ids.numel()))

    def _load(self, key: str, token_ids: torch.Tensor) -> ChunkEntry | None:
        entry = self.store.get(key)
        if entry is None:
            return None
        entry.check_model(self.fingerprint)
        expected = (self.n_layers, token_ids.numel(), self.n_kv_heads, self.head_dim)
        if tuple(entry.k.shape) != expected or not torch.equal(entry.token_ids.cpu(), token_ids):
            raise ValueError(f"store entry {key} does not match its chunk: KV {tuple(entry.k.shape)}, expected {expected}")
        return entry

    def _compute_chunks(self, chunks: dict[str, torch.Tensor], k_buf: torch.Tensor, v_buf: torch.Tensor,
                        prefix_len: int) -> list[ChunkEntry]:
        """KV of each chunk alone right after the prefix (already in the buffers), batched, as store entries."""
        entries, batch = [], []
        for key, ids in sorted(chunks.items(), key=lambda kv: kv[1].numel()):  # similar lengths pad least
            if batch and (len(batch) + 1) * (prefix_len + ids.numel()) > CHUNK_BATCH_TOKENS:
                entries += self._compute_batch(batch, k_buf, v_buf, prefix_len)
                batch = []
            batch.append((key, ids))
        if batch:
            entries += self._compute_batch(batch, k_buf, v_buf, prefix_len)
        return entries

    def _compute_batch(self, batch, k_buf, v_buf, prefix_len: int) -> list[ChunkEntry]:
        P, T = prefix_len, max(ids.numel() for _, ids in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        for b, (_, c) in enumerate(batch):
            ids[b, : c.numel()] = c
        bk, bv = self._kv_buffers(len(batch), P + T)
        bk[:, :, :P] = k_buf[:, :, :P]
        bv[:, :, :P] = v_buf[:, :, :P]
        # padding sits after each chunk's last token, so the position-causal mask hides it from the real tokens
        self._forward(ids.to(self.device), torch.arange(P, P + T, device=self.device), bk, bv)
        return [
            ChunkEntry(key=key, token_ids=c.clone(), k=bk[:, b, P : P + c.numel()].cpu().contiguous(),
                       v=bv[:, b, P : P + c.numel()].cpu().contiguous(), start_pos=P,
                       model_fingerprint=self.fingerprint)
            for b, (key, c) in enumerate(batch)
        ]

    @staticmethod
    def _recompute_set(layout: Layout, picked: torch.Tensor) -> torch.Tensor:
        picked = picked.long().cpu()
        if picked.numel() and (int(picked.min()) < 0 or int(picked.max()) >= layout.n):
            raise ValueError(f"selector picked indices outside the prompt [0, {layout.n})")
        mask = layout.forced_mask()
        mask[picked] = True
        return mask.nonzero().flatten()

    def _kv_buffers(self, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.n_layers, batch, n, self.n_kv_heads, self.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))

    def _cache(self, k_buf: torch.Tensor, v_buf: torch.Tensor):
        from transformers import DynamicCache

        return DynamicCache([(k_buf[l].transpose(1, 2), v_buf[l].transpose(1, 2)) for l in range(self.n_layers)],
                            config=self.config)

    # ---- the layer loop ---------------------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                 n_layers: int | None = None, probe_rows: torch.Tensor | None = None):
        """Run tokens `ids` [B, M] at positions `pos` [M] through the first `n_layers` layers.

        Their K/V are written into slot `pos` of `k_buf`/`v_buf` [L, B, N, H_kv, D] before each layer's attention;
        each attends to slots <= its own position. Returns the hidden states [B, M, hidden]; with `probe_rows`
        (indices into M, batch of 1) also the softmax attention of those rows to every slot, averaged over rows
        and heads, summed over layers ([N] float32).
        """
        inner = self.model.model
        B, M = ids.shape
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, pos[None])
        cos, sin = cos[:, :, None], sin[:, :, None]  # [1, M, 1, D] broadcasts over heads
        attn_sum = torch.zeros(k_buf.shape[2], dtype=torch.float32, device=self.device) if probe_rows is not None else None
        for l, layer in enumerate(inner.layers[: n_layers or self.n_layers]):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, M, self.n_heads, self.head_dim)
            k = attn.k_proj(x).view(B, M, self.n_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(B, M, self.n_kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k_buf[l][:, pos] = k
            v_buf[l][:, pos] = v
            if probe_rows is None:
                o = _attention(q, k_buf[l], v_buf[l], pos, attn.scaling)
            else:
                o, probs = _attention_with_probs(q, k_buf[l], v_buf[l], pos, attn.scaling)
                attn_sum += probs[0][:, probe_rows].float().mean(dim=(0, 1))
            h = h + attn.o_proj(o.reshape(B, M, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h if probe_rows is None else (h, attn_sum)

    def _logits(self, h_last: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(h_last))[0].float()


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, M, Hq, D] at positions `pos` (ascending); k, v [B, N, Hkv, D] with slot = position.

    Query rows are processed in tiles, each against only the slots up to its last position: memory stays bounded
    and a full causal prefill does half the work of a dense one.
    """
    B, M, Hq, D = q.shape
    Hkv = k.shape[2]
    rows = max(1, ATTENTION_TILE_ELEMENTS // max(1, Hq * (int(pos[-1]) + 1)))
    out = torch.empty_like(q)
    for r in range(0, M, rows):
        p = pos[r : r + rows]
        n = int(p[-1]) + 1
        mask = torch.arange(n, device=q.device)[None, :] <= p[:, None]
        out[:, r : r + rows] = F.scaled_dot_product_attention(
            q[:, r : r + rows].transpose(1, 2), k[:, :n].transpose(1, 2), v[:, :n].transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv,
        ).transpose(1, 2)
    return out


def _attention_with_probs(q, k, v, pos, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `_attention` in one tile, also returning the probabilities [B, Hq, M, N] (N = all slots)."""
    B, M, Hq, D = q.shape
    groups = Hq // k.shape[2]
    kk = k.transpose(1, 2).repeat_interleave(groups, dim=1)
    vv = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = (q.transpose(1, 2) @ kk.transpose(2, 3)).float() * scale
    mask = torch.arange(k.shape[1], device=q.device)[None, :] <= pos[:, None]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (probs.to(vv.dtype) @ vv).transpose(1, 2), probs


class _RequestFeatures(Features):
    """What selectors may ask of one request; each method computes on first call only."""

    def __init__(self, blender: ReferenceBlender, layout: Layout, k_buf: torch.Tensor, v_buf: torch.Tensor,
                 entries: list[ChunkEntry]):
        self.blender, self.layout, self.k_buf, self.v_buf = blender, layout, k_buf, v_buf
        self.entries = entries
        self._feature_counts = [len(e.features) for e in entries]
        self._fresh: tuple[torch.Tensor, torch.Tensor] | None = None  # all-token KV of the first layers
        self._query_attention: torch.Tensor | None = None
        self._text: tuple[str, list[tuple[int, int]]] | None = None

    def kv_deviation(self, layer: int, which: str) -> torch.Tensor:
        if which not in ("k", "v"):
            raise ValueError(f"which must be 'k' or 'v', got {which!r}")
        if not 0 <= layer < self.blender.n_layers:
            raise ValueError(f"layer {layer} outside [0, {self.blender.n_layers})")
        if self._fresh is None or self._fresh[0].shape[0] <= layer:
            b, n = self.blender, self.layout.n
            k, v = b._kv_buffers(1, n)
            k, v = k[: layer + 1], v[: layer + 1]
            b._forward(self.layout.token_ids[None].to(b.device), torch.arange(n, device=b.device), k, v, layer + 1)
            self._fresh = (k, v)
        fresh = self._fresh[0 if which == "k" else 1][layer, 0]
        reused = (self.k_buf if which == "k" else self.v_buf)[layer, 0]
        dev = (fresh.float() - reused.float()).flatten(1).norm(dim=1).cpu()
        return dev * self.layout.context_mask()

    def query_attention(self) -> torch.Tensor:
        # The query tokens' K/V written into the buffers here are rewritten by the final recompute before any
        # token reads them (the query is always recomputed), so the pass leaves no trace in the result.
        if self._query_attention is None:
            b, layout = self.blender, self.layout
            forced = layout.forced_mask().nonzero().flatten()
            q0, q1 = layout.query_span
            rows = ((forced >= q0) & (forced < q1)).nonzero().flatten().to(b.device)
            sel = forced.to(b.device)
            _, attn = b._forward(layout.token_ids[None, forced].to(b.device), sel, self.k_buf, self.v_buf, probe_rows=rows)
            self._query_attention = attn.cpu()
        return self._query_attention

    def prompt_text(self) -> tuple[str, list[tuple[int, int]]]:
        if self._text is None:
            self._text = decode_with_offsets(self.blender.tokenizer, self.layout.token_ids.tolist())
        return self._text

    def draft(self, model: str | None, layers: int | None) -> Draft:
        return self.blender.draft(model, layers)

    def chunk_features(self, index: int) -> dict[str, torch.Tensor]:
        return self.entries[index].features

    def grown_entries(self) -> list[ChunkEntry]:
        """Distinct entries a selector added features to during this request."""
        grown = {id(e): e for e, n in zip(self.entries, self._feature_counts) if len(e.features) != n}
        return list(grown.values())


def _as_ids(ids: TokenIds, what: str) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long).cpu()
    if t.dim() != 1:
        raise ValueError(f"{what} token ids must be 1-D, got shape {tuple(t.shape)}")
    return t


@contextlib.contextmanager
def _timed(timings: dict[str, float], stage: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - t0
