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

import inspect
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import architectures
from . import select as selectors
from .blend import fidelity, pipeline
from .blend.auto import AutoChunks
from .blend.attention import attend_blocks, plan_blocks
from .blend.features import Models
from .blend.idle import run_through
from .blend.plan import Placement, RequestPlan
from .blend.request import ChunkRequest, Detection, RequestHint
from .draft import Draft
from .draft import load as load_draft
from .hashing import entry_key, model_fingerprint, prefix_key, tenant_key
from .rope import rerotate, rotate_half
from .select.base import Layout, Selector
from .store import ChunkEntry, ChunkStore

# padded tokens per batch when computing missing chunks; bounds the batch's KV buffer
CHUNK_BATCH_TOKENS = 8192

TokenIds = Sequence[int] | torch.Tensor


@dataclass
class BlendResult:
    logits: torch.Tensor  # [vocab] float32: next-token logits after the last prompt token
    recomputed: torch.Tensor  # [M] int64, sorted prompt indices whose KV was computed in this prompt's context
    reused_tokens: int  # chunk tokens whose KV came from the store, re-rotated and not recomputed
    past_key_values: object  # transformers DynamicCache holding the whole prompt; `generate` continues from it
    layout: Layout
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage (request.STAGES), and "total"
    chunk_hits: int = 0  # chunks found in the store
    chunk_misses: int = 0  # chunks computed standalone (and inserted)
    scores: torch.Tensor | None = None  # the selector's per-token scores, if it has any
    passes: tuple[str, ...] = ()  # the engine's feature passes the blend ran (pipeline.Blended.passes)
    report: dict | None = None  # the round's record, the fields a server reports in meta_info (pipeline.record)


