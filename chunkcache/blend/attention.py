"""Position-causal attention: queries at arbitrary positions of one request, each attending to the keys at or before
its own position (and, in a sliding-window layer, no more than `window` positions before it). Both engines run every
blended pass through it: the reference blender (chunkcache.reference) on its per-request buffers, the SGLang glue
(sglang_patch.forward.sparse_attention) on the KV pool. Cost is O(queries x keys) per layer, not the O(N^2) of a padded
square.

Plan/run split: the blocks and masks depend only on positions, so `plan_blocks` runs once per pass and
`attend_blocks` once per layer.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..config import home
from ..cpu_dtype import best_seconds, host_signature, kept_per_host

# Query rows per attention call of the block plan (GPU SDPA, recording, sliding windows, the bf16 matmul kernel).
# Rows are sorted by position, so a block only needs the keys up to its last row's position: smaller blocks skip more
# of the masked upper triangle, larger ones make fewer, larger kernel calls (64 was the fastest of 32-512 for ~500
# queries spread over 3.2K keys on a 2-core CPU, fp32 and bf16; with the bf16 matmul kernel, 920 queries over 6.4K
# keys: 28.7 ms at 64, 28.1-28.2 at 96-128, 32.8 at 32, 45.3 at 192).
QUERY_BLOCK = 64
# Rows of the staircase's leaf tiles (CPU flash attention over ordered keys): a leaf attends its masked diagonal,
# every larger tile a rectangle no row of which is masked. 64 and 128 ran alike (1,050 late-biased queries over 6.7K
# keys, bf16, AMX host: 36-40 ms a layer), 32 and 256 slower (more small calls; larger masked diagonals).
STAIR_LEAF = 64


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
        return _mask_bias(self._bias, self.mask, dtype, group)


@dataclass
class _Tile:
    """Rows [rows) attending keys [keys) of a staircase; a row is in one tile per level of it, merged by log-sum-exp."""

    rows: slice
    keys: slice
    mask: torch.Tensor | None  # [rows, keys] bool; None: every row sees every key of the tile
    first: bool  # no earlier tile holds these rows: its output is assigned, not merged
    _bias: dict = field(default_factory=dict)

    def bias(self, dtype: torch.dtype, group: int) -> torch.Tensor | None:
        return _mask_bias(self._bias, self.mask, dtype, group)


def _mask_bias(cache: dict, mask: torch.Tensor | None, dtype: torch.dtype, group: int) -> torch.Tensor | None:
    if mask is None:
        return None
    if (dtype, group) not in cache:
        cache[dtype, group] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, float("-inf")).repeat(group, 1)
    return cache[dtype, group]


@dataclass
class AttentionPlan:
    """What attending one set of sorted queries needs, for every layer of a pass: row blocks always, and on CPU,
    where the keys are the request's positions in order and no window applies, the staircase."""

    blocks: list[_Block]
    tiles: list[_Tile] | None
    # on CPU, what the bf16 matmuls' shift reads (_attend_gemm), as indices into the key axis: each query's own key,
    # the keys at the first SHIFT_SINK positions, and which of those each query sees (None: all of them)
    own: torch.Tensor | None = None  # [m]
    sinks: torch.Tensor | None = None  # [<= SHIFT_SINK]
    sinks_seen: torch.Tensor | None = None  # [m, <= SHIFT_SINK]
    _bias: dict = field(default_factory=dict)

    def sink_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """`sinks_seen` as 0 / -inf in `dtype`, made once per pass."""
        return _mask_bias(self._bias, self.sinks_seen, dtype, 1)


