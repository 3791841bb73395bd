"""Position-causal attention: queries at arbitrary positions of one request, each attending to the keys at or before
its own position (and, in a sliding-window layer, no more than `window` positions before it). Both engines run every
blended pass through it: the reference blender (chunkcache.reference) on its per-request buffers, the SGLang glue
(sglang_patch.sparse_attention) on the KV pool. Cost is O(queries x keys) per layer, not the O(N^2) of a padded
square.

Plan/run split: the blocks and masks depend only on positions, so `plan_blocks` runs once per pass and
`attend_blocks` once per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Query rows per attention call. Rows are sorted by position, so a block only needs the keys up to its last row's
# position: smaller blocks skip more of the masked upper triangle, larger ones make fewer, larger kernel calls
# (64 was the fastest of 32-512 for ~500 queries spread over 3.2K keys on this 2-core CPU, quiet, fp32 and bf16:
# 25.7 ms per layer against 29.4 at 256; with the bf16 matmul path, 920 queries over 6.4K keys: 28.7 ms at 64,
# 28.1-28.2 at 96-128, 32.8 at 32, 45.3 at 192).
QUERY_BLOCK = 64


@dataclass
class _Block:
    rows: slice  # rows of the segment (relative to its first row)
    n_keys: int  # keys [first, n_keys) of the segment's key axis are visible to some row of the block
    mask: torch.Tensor | None  # [b, n_keys - shared] bool over keys [shared, n_keys); None: every key visible
    shared: int = 0  # keys [first, shared) are visible to every row of the block: attended without a mask
    first: int = 0  # keys before it are visible to no row (behind a sliding window)
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


def plan_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, whole_context: bool,
                window: int | None = None) -> list[_Block]:
    """Query blocks of QUERY_BLOCK rows (q_pos sorted) with their masks. When the keys sit at positions 0..c-1 in
    order, a block needs only a range of them, unless `whole_context` (recording attention to every key), and on CPU
    the keys before its first row's position are `shared` (only the rest needs a mask). `window`: a sliding-window
    layer's, as SGLang's RadixAttention.sliding_window_size counts it (a query sees keys q - window .. q)."""
    ordered = not whole_context and torch.equal(k_pos, torch.arange(len(k_pos), device=k_pos.device))
    blocks = []
    for start in range(0, len(q_pos), QUERY_BLOCK):
        blk = slice(start, start + QUERY_BLOCK)
        qp = q_pos[blk]
        n_keys = int(qp.max()) + 1 if ordered else len(k_pos)
        first = max(0, int(qp.min()) - window) if ordered and window is not None else 0
        # the split is the CPU strategy (attend_blocks); every row sees at least its own position in the masked
        # part, so no row of it is empty. Behind a window the block's keys are few: all of them masked.
        shared = int(qp.min()) if ordered and window is None and q_pos.device.type == "cpu" else first
        keys = k_pos[None, shared:n_keys]
        allowed = keys <= qp[:, None]
        if window is not None:
            allowed &= keys >= qp[:, None] - window
        blocks.append(_Block(blk, n_keys, None if bool(allowed.all()) else allowed, shared, first))
    return blocks


def attend(q, keys, values, q_pos, k_pos, scale, record=None, window=None):
    """q [m, Hq, D] at positions q_pos (sorted); keys/values [c, Hk, D] at k_pos. One-shot form of attend_blocks."""
    return attend_blocks(q, keys, values, plan_blocks(q_pos, k_pos, record is not None, window), scale, record)


def attend_blocks(q, keys, values, blocks: list[_Block], scale, record=None):
    """q [m, Hq, D]; keys/values [c, Hk, D]; `blocks` partition q's rows (plan_blocks). GQA by head grouping. On CPU
    the kernel follows the dtype, which `serve.dtype: auto` chooses per host by timing bf16 against fp32 matmuls
    (chunkcache.cpu_dtype): bfloat16 goes through bf16 matmuls (_attend_gemm), anything else through flash attention
    in float32 (_attend_split; the output is cast back). CPU flash attention gains nothing from bf16: it ran 160-170
    GFLOP/s in both dtypes on a 2-core AMD EPYC with avx512_bf16, where a bf16 matmul ran 830-900, and in float32
    1.4-1.6x faster than in bfloat16 on an Intel host without AMX (6.4K keys, ~1K late queries: 63 vs 89 ms a
    layer, the per-layer upcast of the context included), and float32 rounds less."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], values.shape[-1], dtype=q.dtype, device=q.device)
    cpu = q.device.type == "cpu" and record is None
    if cpu and q.dtype == torch.bfloat16:
        kt_all, vt_all = _keys_with_shift_row(keys), values.transpose(0, 1).contiguous()
        for b in blocks:
            out[b.rows] = _attend_gemm(q[b.rows], kt_all[:, :, b.first: b.n_keys], vt_all[:, b.first: b.n_keys], b,
                                       scale, group)
        return out
    if cpu:
        q, keys, values = q.float(), keys.float(), values.float()
    kt_all = keys.transpose(0, 1)  # [Hk, c, D]
    vt_all = values.transpose(0, 1)
    for b in blocks:
        kt, vt = kt_all[:, b.first: b.n_keys], vt_all[:, b.first: b.n_keys]
        if record is not None:
            out[b.rows] = _attend_recording(q[b.rows].transpose(0, 1), kt, vt, b, scale, group, record, q.shape)
        elif cpu:
            out[b.rows] = _attend_split(q[b.rows], kt, vt, b, scale, group)
        else:
            o = F.scaled_dot_product_attention(q[b.rows].transpose(0, 1), kt, vt, attn_mask=b.bias(q.dtype),
                                               scale=scale, enable_gqa=group > 1)
            out[b.rows] = o.transpose(0, 1)
    return out