class ReferenceBlender:
    def __init__(self, model, model_dir: str | os.PathLike, store: ChunkStore | None = None, namespace: str = "default"):
        config = model.config
        # the support table's "reference" families are those whose decoder layer `_forward` reproduces: Llama's, with
        # q/k norm before RoPE (Qwen3), layers without RoPE (SmolLM3), and Gemma 3's (see layer_types below)
        self.rope = architectures.check(config, "reference")
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
        # Gemma 3's decoder layer: a rotary embedding per layer type, sliding-window layers, and norms around both
        # sublayers (`_forward` reads each layer's window from its attention module)
        self.layer_types = list(getattr(config, "layer_types", None) or ())
        self._typed_rope = "layer_type" in inspect.signature(model.model.rotary_emb.forward).parameters
        self._sandwich = hasattr(model.model.layers[0], "pre_feedforward_layernorm")
        self.models = Models(model_dir, lambda name, layers: load_draft(name, layers, "float32", self.device,
                                                                         target=self.model))
        # this model's fidelity estimator (a calibration of its weights in chunkcache's home first); None: none fitted
        self.fidelity = fidelity.coefficients().model(model_dir)

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
        architectures.check(AutoConfig.from_pretrained(path), "reference")  # refused before its weights load
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
            timings={"recompute": total, "total": total},
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
        """Hinted chunks: each keyed by the prefix it follows and its tokens, computed standalone when missing."""
        layout = self._layout(prefix_ids, chunks_ids, query_ids)
        tenant, pkey = tenant_key(self.namespace), prefix_key(layout.token_ids[: layout.prefix_len])
        keys = [entry_key(self.fingerprint, tenant, pkey, layout.token_ids[s:e]) for s, e in layout.chunk_spans]
        return self.blend_spans(layout.token_ids, layout.chunk_spans, keys, selector, ratio, context=pkey,
                                **selector_options)

    @torch.inference_mode()
    def blend_spans(self, token_ids: TokenIds, spans: Sequence[tuple[int, int]], keys: Sequence[str],
                    selector: str | Selector = "none", ratio: float = 0.15, detection: Detection | None = None,
                    context: str | None = None, matched: int = 0, **selector_options) -> BlendResult:
        """Chunks already keyed (sorted, disjoint spans before the last token): the exact prefix is everything before
        the first, the query everything after the last (automatic detection's segments, with its `detection`, or a
        hint's chunks). `context`: the prefix digest every key names (a hint's; RequestPlan.context): a missing
        chunk is then stored, else it serves this call only. `matched`: the first tokens are computed exactly (a
        server's radix match), a chunk reaching into them reused from there on."""
        t_start = time.perf_counter()
        if isinstance(selector, str):
            selector = selectors.create(selector, **selector_options)
        elif selector_options:
            raise ValueError("selector options go to the selector's constructor; pass a name, not an instance")
        ids = _as_ids(token_ids, "prompt")
        hint = RequestHint(ids, tuple((int(s), int(e)) for s, e in spans), tuple(keys), selector.name, ratio,
                           self.namespace, auto=detection is not None, tenant=tenant_key(self.namespace),
                           context=context)
        request = ChunkRequest(rid="reference", hint=hint, detection=detection)
        plan = request.plan(matched)
        engine = _Engine(self, plan)
        prefetched = request.prefetched()
        run = pipeline.run(engine, self.store, [plan], lambda _: selector,
                           prefetched=[] if prefetched is None else [prefetched], estimator=self.fidelity)
        done = run.requests[0]
        total = time.perf_counter() - t_start
        report = pipeline.record(request, done, stages=run.seconds, blend_s=total, select_s=done.select_s)
        for job in run.deferred:  # what a server measures when idle, measured here once the blend is done
            for key, feats in run_through(job.run()).items():
                self.store.add_features(key, feats)
        return BlendResult(
            logits=run.output,
            recomputed=done.recomputed,
            reused_tokens=done.reused_tokens,
            past_key_values=self._cache(engine.k_buf, engine.v_buf),
            layout=plan.layout(),
            timings={**report["stages_s"], "total": total},
            chunk_hits=done.hits,
            chunk_misses=len(plan.chunks) - done.hits,
            scores=done.scores,
            passes=done.passes,
            report=report,
        )

    @torch.inference_mode()
    def learn(self, token_ids: TokenIds, auto: AutoChunks) -> int:
        """What a server does after a prefill with automatic detection on: the prompt's paragraphs holding segments
        the store lacks, each encoded alone after the canonical head (AutoChunks.to_encode) and stored. Returns the
        segments stored."""
        ids = _as_ids(token_ids, "prompt")
        request = ChunkRequest(rid="reference", segments=auto.segments(ids, self.namespace, None, readings=False))
        return sum(int(pipeline.store_encode(self.store, encode, self.kv_alone(encode.token_ids), self.fingerprint)["segments"])
                   for encode in pipeline.to_encode(self.store, auto, request, ids))

    @torch.inference_mode()
    def kv_alone(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [layers, tokens, heads, dim] on the host of `token_ids` alone from position 0, one row."""
        k, v = self._kv_buffers(1, len(token_ids))
        self._forward(token_ids[None].to(self.device), torch.arange(len(token_ids), device=self.device), k, v)
        return k[:, 0].cpu(), v[:, 0].cpu()

    @torch.inference_mode()
    def auto_blend(self, token_ids: TokenIds, auto: AutoChunks, selector: str | Selector = "none",
                   ratio: float = 0.15, matched: int = 0, **selector_options) -> BlendResult | None:
        """A prompt nobody marked, as a server with automatic detection serves it: its stored segments become the
        chunks (their entries fetched once, by detection); None when they are too few (the server then computes
        the prompt as stock). `matched`: its first tokens held exactly, as a server's radix tree holds the prefix
        two prompts share (computed exactly here, never looked up)."""
        ids = _as_ids(token_ids, "prompt")
        name = selector if isinstance(selector, str) else selector.name
        found = pipeline.detect(self.store, auto, ids, auto.segments(ids, self.namespace, None), matched,
                                pipeline.Defaults(name, ratio, self.namespace))
        if found.hint is None:
            return None
        return self.blend_spans(ids, found.hint.spans, found.hint.keys, selector, ratio, detection=found,
                                matched=matched, **selector_options)

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

    def draft(self, model: str | None = None, layers: int | None = None) -> Draft:
        """The draft model for draft-guided selectors, loaded once ("self", the default: this model's first
        `layers` layers, a third of them by default)."""
        return self.models.draft(model, layers)

    @property
    def tokenizer(self):
        return self.models.tokenizer

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

    def _compute_chunks(self, chunks: dict[str, torch.Tensor], k_buf: torch.Tensor, v_buf: torch.Tensor,
                        prefix_len: int, tenant: str = "", context: str = "") -> list[ChunkEntry]:
        """KV of each chunk alone right after the prefix (already in the buffers), batched, as store entries (of
        `tenant`, computed after `context`: RequestPlan's)."""
        entries, batch = [], []
        for key, ids in sorted(chunks.items(), key=lambda kv: kv[1].numel()):  # similar lengths pad least
            if batch and (len(batch) + 1) * (prefix_len + ids.numel()) > CHUNK_BATCH_TOKENS:
                entries += self._compute_batch(batch, k_buf, v_buf, prefix_len, tenant, context)
                batch = []
            batch.append((key, ids))
        if batch:
            entries += self._compute_batch(batch, k_buf, v_buf, prefix_len, tenant, context)
        return entries

    def _compute_batch(self, batch, k_buf, v_buf, prefix_len: int, tenant: str, context: str) -> list[ChunkEntry]:
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
                       model_fingerprint=self.fingerprint, tenant=tenant, context=context)
            for b, (key, c) in enumerate(batch)
        ]

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
                 n_layers: int | None = None, record_from: int | None = None, visible: torch.Tensor | None = None):
        """Run tokens `ids` [B, M] at positions `pos` [M] (ascending) through the first `n_layers` layers.

        Their K/V are written into slot `pos` of `k_buf`/`v_buf` [L, B, N, H_kv, D] before each layer's attention;
        each attends to slots <= its own position, of `visible` only when given (sorted, `pos` among them). Returns
        the hidden states [B, M, hidden]; with `record_from` (batch of 1) also the softmax attention of rows
        [record_from, M) to every slot, averaged over those rows and heads, per layer ([n_layers, N] float32; zero
        on a slot not visible).
        """
        inner = self.model.model
        B, M = ids.shape
        h = inner.embed_tokens(ids)  # Gemma 3's scales itself by sqrt(hidden)
        slots = torch.arange(k_buf.shape[2], device=self.device) if visible is None else visible.to(self.device)
        split = M if record_from is None else record_from
        rotations, plans = {}, {}  # per layer type (Gemma 3: local and global RoPE bases) and per window

        def rotation(layer_type: str | None):
            if layer_type not in rotations:
                cos, sin = inner.rotary_emb(h, pos[None], *([layer_type] if self._typed_rope else []))
                rotations[layer_type] = cos[:, :, None], sin[:, :, None]  # [1, M, 1, D] broadcasts over heads
            return rotations[layer_type]

        def planned(window: int | None):  # transformers' window counts the query: keys q - (window - 1) .. q
            if window not in plans:
                plans[window] = (plan_blocks(pos[:split], slots, False, window and window - 1),
                                 plan_blocks(pos[split:], slots, True, window and window - 1))
            return plans[window]

        layers = inner.layers[: n_layers or self.n_layers]
        record = torch.zeros(len(layers), len(slots), dtype=torch.float32, device=self.device)
        for l, layer in enumerate(layers):
            attn = layer.self_attn
            cos, sin = rotation(self.layer_types[l] if self._typed_rope else None)
            blocks, recorded = planned(getattr(attn, "sliding_window", None))
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, M, self.n_heads, self.head_dim)
            k = attn.k_proj(x).view(B, M, self.n_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(B, M, self.n_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3, Gemma 3: per-head RMS norm before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            if getattr(attn, "use_rope", True):  # SmolLM3's NoPE layers keep their positions out of q and k
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
            k_buf[l][:, pos] = k
            v_buf[l][:, pos] = v
            o = torch.empty_like(q)
            for b in range(B):
                keys, values = k_buf[l, b], v_buf[l, b]
                if visible is not None:
                    keys, values = keys[slots], values[slots]
                o[b, :split] = attend_blocks(q[b, :split], keys, values, blocks, attn.scaling)
                if split < M:
                    o[b, split:] = attend_blocks(q[b, split:], keys, values, recorded, attn.scaling, record[l])
            o = attn.o_proj(o.reshape(B, M, -1))
            if self._sandwich:  # Gemma 3: each sublayer's output normed before the residual, the MLP's input too
                h = h + layer.post_attention_layernorm(o)
                h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
            else:
                h = h + o
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        if record_from is None:
            return h
        if visible is not None:
            record = torch.zeros(len(layers), k_buf.shape[2], device=self.device).index_copy_(1, slots, record)
        return h, record

    def _logits(self, h_last: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(self.model.model.norm(h_last))[0].float()
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap


class _Engine:
    """The blend pipeline's engine for one request on the blender's HF modules: the request's KV lives in one buffer
    per layer whose slot is the token's position."""

    def __init__(self, blender: ReferenceBlender, plan: RequestPlan):
        self.blender, self.plan = blender, plan
        self.fingerprint, self.models, self.n_layers = blender.fingerprint, blender.models, blender.n_layers
        self.rope = blender.rope
        self.entry_shape = (blender.n_layers, blender.n_kv_heads, blender.head_dim)
        self.ids = plan.token_ids.to(blender.device)
        self.k_buf, self.v_buf = blender._kv_buffers(1, plan.n)
        self._fresh: tuple[torch.Tensor, torch.Tensor] | None = None  # all-token exact KV of the first layers

    def fill(self, chunks: list[tuple[int, Placement]]) -> list[ChunkEntry]:
        b, P = self.blender, self.plan.start
        if P:
            b._forward(self.ids[None, :P], torch.arange(P, device=b.device), self.k_buf[:, :, :P], self.v_buf[:, :, :P])
        return b._compute_chunks({c.key: self.plan.chunk_ids(c) for _, c in chunks}, self.k_buf, self.v_buf,
                                 self.plan.shared_prefix_len, self.plan.tenant, self.plan.context or "")

    def copy(self, entries: list[list[ChunkEntry]]) -> None:
        b = self.blender
        for c, entry in zip(self.plan.chunks, entries[0]):
            (s, e), start = c.span, c.chunk[0]
            cached_at = torch.arange(entry.start_pos + c.head, entry.start_pos + entry.num_tokens)
            self.k_buf[:, 0, s:e] = rerotate(entry.k[:, c.head:].to(b.device, b.dtype), start - entry.start_pos,
                                             b.rope, cached_at)
            self.v_buf[:, 0, s:e] = entry.v[:, c.head:].to(b.device, b.dtype)

    def kv_deviation(self, requests: Sequence[int], layer: int, which: str) -> list[torch.Tensor]:
        fresh = self._fresh_kv(layer + 1)[0 if which == "k" else 1][layer, 0]
        reused = (self.k_buf if which == "k" else self.v_buf)[layer, 0]
        dev = (fresh.float() - reused.float()).flatten(1).norm(dim=1).cpu()
        return [dev * self.plan.layout().context_mask() for _ in requests]

    def aside(self):
        """This engine's one prompt computed exactly, in one step (its deferred measurement runs right after the
        blend)."""
        def exact_kv(token_ids: torch.Tensor, layers: int):
            k, v = self._fresh_kv(layers)
            return k[:layers, 0].cpu(), v[:layers, 0].cpu()
            yield  # a generator of no step

        return exact_kv

    def true_deviation(self, requests: Sequence[int], attended: bool = False) -> list[torch.Tensor]:
        """The oracle's feature (Features.true_deviation): one full prefill of the prompt, compared with the reused KV
        of every layer. Context tokens' slots hold the copied KV until the final recompute (the feature passes write
        only forced tokens), so this is the deviation naive reuse leaves. `attended`: the query run over the full
        KV once more, its attention per layer weighing that layer's deviation."""
        b, layout = self.blender, self.plan.layout()
        fk, fv = self._fresh_kv(self.n_layers)
        dev = sum((fresh[:, 0].float() - reused[:, 0].float()).flatten(2).norm(dim=2)
                  for fresh, reused in ((fk, self.k_buf), (fv, self.v_buf)))  # [layers, N]
        if attended:
            query = torch.arange(*layout.query_span, device=b.device)
            # on copies: the query's K/V it writes are full recompute's anyway, but kv_deviation reads these buffers
            _, attn = b._forward(self.ids[None, query], query, fk.clone(), fv.clone(), record_from=0)
            dev = dev * attn
        return [dev.sum(0).cpu() * layout.context_mask() for _ in requests]

    def _fresh_kv(self, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of every token computed exactly (the prompt alone, position-causal) through at least `layers` layers,
        computed once per request for the deepest layer asked so far."""
        if self._fresh is None or self._fresh[0].shape[0] < layers:
            b, n = self.blender, self.plan.n
            k, v = b._kv_buffers(1, n)
            k, v = k[:layers], v[:layers]
            b._forward(self.ids[None], torch.arange(n, device=b.device), k, v, layers)
            self._fresh = (k, v)
        return self._fresh

    def query_attention(self, requests: Sequence[int]) -> list[torch.Tensor]:
        fused = self.query_attention_per_layer().sum(0)  # one pass: the engine holds a single request
        return [fused for _ in requests]

    def query_attention_per_layer(self) -> torch.Tensor:
        """[layers, N] float32: ProphetKV's per-layer attention from the query's last tokens (Layout.query_pass) over
        the reused KV, those tokens alone computed in the pass (the tokens between chunks and the query's others
        are not attended, as on the server), before Features.query_attention sums it over layers
        (chunkbench.studies.select_fidelity weighs layers apart)."""
        # The query tokens' K/V written into the buffers here are rewritten by the final recompute before any
        # token reads them (the query is always recomputed), so the pass leaves no trace in the result.
        b, layout = self.blender, self.plan.layout()
        rows = layout.query_pass()
        visible = torch.cat([layout.held(), rows])
        sel = rows.to(b.device)
        _, attn = b._forward(self.ids[None, sel], sel, self.k_buf, self.v_buf, record_from=0,
                             visible=None if len(visible) == layout.n else visible)
        return attn.cpu()

    def recompute(self, tokens: list[torch.Tensor]) -> torch.Tensor:
        sel = tokens[0].to(self.blender.device)
        h = self.blender._forward(self.ids[None, sel], sel, self.k_buf, self.v_buf)
        return self.blender._logits(h[:, -1])


def _as_ids(ids: TokenIds, what: str) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long).cpu()
    if t.dim() != 1:
        raise ValueError(f"{what} token ids must be 1-D, got shape {tuple(t.shape)}")
    return t