def plan_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, whole_context: bool,
                window: int | None = None) -> AttentionPlan:
    """Query blocks of QUERY_BLOCK rows (q_pos sorted) with their masks. When the keys sit at positions 0..c-1 in
    order, a block needs only a range of them, unless `whole_context` (recording attention to every key), and on CPU
    the keys before its first row's position are `shared` (only the rest needs a mask); over keys in another order,
    on CPU, the leading keys every row of the block sees. `window`: a sliding-window layer's, as SGLang's
    RadixAttention.sliding_window_size counts it (a query sees keys q - window .. q). On CPU also each query's own key
    and which keys of the first SHIFT_SINK positions it sees (the bf16 matmuls' shift: _attend_gemm)."""
    ordered = not whole_context and torch.equal(k_pos, torch.arange(len(k_pos), device=k_pos.device))
    cpu = q_pos.device.type == "cpu"
    blocks = []
    for start in range(0, len(q_pos), QUERY_BLOCK):
        blk = slice(start, start + QUERY_BLOCK)
        qp = q_pos[blk]
        n_keys = int(qp.max()) + 1 if ordered else len(k_pos)
        first = max(0, int(qp.min()) - window) if ordered and window is not None else 0
        # the split is the CPU strategy (attend_blocks); every row sees at least its own position in the masked
        # part, so no row of it is empty. Behind a window the block's keys are few: all of them masked.
        shared = int(qp.min()) if ordered and window is None and cpu else first
        keys = k_pos[None, shared:n_keys]
        allowed = keys <= qp[:, None]
        if window is not None:
            allowed &= keys >= qp[:, None] - window
        if cpu and not ordered:  # the leading keys every row sees need no mask either (a query pass's context)
            lead = int(allowed.all(0).int().cumprod(0).sum())
            shared, allowed = shared + lead, allowed[:, lead:]
        blocks.append(_Block(blk, n_keys, None if bool(allowed.all()) else allowed, shared, first))
    tiles = _staircase(q_pos) if ordered and window is None and cpu and len(q_pos) else None
    if not cpu or not len(q_pos):
        return AttentionPlan(blocks, tiles)
    order = torch.arange(len(k_pos)) if ordered else torch.argsort(k_pos)
    own = q_pos if ordered else order[torch.searchsorted(k_pos[order], q_pos).clamp_(max=len(k_pos) - 1)]
    if not torch.equal(k_pos[own], q_pos):
        raise ValueError("a query's own position is missing from its keys")
    sinks = order[:SHIFT_SINK]
    seen = k_pos[None, sinks] <= q_pos[:, None]
    if window is not None:
        seen &= k_pos[None, sinks] >= q_pos[:, None] - window
    return AttentionPlan(blocks, tiles, own, sinks, None if bool(seen.all()) else seen)