# _attend_gemm's layout: each key's head dims, then a 1 that multiplies the query's shift, then zeros (8 extra rows in
# all: oneDNN ran the 72-deep product as fast as the 64-deep one, a 65-deep one slower)
SHIFT_ROWS = 8
# keys of a block whose scores estimate each query's shift: the first SHIFT_SINK (attention sinks) and the last
# SHIFT_LOCAL before the masked part, with the whole masked part (there every row sees at least its own position)
SHIFT_SINK, SHIFT_LOCAL = 4, 64


def _keys_with_shift_row(keys):
    """keys [c, Hk, D] -> [Hk, D + SHIFT_ROWS, c]: transposed once per layer for the score product, with a row of ones
    the shift column of the queries multiplies."""
    c, hk, d = keys.shape
    kt = keys.new_zeros(hk, d + SHIFT_ROWS, c)
    kt[:, :d] = keys.permute(1, 2, 0)
    kt[:, d] = 1
    return kt


def _attend_gemm(q, kt, vt, b: _Block, scale, group):
    """One block in bf16 matmuls on CPU. A bf16 matmul sums in float32 but rounds its result to bf16, which costs a
    score of 20 an error of 0.04, i.e. 4 % of its weight; so each query row subtracts, inside the same float32 sum, an
    estimate of its largest score (an extra query column times the keys' row of ones): the scores that carry the
    softmax's weight are then near 0 and round finely, and softmax does not change under a per-row shift. The
    estimate is the row's best score over a few keys (sinks, the nearest ones, the masked part); softmax still
    subtracts the true maximum, so the estimate decides only how finely the scores round. On the default model's real
    activations (6.4K keys, 920 late queries, 7 of its layers, 2-core AMD EPYC with avx512_bf16) the output's
    relative error to float32 was 1.7-2.0e-3 mean and 6.8e-3 at most, against 1.6-1.7e-3 / 3.6e-3 for SDPA's bf16
    kernel and 1.7-3.5e-3 / 3.6e-2 without the shift (bf16 rounding of the output alone: 1.6e-3); 32 ms a layer
    against 51-54 for float32 flash attention (_attend_split)."""
    rows, hk, d = q.shape[0], kt.shape[0], q.shape[-1]
    exact = math.frexp(scale)[0] == 0.5  # a power of two scales q exactly in bf16; otherwise the scores are scaled
    qs = q.new_zeros(hk, group * rows, d + SHIFT_ROWS)
    qs[:, :, :d] = _stack_heads(q, hk)
    if exact:
        qs[:, :, :d] *= scale
    bias, masked = b.bias(q.dtype, group), b.shared - b.first  # kt, vt start at key b.first
    local = max(masked - SHIFT_LOCAL, 0)
    few = kt[:, :, local:] if local <= SHIFT_SINK else torch.cat([kt[:, :, :SHIFT_SINK], kt[:, :, local:]], 2)
    est = torch.bmm(qs, few)
    if bias is not None:
        est[:, :, est.shape[2] - bias.shape[1]:] += bias
    qs[:, :, d] = est.amax(-1).neg_()
    scores = torch.bmm(qs, kt)
    if bias is not None:
        scores[:, :, masked:] += bias
    if not exact:
        scores *= scale
    probs = torch.softmax(scores, -1)
    o = torch.stack([probs[h] @ vt[h] for h in range(hk)])  # per head: bmm would copy vt, a slice of the context
    return _unstack_heads(o, rows)


