"""Attention for the passes of a blended prefill (torch path; on CUDA with FlashInfer, see paged_attention).

Each segment is a set of queries at arbitrary positions of one request; a query attends, by position, to the KV of
its request row (reused or freshly written) and never to later positions. Cost is O(queries x context) per layer,
where SGLang's torch_native extend pads every request to a full N x N square.

Plan/run split: everything that is the same for every layer (which rows write the pool, each segment's key range
and its per-block masks) is built once per pass in `SparseAttention.__init__`; `forward` (once per layer) only
writes, reads and attends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import paged_attention

# Query rows per attention call. Rows are sorted by position, so a block only needs the keys up to its last row's
# position: smaller blocks skip more of the masked upper triangle, larger ones make fewer, larger kernel calls
# (64 was the fastest of 32-512 for ~500 queries spread over 3.2K keys on this 2-core CPU, quiet, fp32 and bf16:
# 25.7 ms per layer against 29.4 at 256).
QUERY_BLOCK = 64


@dataclass
class Segment:
    rows: slice  # this segment's rows among the forward's tokens
    q_pos: torch.Tensor  # [m] positions of those rows in their request
    ctx_slots: torch.Tensor  # [c] KV-pool slots of positions 0..c-1 (the key axis)
    write: bool = True  # fresh K/V go to the pool at out_cache_loc; else they are kept in `scratch`
    scratch: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer, standalone chunks
    record: torch.Tensor | None = None  # [c] if set: += mean attention of the queries to each context key


@dataclass
class _Block:
    rows: slice  # rows of the segment (relative to its first row)
    n_keys: int  # keys [0, n_keys) of the segment's key axis are visible to some row of the block
    mask: torch.Tensor | None  # [b, n_keys - shared] bool over keys [shared, n_keys); None: every key visible
    shared: int = 0  # keys [0, shared) are visible to every row of the block: attended without a mask
    _bias: dict = field(default_factory=dict)  # (dtype, group) -> the mask as an additive bias, made once per pass

    def bias(self, dtype: torch.dtype, group: int = 1) -> torch.Tensor | None:
        """The mask as 0 / -inf in `dtype`, its rows repeated `group` times (GQA heads stacked along the query
        axis): CPU SDPA runs faster with an additive mask than with a boolean one."""
        if self.mask is None:
            return None
        if (dtype, group) not in self._bias:
            self._bias[dtype, group] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf")).repeat(group, 1)
        return self._bias[dtype, group]


class _SegmentPlan:
    """What attending for one segment needs, computed once per pass."""

    def __init__(self, s: Segment, device: torch.device):
        self.segment = s
        slots = s.ctx_slots
        # A request's slots are usually one contiguous run of the pool: read the context as a view, not a gather.
        c = len(slots)
        contiguous = c > 0 and int(slots[-1]) - int(slots[0]) == c - 1 and bool(
            (slots[1:] - slots[:-1] == 1).all())
        self.context = slice(int(slots[0]), int(slots[0]) + c) if contiguous else slots
        k_pos = torch.arange(c, device=device)
        if not s.write:  # the segment's own fresh keys come after its context
            k_pos = torch.cat([k_pos, s.q_pos.to(device)])
        self.blocks = plan_blocks(s.q_pos.to(device), k_pos, s.record is not None)


def plan_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, whole_context: bool) -> list[_Block]:
    """Query blocks of QUERY_BLOCK rows (q_pos sorted) with their masks. When the keys sit at positions 0..c-1 in
    order, a block needs only a prefix of them, unless `whole_context` (recording attention to every key), and on CPU
    the keys before its first row's position are `shared` (only the rest needs a mask)."""
    ordered = not whole_context and torch.equal(k_pos, torch.arange(len(k_pos), device=k_pos.device))
    blocks = []
    for start in range(0, len(q_pos), QUERY_BLOCK):
        blk = slice(start, start + QUERY_BLOCK)
        qp = q_pos[blk]
        n_keys = int(qp.max()) + 1 if ordered else len(k_pos)
        # the split is the CPU strategy (attend_blocks); every row sees at least its own position in the masked
        # part, so no row of it is empty
        shared = int(qp.min()) if ordered and q_pos.device.type == "cpu" else 0
        allowed = k_pos[None, shared:n_keys] <= qp[:, None]
        blocks.append(_Block(blk, n_keys, None if bool(allowed.all()) else allowed, shared))
    return blocks