def _staircase(q_pos: torch.Tensor) -> list[_Tile]:
    """Tiles covering exactly what sorted queries over ordered keys see, in few large unmasked rectangles: rows
    [lo, hi) all see the keys before position q_pos[lo] (one tile, no mask), then each half of the rows recurses on
    the keys from there; a leaf of at most STAIR_LEAF rows attends the rest with a mask. Every row's own position is
    in its leaf, so no tile leaves a row with nothing to attend. A parent's tile precedes its children's."""
    pos = q_pos.tolist()
    tiles: list[_Tile] = []
    todo = [(0, len(pos), 0, True)]  # (lo, hi, first key, no tile holds these rows yet)
    while todo:
        lo, hi, key, fresh = todo.pop()
        if hi - lo <= STAIR_LEAF:
            allowed = torch.arange(key, pos[hi - 1] + 1)[None] <= q_pos[lo:hi, None]
            tiles.append(_Tile(slice(lo, hi), slice(key, pos[hi - 1] + 1), None if bool(allowed.all()) else allowed,
                               fresh))
            continue
        if pos[lo] > key:
            tiles.append(_Tile(slice(lo, hi), slice(key, pos[lo]), None, fresh))
            key, fresh = pos[lo], False
        mid = lo + -(-(hi - lo) // 2 // STAIR_LEAF) * STAIR_LEAF  # halves, the first a whole number of leaves
        todo += [(mid, hi, key, fresh), (lo, mid, key, fresh)]
    return tiles


log = logging.getLogger(__name__)


@functools.cache
def bf16_kernel() -> str:
    """"flash" or "gemm": the faster bf16 CPU kernel on this host, measured once per host (chunkcache.cpu_dtype's
    signature) and kept in `home()/host-attention.json`. Which one wins is the host's: bf16 matmuls at 830-910
    GFLOP/s against flash attention's 160 on an AMD EPYC with avx512_bf16 (the matmuls 32 ms a layer, flash 51-54);
    flash attention over the staircase 36-40 ms against the matmuls' 76-94 on an Intel Xeon with AMX."""
    entry = kept_per_host(home() / "host-attention.json", host_signature(), _measure_bf16_kernels)
    log.info("chunkcache: bf16 CPU attention kernel for this host: %s (ms a layer: %s)", entry["kernel"], entry["ms"])
    return entry["kernel"]


def _measure_bf16_kernels(keys: int = 3200, repeats: int = 3) -> dict:
    """Both kernels on one layer of the default model's attention shape (9 query heads, 3 KV heads, d 64): 15 % of
    `keys` positions recomputed, most of them late, plus a 40-token query; the best of `repeats` runs each."""
    gen = torch.Generator().manual_seed(0)
    body = keys - 40
    picks = torch.randperm(body, generator=gen)[: int(0.15 * keys)].sort().values
    q_pos = torch.cat([picks, torch.arange(body, keys)])
    q = torch.randn(len(q_pos), 9, 64, generator=gen).bfloat16()
    k, v = (torch.randn(keys, 3, 64, generator=gen).bfloat16() for _ in range(2))
    plan = plan_blocks(q_pos, torch.arange(keys), False)
    runs = {"flash": lambda: _attend_tiles(q, k, v, plan.tiles, 0.125),
            "gemm": lambda: _attend_gemm(q, k, v, plan, 0.125, 3)}
    ms = {}
    for name, run in runs.items():
        ms[name] = round(1e3 * best_seconds(run, repeats), 2)
    return {"kernel": min(ms, key=ms.get), "ms": ms}


def attend(q, keys, values, q_pos, k_pos, scale, record=None, window=None):
    """q [m, Hq, D] at positions q_pos (sorted); keys/values [c, Hk, D] at k_pos. One-shot form of attend_blocks."""
    return attend_blocks(q, keys, values, plan_blocks(q_pos, k_pos, record is not None, window), scale, record)


def attend_blocks(q, keys, values, plan: AttentionPlan, scale, record=None):
    """q [m, Hq, D]; keys/values [c, Hk, D]; `plan` from plan_blocks over q's rows. GQA by head grouping. On CPU the
    kernel follows the dtype, which `serve.dtype: auto` chooses per host by timing bf16 against fp32 matmuls
    (chunkcache.cpu_dtype): float32 (and any non-bf16 dtype, upcast) runs flash attention over the staircase
    (_attend_tiles); bfloat16 runs whichever of bf16 flash attention over the staircase and bf16 matmuls
    (_attend_gemm) this host measured faster (bf16_kernel). A sliding window takes the blocks."""
    group = q.shape[1] // keys.shape[1]
    cpu = q.device.type == "cpu" and record is None
    if cpu and q.dtype == torch.bfloat16 and (plan.tiles is None or bf16_kernel() == "gemm"):
        return _attend_gemm(q, keys, values, plan, scale, group)
    if cpu and plan.tiles is not None:
        if q.dtype == torch.bfloat16:
            return _attend_tiles(q, keys, values, plan.tiles, scale)
        return _attend_tiles(q.float(), keys.float(), values.float(), plan.tiles, scale).to(q.dtype)
    out = torch.empty(q.shape[0], q.shape[1], values.shape[-1], dtype=q.dtype, device=q.device)
    if cpu:
        q, keys, values = q.float(), keys.float(), values.float()
    kt_all = keys.transpose(0, 1)  # [Hk, c, D]
    vt_all = values.transpose(0, 1)
    for b in plan.blocks:
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


def _attend_tiles(q, keys, values, tiles: list[_Tile], scale):
    """CPU flash attention in q's dtype over a staircase: one kernel call per tile, the query heads of each KV head
    stacked along the query axis (K/V read once per KV head), each tile's output merged into its rows' running
    output by log-sum-exp in float32. The large unmasked tiles run at the causal kernel's rate per (query, key) pair
    (1,000+ stacked rows: within 10 % of it; 192 rows: ~1.7x its cost), which one call per 64-row block did not."""
    m, hq, d = q.shape
    hk = keys.shape[1]
    group = hq // hk
    stacked = q.view(m, hk, group, d).permute(1, 2, 0, 3)  # [Hk, group, m, D]
    kt, vt = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    acc = torch.empty(hk, group, m, values.shape[-1], dtype=torch.float32)
    lse = torch.empty(hk, group, m, dtype=torch.float32)
    for t in tiles:
        rows = t.rows.stop - t.rows.start
        o, l = _flash(stacked[:, :, t.rows].reshape(1, hk, group * rows, d), kt[:, :, t.keys], vt[:, :, t.keys],
                      t.bias(q.dtype, group), scale)
        o, l = o.view(hk, group, rows, -1), l.view(hk, group, rows)
        a, s = acc[:, :, t.rows], lse[:, :, t.rows]
        if t.first:
            a.copy_(o)
            s.copy_(l)
            continue
        # softmax over both parts: the new part weighs exp(l) / (exp(s) + exp(l)) = sigmoid(l - s)
        gap = l - s
        a.lerp_(o.float(), torch.sigmoid(gap).unsqueeze(-1))
        s.add_(F.softplus(gap))
    return acc.permute(2, 0, 1, 3).reshape(m, hq, -1).to(q.dtype)


# _attend_gemm's layout: each key's head dims, then a 1 that multiplies the query's shift, then zeros (8 extra rows in
# all: oneDNN ran the 72-deep product as fast as the 64-deep one, a 65-deep one slower)
SHIFT_ROWS = 8
# the first positions, whose keys' scores (attention sinks) estimate each query's shift with its own key's
SHIFT_SINK = 4


def _keys_with_shift_row(keys):
    """keys [c, Hk, D] -> [Hk, D + SHIFT_ROWS, c]: transposed once per layer for the score product, with a row of ones
    the shift column of the queries multiplies."""
    c, hk, d = keys.shape
    kt = keys.new_zeros(hk, d + SHIFT_ROWS, c)
    kt[:, :d] = keys.permute(1, 2, 0)
    kt[:, d] = 1
    return kt


def _attend_gemm(q, keys, values, plan: AttentionPlan, scale, group):
    """One layer's queries in bf16 matmuls on CPU. A bf16 matmul sums in float32 but rounds its result to bf16,
    which costs a score of 20 an error of 0.04, i.e. 4 % of its weight; so each query row subtracts, inside the same
    float32 sum, an estimate of its largest score (an extra query column times the keys' row of ones): the scores that
    carry the softmax's weight are then near 0 and round finely, and softmax does not change under a per-row shift.
    The estimate is the row's best score over the first SHIFT_SINK positions it sees (attention sinks) and its own key
    (which it always sees), made once per layer for every row; softmax still subtracts the true maximum, so the
    estimate decides only how finely the scores round. Each block of rows is then one score product, one softmax and
    one value product, the query heads of each KV head stacked along the query axis (K/V read once per KV head).
    On the default model's real activations (a MuSiQue prompt's layers 1-29 by 4, 909 and 2,000 keys, 12 % of the
    positions plus a 25-token tail) the output's relative error to float32 was 2.0e-3 mean, as for SDPA's bf16 flash
    kernel (1.9e-3) and for an estimate over each block's sinks, nearest keys and masked part (1.95e-3), against
    3.1e-3 without the shift. That estimate, with three per-head value products, cost every block three more matmul
    calls: in the server the recompute pass now takes 0.89 of its time at ~900 tokens and 0.87 at ~1.8K (medians of
    20 and 12 paired blends, 2-core AMD EPYC with avx512_bf16)."""
    m, hq, d = q.shape
    hk = keys.shape[1]
    if not m:
        return q.new_empty(0, hq, values.shape[-1])
    exact = math.frexp(scale)[0] == 0.5  # a power of two scales q exactly in bf16; otherwise the scores are scaled
    kt, vt = _keys_with_shift_row(keys), values.transpose(0, 1).contiguous()
    qs = q.new_empty(hk, group, m, d + SHIFT_ROWS)  # (h, g, r): query head h * group + g at row r
    qs[..., :d] = q.view(m, hk, group, d).permute(1, 2, 0, 3)
    qs[..., d + 1:] = 0
    if exact:
        qs[..., :d] *= scale
    sinks = torch.bmm(qs[..., :d].view(hk, group * m, d), kt[:, :d, plan.sinks]).view(hk, group, m, -1)
    unseen = plan.sink_bias(q.dtype)
    if unseen is not None:
        sinks += unseen
    own = (qs[..., :d] * keys[plan.own].transpose(0, 1)[:, None]).sum(-1)
    qs[..., d] = torch.maximum(sinks.amax(-1), own).neg_()
    out = q.new_empty(m, hq, values.shape[-1])
    for b in plan.blocks:
        rows = len(range(m)[b.rows])
        scores = torch.bmm(qs[:, :, b.rows].reshape(hk, group * rows, -1), kt[:, :, b.first: b.n_keys])
        bias = b.bias(q.dtype, group)
        if bias is not None:
            scores[:, :, b.shared - b.first:] += bias
        if not exact:
            scores *= scale
        out[b.rows] = _unstack_heads(torch.bmm(torch.softmax(scores, -1), vt[:, b.first: b.n_keys]), rows)
    return out


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
    """Explicit softmax in float32, so the mean attention of the queries to each context key can be added to
    `record`; the mask is added to the scores of the keys after `shared` only (in a query pass, its own rows), the
    value product runs in the values' dtype. The query heads of each KV head are stacked along the query axis (K/V
    are read as they are, never repeated per group: at 6.4K keys the repeat copied 15 MB a layer). In the server a
    ~1.8K-token blend's query pass took 0.77 of the time it took with one baddbmm over a mask as wide as the context
    and the value product in float32 (median of 12 paired blends, 2-core AMD EPYC with avx512_bf16)."""
    hq, rows, d = qb.shape
    hk = kt.shape[0]
    q = qb.reshape(hk, group * rows, d).float().mul_(scale)  # row (g, r) of KV head h
    logits = torch.bmm(q, kt.float().transpose(1, 2))
    bias = b.bias(torch.float32, group)
    if bias is not None:
        logits[:, :, b.shared - b.first:] += bias
    probs = logits.softmax(-1)
    record += probs[:, :, : record.shape[0]].sum((0, 1)) / (q_shape[0] * q_shape[1])
    return torch.bmm(probs.to(vt.dtype), vt).view(hq, rows, -1).transpose(0, 1).to(qb.dtype)