def _attend_split(q, kt, vt, b: _Block, scale, group):
    """One block on CPU: the query heads of each KV head stacked along the query axis (K/V read once per KV head),
    the shared keys without a mask and the rest with it, merged by log-sum-exp in float32. The unmasked part is the
    bulk of the keys; CPU flash attention with a mask ran ~25 % slower than without (6.4K keys, bf16)."""
    rows, hk = q.shape[0], kt.shape[0]
    qs = _stack_heads(q, hk)[None]
    parts, shared = [], b.shared - b.first  # kt, vt start at key b.first
    if shared:
        parts.append(_flash(qs, kt[None, :, :shared], vt[None, :, :shared], None, scale))
    if b.n_keys > b.shared:
        bias = b.bias(q.dtype, group)
        parts.append(_flash(qs, kt[None, :, shared:], vt[None, :, shared:], None if bias is None else bias, scale))
    if len(parts) == 1:
        o = parts[0][0]
    else:
        (o1, l1), (o2, l2) = parts
        lse = torch.logaddexp(l1, l2)
        o = (o1.float() * (l1 - lse).exp().unsqueeze(-1) + o2.float() * (l2 - lse).exp().unsqueeze(-1)).to(q.dtype)
    return _unstack_heads(o, rows)


def _stack_heads(q, hk):
    """q [rows, Hq, D] -> [Hk, group * rows, D]: the query heads of each KV head stacked along the query axis, row
    (g, r) of KV head h being query head h * group + g at row r, so K/V are read once per KV head."""
    rows, hq, d = q.shape
    return q.view(rows, hk, hq // hk, d).permute(1, 2, 0, 3).reshape(hk, hq // hk * rows, d)


def _unstack_heads(o, rows):
    """_stack_heads' inverse on an output: [Hk, group * rows, Dv] -> [rows, Hq, Dv]."""
    hk, stacked, dv = o.shape
    return o.view(hk, stacked // rows, rows, dv).permute(2, 0, 1, 3).reshape(rows, stacked // rows * hk, dv)


def _flash(q, k, v, bias, scale):
    """CPU flash attention returning (output, float32 log-sum-exp per row): SDPA's public API hides the latter."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)[:2]
    return out[0], lse[0]


def _attend_recording(qb, kt, vt, b: _Block, scale, group, record, q_shape):
    """Explicit softmax, so the mean attention of the queries to each context key can be added to `record`. The query
    heads of each KV head are stacked along the query axis (K/V are read as they are, never repeated per group: at
    6.4K keys the repeat copied 15 MB a layer)."""
    hq, rows, d = qb.shape
    hk = kt.shape[0]
    logits = (qb.reshape(hk, group * rows, d) @ kt.transpose(1, 2)) * scale  # row (g, r) of KV head h
    shared = b.shared - b.first  # kt, vt start at key b.first (0 when recording: plan_blocks' whole context)
    if b.mask is not None:
        logits[:, :, shared:] = logits[:, :, shared:].masked_fill(~b.mask.repeat(group, 1), float("-inf"))
    probs = logits.softmax(-1)
    record += probs[:, :, : record.shape[0]].float().sum((0, 1)) / (q_shape[0] * q_shape[1])
    return (probs @ vt).view(hq, rows, -1).transpose(0, 1)
