"""sglang_patch.paged_attention builds FlashInfer's plan (indptrs, page-size-1 indices, row-major custom mask) so
that each query sees exactly its request's keys at positions <= its own. No GPU here: FlashInfer is replaced by a
model of its documented paged-prefill contract, and the result is checked against the torch path's `attend`."""

import sys
import types

import torch

from chunkcache.blend.attention import attend
from sglang_patch.sparse_attention import Segment


class FakeWrapper:
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper semantics for page_size 1 with a custom mask."""

    def __init__(self, workspace, layout, backend):
        assert layout == "NHD" and backend == "fa2"

    def plan(self, qo, kv, indices, last, hq, hk, d, page_size, head_dim_vo, custom_mask, sm_scale, q_data_type,
             kv_data_type):
        assert page_size == 1 and bool((last == 1).all()) and qo.dtype == kv.dtype == indices.dtype == torch.int32
        self.qo, self.kv, self.indices, self.mask, self.scale = qo.tolist(), kv.tolist(), indices, custom_mask, sm_scale
        assert custom_mask.numel() == sum((qo[i + 1] - qo[i]) * (kv[i + 1] - kv[i]) for i in range(len(qo) - 1))

    def run(self, q, kv_cache):
        k_buf, v_buf = kv_cache
        out, m = [], 0
        for i in range(len(self.qo) - 1):
            nq, nk = self.qo[i + 1] - self.qo[i], self.kv[i + 1] - self.kv[i]
            slots = self.indices[self.kv[i]: self.kv[i + 1]].long()
            allowed = self.mask[m: m + nq * nk].view(nq, nk)
            m += nq * nk
            qi = q[self.qo[i]: self.qo[i + 1]].transpose(0, 1)
            keys, values = k_buf[slots].transpose(0, 1), v_buf[slots].transpose(0, 1)
            group = qi.shape[0] // keys.shape[0]
            probs = ((qi @ keys.repeat_interleave(group, 0).transpose(1, 2)) * self.scale).masked_fill(~allowed, -torch.inf)
            out.append((probs.softmax(-1) @ values.repeat_interleave(group, 0)).transpose(0, 1))
        return torch.cat(out)


def test_plan_matches_the_torch_path(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=FakeWrapper))
    from sglang_patch.paged_attention import PagedSparsePrefill

    torch.manual_seed(0)
    hq, hk, d, slots = 6, 2, 16, 64
    k_buf, v_buf = torch.randn(slots, hk, d), torch.randn(slots, hk, d)
    perm = torch.randperm(slots)
    # two requests: sparse selected positions 3, 7, 8, 15 of a 16-token row, and a contiguous run 20..23 of 24
    segments = [Segment(slice(0, 4), torch.tensor([3, 7, 8, 15]), perm[:16]),
                Segment(slice(4, 8), torch.arange(20, 24), perm[16:40])]
    q = torch.randn(8, hq, d)
    plan = PagedSparsePrefill(segments, hq, hk, d, d, 0.25, q.dtype, k_buf.dtype, torch.device("cpu"))
    got = torch.empty_like(q)
    got[plan.rows] = plan.run(q, k_buf, v_buf)
    for s in segments:
        keys, values = k_buf[s.ctx_slots], v_buf[s.ctx_slots]
        want = attend(q[s.rows], keys, values, s.q_pos, torch.arange(len(s.ctx_slots)), 0.25)
        torch.testing.assert_close(got[s.rows], want, rtol=1e-5, atol=1e-5)
