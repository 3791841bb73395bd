"""Attention for the passes of a blended prefill (torch path; on CUDA with FlashInfer, see paged_attention).

Each segment is a set of queries at arbitrary positions of one request; a query attends, by position, to the KV of
its request row (reused or freshly written) and never to later positions. Cost is O(queries x context) per layer,
where SGLang's torch_native extend pads every request to a full N x N square.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import paged_attention

# Query rows per attention call. Rows are sorted by position, so a block only needs the keys up to its last row's
# position: small blocks skip the masked upper triangle (about half the work for queries spread over the prompt).
QUERY_BLOCK = 128


@dataclass
class Segment:
    rows: slice  # this segment's rows among the forward's tokens
    q_pos: torch.Tensor  # [m] positions of those rows in their request
    ctx_slots: torch.Tensor  # [c] KV-pool slots of positions 0..c-1 (the key axis)
    write: bool = True  # fresh K/V go to the pool at out_cache_loc; else they are kept in `scratch`
    scratch: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer, standalone chunks
    record: torch.Tensor | None = None  # [c] if set: += mean attention of the queries to each context key


class SparseAttention:
    """Takes the place of the model runner's attention backend for one pass (see sglang_patch.blend)."""

    def __init__(self, base, segments: list[Segment]):
        self.token_to_kv_pool = base.token_to_kv_pool
        self.req_to_token_pool = base.req_to_token_pool
        self.segments = segments
        self.paged = None  # GPU: the FlashInfer plan of the paged segments, made at the first layer
        self.torch_segments = segments

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        hq, hk, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        q, k, v = q.view(-1, hq, d), k.view(-1, hk, d), v.view(-1, hk, dv)
        pool = self.token_to_kv_pool
        written = [s for s in self.segments if s.write]
        if written:
            rows = torch.cat([torch.arange(s.rows.start, s.rows.stop) for s in written]).to(q.device)
            pool.set_kv_buffer(layer, forward_batch.out_cache_loc[rows], k[rows], v[rows])
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        out = q.new_empty(q.shape[0], hq, dv)
        if self.paged is None and paged_attention.available(q.device):
            paged = [s for s in self.segments if s.write and s.record is None]
            self.torch_segments = [s for s in self.segments if not (s.write and s.record is None)]
            self.paged = paged and paged_attention.PagedSparsePrefill(
                paged, hq, hk, d, dv, layer.scaling, q.dtype, k_buf.dtype, q.device)
        if self.paged:
            out[self.paged.rows] = self.paged.run(q, k_buf, v_buf).to(q.dtype)
        for s in self.torch_segments:
            keys, values = k_buf[s.ctx_slots].to(q.dtype), v_buf[s.ctx_slots].to(q.dtype)
            k_pos = torch.arange(keys.shape[0], device=q.device)
            if not s.write:
                fresh_k, fresh_v = k[s.rows], v[s.rows]
                s.scratch.append((fresh_k.clone(), fresh_v.clone()))
                keys, values = torch.cat([keys, fresh_k]), torch.cat([values, fresh_v])
                k_pos = torch.cat([k_pos, s.q_pos])
            out[s.rows] = attend(q[s.rows], keys, values, s.q_pos, k_pos, layer.scaling, s.record)
        return out.view(-1, hq * dv)


def attend(q, keys, values, q_pos, k_pos, scale, record=None):
    """q [m, Hq, D] at positions q_pos; keys/values [c, Hk, D] at k_pos. GQA by head grouping."""
    group = q.shape[1] // keys.shape[1]
    kt_all = keys.transpose(0, 1)  # [Hk, c, D]
    vt_all = values.transpose(0, 1)
    # keys at positions 0..c-1 in order (pool rows): a block sees a prefix of them
    ordered = torch.equal(k_pos, torch.arange(len(k_pos), device=k_pos.device))
    out = torch.empty(q.shape[0], q.shape[1], values.shape[-1], dtype=q.dtype, device=q.device)
    for start in range(0, q.shape[0], QUERY_BLOCK):
        blk = slice(start, start + QUERY_BLOCK)
        n_keys = int(q_pos[blk].max()) + 1 if ordered and record is None else len(k_pos)
        kt, vt = kt_all[:, :n_keys], vt_all[:, :n_keys]
        qb = q[blk].transpose(0, 1)  # [Hq, b, D]
        allowed = k_pos[None, :n_keys] <= q_pos[blk, None]  # [b, keys]
        if record is None:
            o = F.scaled_dot_product_attention(qb, kt, vt, attn_mask=allowed, scale=scale, enable_gqa=group > 1)
        else:
            kg, vg = kt.repeat_interleave(group, 0), vt.repeat_interleave(group, 0)
            probs = ((qb @ kg.transpose(1, 2)) * scale).masked_fill(~allowed, float("-inf")).softmax(-1)
            record += probs[:, :, : record.shape[0]].float().sum((0, 1)) / (q.shape[0] * q.shape[1])
            o = probs @ vg
        out[blk] = o.transpose(0, 1)
    return out
