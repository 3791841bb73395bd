"""The attention backend of a blended prefill's passes: SGLang's KV pool read and written by segment, attended with
chunkcache.blend.attention (torch path; on CUDA with FlashInfer, see paged_attention).

Each segment is a set of queries at arbitrary positions of one request; a query attends, by position, to the KV of
its request row (reused or freshly written) and never to later positions.

Plan/run split: everything that is the same for every layer (which rows write the pool, each segment's key range
and its per-block masks) is built once per pass in `SparseAttention.__init__`; `forward` (once per layer) only
writes, reads and attends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chunkcache.blend.attention import attend_blocks, plan_blocks
from chunkcache.blend.layer_copy import LayerCopy

from . import paged_attention


@dataclass
class Segment:
    rows: slice  # this segment's rows among the forward's tokens
    q_pos: torch.Tensor  # [m] positions of those rows in their request
    ctx_slots: torch.Tensor  # [c] KV-pool slots of positions 0..c-1 (the key axis)
    to_pool: bool = True  # fresh K/V go to the pool at out_cache_loc; else they are kept aside in `kept_kv`
    kept_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer, when not to_pool
    attention_sum: torch.Tensor | None = None  # [c] if set: += mean attention of the queries to each context key
    # [c] the positions of ctx_slots when they are not 0..c-1: a pass that must not read positions whose slots hold
    # no KV of this prompt yet leaves them out of its context (sorted; the segment's own positions included)
    ctx_pos: torch.Tensor | None = None
    # per layer, the context's K/V given outright instead of read from the pool at ctx_slots (positions 0..c-1): what
    # an earlier slice of the same prompt kept aside, so a prompt kept aside can be computed a slice at a time
    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None


def pool_index(slots: torch.Tensor) -> slice | torch.Tensor:
    """`slots` as a slice when they are one increasing run of the pool (a request's usually are: a view or a copy
    instead of a gather or a scatter), else as they are."""
    n = len(slots)
    if n and int(slots[-1]) - int(slots[0]) == n - 1 and bool((slots[1:] - slots[:-1] == 1).all()):
        return slice(int(slots[0]), int(slots[0]) + n)
    return slots


def _last_row(s: Segment) -> Segment:
    """The segment's last query only (its output is the one a logits pass reads)."""
    return Segment(slice(s.rows.stop - 1, s.rows.stop), s.q_pos[-1:], s.ctx_slots, ctx_pos=s.ctx_pos)


class _SegmentPlan:
    """What attending for one segment needs, computed once per pass (per sliding window, in a model with some)."""

    def __init__(self, s: Segment, device: torch.device, window: int | None = None):
        self.segment = s
        slots = s.ctx_slots
        c = len(slots)
        self.context = pool_index(slots)
        k_pos = torch.arange(c, device=device) if s.ctx_pos is None else s.ctx_pos.to(device)
        if not s.to_pool:  # the segment's own fresh keys come after its context
            k_pos = torch.cat([k_pos, s.q_pos.to(device)])
        self.blocks = plan_blocks(s.q_pos.to(device), k_pos, s.attention_sum is not None, window)


