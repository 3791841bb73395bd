"""GPU attention for the blend passes: FlashInfer's paged prefill in two passes merged by log-sum-exp (plan once,
run per layer).

The pool-writing segments of a pass become FlashInfer batches over their KV rows read in place from the pool (page
size 1, no gather). A query at position p sees the keys at positions <= p. FlashInfer's causal mask is bottom-right
aligned (exact only for a contiguous run of queries at the end of the KV list), so sparse queries need a mask; a
custom mask over a whole row, though, makes FA2 iterate over every key tile with the per-element mask test, and
measured slower than SGLang's own full causal prefill on an H100 (docs/bench/gpu.md: 0.42-0.65x at 4K-32K,
rho 0.15, Llama-3-8B's attention shape). So each segment's rows are cut into groups whose positions span at most
`GROUP_SPAN`, and a group [first, last] attends in two passes (notes/flashinfer.md, B):
  1. every row of the group to the keys before `first`, all visible: no mask, so any backend (FA3 on Hopper);
  2. to the keys [first, last] with the small custom mask `key position <= query position` (FA2, the only FlashInfer
     backend with custom masks),
merged with flashinfer.merge_state. A group starting at position 0 has no first pass. Segments that keep their KV
aside (standalone chunks) or record attention stay on the torch path (`chunkcache.blend.attention`).

Checked on an H100 (tests/test_paged_attention.py, real flashinfer, against a float32 reference); selected only on
CUDA devices with flashinfer installed.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace per wrapper; SGLang's default size
# Widest span of positions in one group: the masked pass costs rows x span, the unmasked one rows x keys before it.
# 512 is the chunk size gpu_blend's two-pass variant was measured with (1.06-3.0x full causal at 4K-32K).
GROUP_SPAN = 512
_workspaces: dict[tuple[torch.device, int], torch.Tensor] = {}


def available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None


def groups(q_pos: list[int], span: int = GROUP_SPAN) -> list[tuple[int, int]]:
    """[start, end) row ranges of sorted positions `q_pos`, each spanning at most `span` positions."""
    out, start = [], 0
    for i in range(1, len(q_pos) + 1):
        if i == len(q_pos) or q_pos[i] - q_pos[start] >= span:
            out.append((start, i))
            start = i
    return out


def _workspace(device: torch.device, which: int) -> torch.Tensor:
    if (device, which) not in _workspaces:
        _workspaces[device, which] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device, which]


class PagedSparsePrefill:
    """One pass's FlashInfer plans over `segments` (each: q_pos [m] positions, ctx_slots [c] pool slots)."""

    def __init__(self, segments, num_qo_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int,
                 scale: float, q_dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
                 grouping: Callable[[list[int]], list[tuple[int, int]]] = groups):
        """`grouping`: a segment's sorted positions -> its row groups ([start, end) ranges covering every row)."""
        import flashinfer

        if not _workspaces:
            log.info("chunkcache: FlashInfer two-pass paged prefill on %s", device)
        i32 = dict(dtype=torch.int32, device=device)
        rows, before, within = [], [], []  # pass rows; (rows, kv slots) of the unmasked and of the masked pass
        mask = []
        for s in segments:
            q_pos = s.q_pos.tolist()
            for a, b in grouping(q_pos):
                first, last = q_pos[a], q_pos[b - 1]
                group_rows = torch.arange(s.rows.start + a, s.rows.start + b)
                rows.append(group_rows)
                if first:
                    before.append((len(rows) - 1, s.ctx_slots[:first]))
                within.append(s.ctx_slots[first: last + 1])
                mask.append((first + torch.arange(last + 1 - first, device=device)[None, :]
                             <= s.q_pos[a:b].to(device)[:, None]).flatten())
        sizes = [len(r) for r in rows]
        self.rows = torch.cat(rows).to(device)
        common = dict(head_dim_vo=head_dim_v, sm_scale=scale, q_data_type=q_dtype, kv_data_type=kv_dtype)

        def indptr(lengths):
            return torch.tensor([0] + list(lengths), **i32).cumsum(0, dtype=torch.int32)

        self.within = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(device, 0), "NHD", backend="fa2")
        self.within.plan(indptr(sizes), indptr(len(w) for w in within), torch.cat(within).to(**i32),
                         torch.ones(len(within), **i32), num_qo_heads, num_kv_heads, head_dim, 1,
                         custom_mask=torch.cat(mask), **common)
        self.before = None
        if before:
            # the rows of the groups that have keys before them, as indices into self.rows
            starts = torch.tensor([0] + sizes).cumsum(0).tolist()
            self.merged = torch.cat([torch.arange(starts[g], starts[g + 1]) for g, _ in before]).to(device)
            self.before = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(device, 1), "NHD",
                                                                         backend="auto")
            self.before.plan(indptr(sizes[g] for g, _ in before), indptr(len(k) for _, k in before),
                             torch.cat([k for _, k in before]).to(**i32), torch.ones(len(before), **i32),
                             num_qo_heads, num_kv_heads, head_dim, 1, causal=False, **common)
        self._merge = flashinfer.merge_state

    def run(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
        """Outputs [rows, Hq, Dv] for `self.rows` of the pass's q [n, Hq, D]."""
        q_rows = q[self.rows].to(k_buf.dtype)
        out, lse = self.within.run(q_rows, (k_buf, v_buf), return_lse=True)
        if self.before is not None:
            o1, s1 = self.before.run(q_rows[self.merged], (k_buf, v_buf), return_lse=True)
            out[self.merged] = self._merge(o1, s1, out[self.merged], lse[self.merged])[0]
        return out