class SparseAttention:
    """Takes the place of the model runner's attention backend for one pass (see sglang_patch.blend)."""

    def __init__(self, base, segments: list[Segment], out_cache_loc: torch.Tensor, device: torch.device):
        self.token_to_kv_pool = base.token_to_kv_pool
        self.req_to_token_pool = base.req_to_token_pool
        self.segments = segments
        written = [s for s in segments if s.write]
        if written and all(s.write for s in segments):
            self.write_rows, self.write_loc = None, out_cache_loc  # every row writes: no gather
        elif written:
            rows = torch.cat([torch.arange(s.rows.start, s.rows.stop) for s in written]).to(device)
            self.write_rows, self.write_loc = rows, out_cache_loc[rows]
        else:
            self.write_rows = self.write_loc = None
        self.paged = None
        if paged_attention.available(device):
            paged = [s for s in segments if s.write and s.record is None]
            segments = [s for s in segments if not (s.write and s.record is None)]
            self.paged = paged or None  # the FlashInfer plan is made at the first layer (head counts, dtypes)
        self.plans = [_SegmentPlan(s, device) for s in segments]

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        hq, hk, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        q, k, v = q.view(-1, hq, d), k.view(-1, hk, d), v.view(-1, hk, dv)
        pool = self.token_to_kv_pool
        if self.write_loc is not None:
            rows = self.write_rows
            pool.set_kv_buffer(layer, self.write_loc, k if rows is None else k[rows], v if rows is None else v[rows])
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        out = q.new_empty(q.shape[0], hq, dv)
        if isinstance(self.paged, list):
            self.paged = paged_attention.PagedSparsePrefill(
                self.paged, hq, hk, d, dv, layer.scaling, q.dtype, k_buf.dtype, q.device)
        if self.paged is not None:
            out[self.paged.rows] = self.paged.run(q, k_buf, v_buf).to(q.dtype)
        for p in self.plans:
            s = p.segment
            keys, values = k_buf[p.context], v_buf[p.context]
            if not s.write:
                fresh_k, fresh_v = k[s.rows], v[s.rows]
                s.scratch.append((fresh_k.clone(), fresh_v.clone()))
                keys, values = torch.cat([keys, fresh_k]), torch.cat([values, fresh_v])
            out[s.rows] = attend_blocks(q[s.rows], keys.to(q.dtype), values.to(q.dtype), p.blocks, layer.scaling,
                                        s.record)
        return out.view(-1, hq * dv)


def attend(q, keys, values, q_pos, k_pos, scale, record=None):
    """q [m, Hq, D] at positions q_pos (sorted); keys/values [c, Hk, D] at k_pos. One-shot form of attend_blocks."""
    return attend_blocks(q, keys, values, plan_blocks(q_pos, k_pos, record is not None), scale, record)


def attend_blocks(q, keys, values, blocks: list[_Block], scale, record=None):
    """q [m, Hq, D]; keys/values [c, Hk, D]; `blocks` partition q's rows (plan_blocks). GQA by head grouping."""
    group = q.shape[1] // keys.shape[1]
    kt_all = keys.transpose(0, 1)  # [Hk, c, D]
    vt_all = values.transpose(0, 1)
    out = torch.empty(q.shape[0], q.shape[1], values.shape[-1], dtype=q.dtype, device=q.device)
    for b in blocks:
        kt, vt = kt_all[:, : b.n_keys], vt_all[:, : b.n_keys]
        if record is not None:
            out[b.rows] = _attend_recording(q[b.rows].transpose(0, 1), kt, vt, b, scale, group, record, q.shape)
        elif q.device.type == "cpu":
            out[b.rows] = _attend_split(q[b.rows], kt, vt, b, scale, group)
        else:
            o = F.scaled_dot_product_attention(q[b.rows].transpose(0, 1), kt, vt, attn_mask=b.bias(q.dtype),
                                               scale=scale, enable_gqa=group > 1)
            out[b.rows] = o.transpose(0, 1)
    return out


def _attend_split(q, kt, vt, b: _Block, scale, group):
    """One block on CPU: the query heads of each KV head stacked along the query axis (K/V read once per KV head),
    the shared keys without a mask and the rest with it, merged by log-sum-exp in float32. The unmasked part is the
    bulk of the keys; CPU flash attention with a mask ran ~25 % slower than without (6.4K keys, bf16)."""
    rows, hk, d = q.shape[0], kt.shape[0], q.shape[-1]
    qs = q.view(rows, hk, group, d).permute(1, 2, 0, 3).reshape(1, hk, group * rows, d)  # row (g, r) of KV head h
    parts = []
    if b.shared:
        parts.append(_flash(qs, kt[None, :, : b.shared], vt[None, :, : b.shared], None, scale))
    if b.n_keys > b.shared:
        bias = b.bias(q.dtype, group)
        parts.append(_flash(qs, kt[None, :, b.shared:], vt[None, :, b.shared:], None if bias is None else bias, scale))
    if len(parts) == 1:
        o = parts[0][0]
    else:
        (o1, l1), (o2, l2) = parts
        lse = torch.logaddexp(l1, l2)
        o = (o1.float() * (l1 - lse).exp().unsqueeze(-1) + o2.float() * (l2 - lse).exp().unsqueeze(-1)).to(q.dtype)
    return o.view(hk, group, rows, -1).permute(2, 0, 1, 3).reshape(rows, hk * group, -1)


def _flash(q, k, v, bias, scale):
    """CPU flash attention returning (output, float32 log-sum-exp per row): SDPA's public API hides the latter."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)[:2]
    return out[0], lse[0]


def _attend_recording(qb, kt, vt, b: _Block, scale, group, record, q_shape):
    """Explicit softmax, so the mean attention of the queries to each context key can be added to `record`."""
    kg, vg = kt.repeat_interleave(group, 0), vt.repeat_interleave(group, 0)
    logits = (qb @ kg.transpose(1, 2)) * scale
    if b.mask is not None:
        logits[:, :, b.shared:] = logits[:, :, b.shared:].masked_fill(~b.mask, float("-inf"))
    probs = logits.softmax(-1)
    record += probs[:, :, : record.shape[0]].float().sum((0, 1)) / (q_shape[0] * q_shape[1])
    return (probs @ vg).transpose(0, 1)