class SparseAttention:
    """Takes the place of the model runner's attention backend for one pass (sglang_patch.forward.forward_pass)."""

    def __init__(self, base, segments: list[Segment], out_cache_loc: torch.Tensor, device: torch.device,
                 copied: LayerCopy | None = None, final_layer: int | None = None):
        """`copied`: the chunk KV still being copied into the pool, waited for layer by layer before the pool is
        written or read. `final_layer`: the model's last layer when only each segment's last row's output is read
        there (a logits pass): at that layer the torch path attends for those rows only and gives the others zeros
        (their K/V are still written; nothing reads their last hidden state). A recomputed token's last-layer attention is 1/L of
        the pass's attention, spent on an output no one reads."""
        self.token_to_kv_pool = base.token_to_kv_pool
        self.req_to_token_pool = base.req_to_token_pool
        self.segments = segments
        self.copied = copied
        written = [s for s in segments if s.to_pool]
        if written and all(s.to_pool for s in segments):
            self.write_rows, self.write_loc = None, out_cache_loc  # every row writes: no gather
        elif written:
            rows = torch.cat([torch.arange(s.rows.start, s.rows.stop) for s in written]).to(device)
            self.write_rows, self.write_loc = rows, out_cache_loc[rows]
        else:
            self.write_rows = self.write_loc = None
        self.paged = None
        if paged_attention.available(device):
            paged = [s for s in segments if s.to_pool and s.attention_sum is None and s.ctx_pos is None]
            segments = [s for s in segments if not (s.to_pool and s.attention_sum is None and s.ctx_pos is None)]
            self.paged = paged or None  # the FlashInfer plan is made at the first layer (head counts, dtypes)
        self.plans = [_SegmentPlan(s, device) for s in segments]
        self.device = device
        lasts_only = final_layer is not None and all(s.to_pool and s.attention_sum is None for s in segments)
        self.final_layer = final_layer if lasts_only else None
        self.final: list[_SegmentPlan] | None = None  # each segment's last row, planned at the final layer
        # sliding-window layers (Gemma 3's local ones): every segment on the torch path, planned at the first such
        # layer of the pass; FlashInfer's paged plan above is for full-attention layers
        self.windowed: dict[int, list[_SegmentPlan]] = {}

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        # the start-up check (chunkcache.architectures, in sglang_patch.scheduler.cache) refuses soft-capped models
        assert not layer.logit_cap, f"layer {layer.layer_id}: soft-cap {layer.logit_cap} reached the blend"
        window = layer.sliding_window_size if layer.sliding_window_size > -1 else None
        hq, hk, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        q, k, v = q.view(-1, hq, d), k.view(-1, hk, d), v.view(-1, hk, dv)
        if self.copied is not None:
            self.copied.wait(layer.layer_id)
        pool = self.token_to_kv_pool
        if self.write_loc is not None:
            rows = self.write_rows
            pool.set_kv_buffer(layer, self.write_loc, k if rows is None else k[rows], v if rows is None else v[rows])
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        plans = self.plans
        if layer.layer_id == self.final_layer:
            out = q.new_zeros(q.shape[0], hq, dv)
            if self.final is None:
                lasts = [_last_row(s) for s in self.segments if s.rows.stop > s.rows.start]
                self.final = [_SegmentPlan(s, self.device, window) for s in lasts]
            plans = self.final
        elif window is not None:
            out = q.new_empty(q.shape[0], hq, dv)
            plans = self.windowed.get(window)
            if plans is None:
                plans = self.windowed[window] = [_SegmentPlan(s, self.device, window) for s in self.segments]
        else:
            out = q.new_empty(q.shape[0], hq, dv)
            if isinstance(self.paged, list):
                self.paged = paged_attention.PagedSparsePrefill(
                    self.paged, hq, hk, d, dv, layer.scaling, q.dtype, k_buf.dtype, q.device)
            if self.paged is not None:
                out[self.paged.rows] = self.paged.run(q, k_buf, v_buf).to(q.dtype)
        for p in plans:
            s = p.segment
            if s.ctx_kv is None:
                keys, values = k_buf[p.context], v_buf[p.context]
            else:
                keys, values = (t.to(q.device) for t in s.ctx_kv[layer.layer_id])
            if not s.to_pool:
                fresh_k, fresh_v = k[s.rows], v[s.rows]
                s.kept_kv.append((fresh_k.clone(), fresh_v.clone()))
                keys, values = torch.cat([keys, fresh_k]), torch.cat([values, fresh_v])
            out[s.rows] = attend_blocks(q[s.rows], keys.to(q.dtype), values.to(q.dtype), p.blocks, layer.scaling,
                                        s.attention_sum)
        return out.view(-1, hq * dv)
