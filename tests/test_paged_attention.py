"""sglang_patch.forward.paged_attention builds FlashInfer's two plans (indptrs, page-size-1 indices, a row-major custom
mask within each group, none before it) so that each query sees exactly its request's keys at positions <= its own. On a
CPU, FlashInfer is replaced by a model of its documented paged-prefill contract; on a GPU with flashinfer the real
one runs. Either way the result is checked against a float32 reference of attention by position."""

import sys
import types

import pytest
import torch

from chunkcache.blend.attention import attend
from sglang_patch.forward.sparse_attention import Segment
from test_sparse_attention import dense


class FakeWrapper:
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper semantics for page_size 1: with a custom mask, or with none
    and causal=False (every key visible); run's log-sum-exp in natural log, as fake_merge_state takes it."""

    def __init__(self, workspace, layout, backend):
        assert layout == "NHD" and backend in ("fa2", "auto")
        self.backend = backend

    def plan(self, qo, kv, indices, last, hq, hk, d, page_size, head_dim_vo, sm_scale, q_data_type, kv_data_type,
             custom_mask=None, causal=False):
        assert page_size == 1 and bool((last == 1).all()) and qo.dtype == kv.dtype == indices.dtype == torch.int32
        assert custom_mask is not None or not causal, "FlashInfer's causal mask is bottom-right aligned"
        assert custom_mask is None or self.backend == "fa2", "only FA2 takes custom masks"
        self.qo, self.kv, self.indices, self.mask, self.scale = qo.tolist(), kv.tolist(), indices, custom_mask, sm_scale
        sizes = [(qo[i + 1] - qo[i]) * (kv[i + 1] - kv[i]) for i in range(len(qo) - 1)]
        assert custom_mask is None or custom_mask.numel() == sum(sizes)

    def run(self, q, kv_cache, return_lse=False):
        k_buf, v_buf = kv_cache
        assert q.shape[0] == self.qo[-1], "run's q must hold exactly the planned rows"
        out, lse, m = [], [], 0
        for i in range(len(self.qo) - 1):
            nq, nk = self.qo[i + 1] - self.qo[i], self.kv[i + 1] - self.kv[i]
            slots = self.indices[self.kv[i]: self.kv[i + 1]].long()
            allowed = torch.ones(nq, nk, dtype=torch.bool) if self.mask is None else self.mask[m: m + nq * nk].view(nq, nk)
            m += nq * nk
            qi = q[self.qo[i]: self.qo[i + 1]].transpose(0, 1).float()  # FlashInfer sums and softmaxes in fp32
            keys, values = k_buf[slots].transpose(0, 1).float(), v_buf[slots].transpose(0, 1).float()
            group = qi.shape[0] // keys.shape[0]
            logits = ((qi @ keys.repeat_interleave(group, 0).transpose(1, 2)) * self.scale).masked_fill(~allowed, -torch.inf)
            out.append((logits.softmax(-1) @ values.repeat_interleave(group, 0)).transpose(0, 1).to(q.dtype))
            lse.append(logits.logsumexp(-1).transpose(0, 1))
        return (torch.cat(out), torch.cat(lse)) if return_lse else torch.cat(out)


def fake_merge_state(v_a, s_a, v_b, s_b):
    s = torch.logaddexp(s_a, s_b)
    v = v_a.float() * (s_a - s).exp()[..., None] + v_b.float() * (s_b - s).exp()[..., None]
    return v.to(v_a.dtype), s


FAKE_FLASHINFER = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=FakeWrapper, merge_state=fake_merge_state)


def test_plan_matches_the_torch_path(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", FAKE_FLASHINFER)
    from sglang_patch.forward.paged_attention import PagedSparsePrefill

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


class _Pool:
    """The two calls SparseAttention makes of SGLang's MHATokenToKVPool, over per-layer buffers."""

    def __init__(self, layers, slots, hk, d, dtype, device):
        self.k = [torch.zeros(slots, hk, d, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(slots, hk, d, dtype=dtype, device=device) for _ in range(layers)]

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[layer.layer_id][loc], self.v[layer.layer_id][loc] = k.to(self.k[0].dtype), v.to(self.v[0].dtype)

    def get_key_buffer(self, i):
        return self.k[i]

    def get_value_buffer(self, i):
        return self.v[i]


def _has_flashinfer() -> bool:
    from sglang_patch.forward import paged_attention

    return torch.cuda.is_available() and paged_attention.available(torch.device("cuda"))


@pytest.mark.skipif(not _has_flashinfer(), reason="needs a CUDA device with flashinfer (the GPU machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_pass_matches_float32_reference_on_cuda(dtype):
    """The blend's attention backend as the server runs it on CUDA: SparseAttention puts the pool-writing segments
    into one FlashInfer plan (sglang_patch.forward.paged_attention, real flashinfer) made at the first full-attention
    layer and reused by the next, and keeps the others (standalone chunks, recorded attention, sliding-window layers) on
    the torch path. Every row is compared with a float32 reference of attention by position."""
    _check_pass(torch.device("cuda"), dtype, 2e-2)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_pass_routes_segments_on_cpu(monkeypatch, dtype, tolerance):
    """The same pass with FakeWrapper standing in for FlashInfer, so the routing (which segments go to the plan, one
    plan for every full-attention layer, windowed layers on the torch path) is checked without a GPU; in bfloat16
    the torch path's segments (standalone, windowed) run CPU attention's bf16 matmuls."""
    from sglang_patch.forward import paged_attention

    monkeypatch.setitem(sys.modules, "flashinfer", FAKE_FLASHINFER)
    monkeypatch.setattr(paged_attention, "available", lambda device: True)
    _check_pass(torch.device("cpu"), dtype, tolerance)


def _check_pass(dev, dtype, tolerance):
    from types import SimpleNamespace

    from sglang_patch.forward import paged_attention
    from sglang_patch.forward.sparse_attention import SparseAttention

    torch.manual_seed(0)
    hq, hk, d, slots = 32, 8, 128, 16_000
    perm = torch.randperm(12_000, device=dev) + 1  # slot 0 is SGLang's padding slot; 12001.. are request A's
    sel_a = torch.cat([torch.randperm(3000, device=dev)[:450].sort().values, torch.arange(3000, 3064, device=dev)])
    segments = [  # rows are laid out one segment after another in the pass
        Segment(slice(0, 514), sel_a, torch.arange(12_001, 15_065, device=dev)),  # sparse picks + query; a run
        Segment(slice(514, 770), torch.arange(4800, 5056, device=dev), perm[:5056]),  # a run at the end, scattered
        Segment(slice(770, 834), torch.arange(64, 128, device=dev), perm[6000:6064], to_pool=False),  # standalone
        Segment(slice(834, 900), torch.arange(1934, 2000, device=dev), perm[7000:9000],
                attention_sum=torch.zeros(2000, device=dev)),  # recorded attention
        Segment(slice(900, 1600), torch.arange(0, 700, device=dev), perm[9000:9700]),  # a plain prefill from 0
    ]
    rows = 1600
    out_cache_loc = torch.zeros(rows, dtype=torch.long, device=dev)
    for s in segments:  # a query's own K/V goes to the slot of its position
        if s.to_pool:
            out_cache_loc[s.rows] = s.ctx_slots[s.q_pos]
    layers = [SimpleNamespace(layer_id=0, logit_cap=0, sliding_window_size=-1), SimpleNamespace(
        layer_id=1, logit_cap=0, sliding_window_size=-1), SimpleNamespace(layer_id=2, logit_cap=0,
                                                                          sliding_window_size=512)]
    for layer in layers:
        layer.__dict__.update(tp_q_head_num=hq, tp_k_head_num=hk, qk_head_dim=d, v_head_dim=d, scaling=d ** -0.5)
    pool = _Pool(len(layers), slots, hk, d, dtype, dev)
    for i in range(len(layers)):  # the reused context already in the pool
        pool.k[i].normal_()
        pool.v[i].normal_()
    attn = SparseAttention(SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=None), segments, out_cache_loc,
                           dev)
    assert isinstance(attn.paged, list) and len(attn.paged) == 3, "the pool-writing segments did not go to the plan"
    for layer in layers:
        q, k, v = (torch.randn(rows, h, d, device=dev, dtype=dtype) for h in (hq, hk, hk))
        got = attn.forward(q.view(rows, -1), k.view(rows, -1), v.view(rows, -1), layer, None).view(rows, hq, d)
        if layer.layer_id == 0:
            plan = attn.paged
        window = None if layer.sliding_window_size < 0 else layer.sliding_window_size
        for s in segments:
            keys, values = pool.k[layer.layer_id][s.ctx_slots].float(), pool.v[layer.layer_id][s.ctx_slots].float()
            k_pos = torch.arange(len(s.ctx_slots), device=dev)
            if not s.to_pool:
                keys, values = torch.cat([keys, k[s.rows].float()]), torch.cat([values, v[s.rows].float()])
                k_pos = torch.cat([k_pos, s.q_pos])
            want = attend(q[s.rows].float(), keys, values, s.q_pos, k_pos, layer.scaling, window=window)
            err = (got[s.rows].float() - want).abs().max() / want.abs().max()
            assert err < tolerance, f"layer {layer.layer_id}, segment rows {s.rows}: relative error {err:.2e}"
    assert isinstance(attn.paged, paged_attention.PagedSparsePrefill), "the FlashInfer plan was never made"
    assert plan is attn.paged, "the plan was made again at a later layer"


def test_groups_span_at_most_the_limit():
    from sglang_patch.forward.paged_attention import groups

    assert groups([]) == []
    assert groups([5], span=4) == [(0, 1)]
    # 0..3 spans 4 positions (the most), so 4 starts a group; 10 is 6 past 4
    assert groups([0, 1, 2, 3, 4, 10, 11], span=4) == [(0, 4), (4, 5), (5, 7)]
    assert groups(list(range(1000, 2024))) == [(0, 512), (512, 1024)]


@pytest.mark.parametrize("window", [-1, 40])
def test_a_logits_pass_attends_only_each_segments_last_row_at_the_final_layer(window):
    """At the model's last layer only each segment's last row is read (the logits): those rows equal a pass that
    attends every row, the others are zeros, and every row's K/V still reaches the pool. Earlier layers, and a pass
    with a segment that records attention, attend every row."""
    from types import SimpleNamespace

    from sglang_patch.forward.sparse_attention import SparseAttention

    torch.manual_seed(0)
    hq, hk, d = 6, 2, 16
    segments = [Segment(slice(0, 70), torch.cat([torch.randperm(200)[:60].sort().values, torch.arange(200, 210)]),
                        torch.arange(1, 211)),
                Segment(slice(70, 75), torch.arange(95, 100), torch.arange(300, 400))]
    out_cache_loc = torch.cat([s.ctx_slots[s.q_pos] for s in segments])
    layers = [SimpleNamespace(layer_id=i, logit_cap=0, sliding_window_size=window, tp_q_head_num=hq,
                              tp_k_head_num=hk, qk_head_dim=d, v_head_dim=d, scaling=d ** -0.5) for i in range(2)]
    base = [_Pool(2, 400, hk, d, torch.float32, torch.device("cpu")) for _ in range(2)]
    for i in range(2):
        base[0].k[i].normal_(), base[0].v[i].normal_()
        base[1].k[i].copy_(base[0].k[i]), base[1].v[i].copy_(base[0].v[i])
    every, lasts = (SparseAttention(SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=None), segments,
                                    out_cache_loc, torch.device("cpu"), final_layer=final)
                    for pool, final in zip(base, (None, 1)))
    last_rows = [s.rows.stop - 1 for s in segments]
    others = torch.ones(75, dtype=torch.bool)
    others[last_rows] = False
    for layer in layers:
        q, k, v = (torch.randn(75, h * d) for h in (hq, hk, hk))
        want, got = every.forward(q, k, v, layer, None), lasts.forward(q, k, v, layer, None)
        if layer.layer_id == 0:
            torch.testing.assert_close(got, want)
        else:
            torch.testing.assert_close(got[last_rows], want[last_rows])
            assert want[others].abs().min() > 0 and not got[others].any()
        for buf in ("k", "v"):
            assert torch.equal(getattr(base[0], buf)[layer.layer_id], getattr(base[1], buf)[layer.layer_id])
    recording = segments + [Segment(slice(75, 80), torch.arange(5), torch.arange(1, 6), attention_sum=torch.zeros(5))]
    assert SparseAttention(SimpleNamespace(token_to_kv_pool=base[0], req_to_token_pool=None), recording,
                           torch.cat([out_cache_loc, torch.arange(1, 6)]), torch.device("cpu"),
                           final_layer=1).final_layer is None


def test_a_segment_with_context_positions_never_reads_the_slots_it_leaves_out():
    """A query pass over a prompt with holes (tokens between chunks, whose slots hold no KV of the prompt yet)
    attends only the positions it is given: the output and the recorded attention equal dense attention over those
    keys alone, and do not change when the holes' slots hold something else."""
    from types import SimpleNamespace

    from sglang_patch.forward.sparse_attention import SparseAttention

    torch.manual_seed(4)
    hq, hk, d, n = 6, 2, 16, 120
    row_slots = torch.randperm(300)[:n]  # one request's slots, not one range
    holes = torch.zeros(n, dtype=torch.bool)
    holes[40:55] = holes[80:90] = True
    visible = (~holes).nonzero().flatten()
    q_pos = torch.arange(100, n)  # the query, after the last chunk
    layer = SimpleNamespace(layer_id=0, logit_cap=0, sliding_window_size=-1, tp_q_head_num=hq, tp_k_head_num=hk,
                            qk_head_dim=d, v_head_dim=d, scaling=d ** -0.5)
    q, k, v = (torch.randn(len(q_pos), h * d) for h in (hq, hk, hk))
    outs, sums = [], []
    for trial in range(2):
        pool = _Pool(1, 300, hk, d, torch.float32, torch.device("cpu"))
        pool.k[0].normal_(generator=torch.Generator().manual_seed(10)), pool.v[0].normal_(
            generator=torch.Generator().manual_seed(11))
        if trial:  # what another request left in the holes' slots
            pool.k[0][row_slots[holes]] *= 50
            pool.v[0][row_slots[holes]] = 7.0
        seg = Segment(slice(0, len(q_pos)), q_pos, row_slots[visible], attention_sum=torch.zeros(len(visible)),
                      ctx_pos=visible)
        attn = SparseAttention(SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=None), [seg],
                               row_slots[q_pos], torch.device("cpu"))
        outs.append(attn.forward(q, k, v, layer, None))
        sums.append(seg.attention_sum.clone())
        keys, values = pool.k[0][row_slots[visible]], pool.v[0][row_slots[visible]]  # the query's own K/V written
        want = dense(q.view(-1, hq, d), keys, values, q_pos, visible, d ** -0.5).reshape(len(q_pos), -1)
        torch.testing.assert_close(outs[-1], want)
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(sums[0], sums[1])
    assert abs(sums[0].sum().item() - 1) < 1e-4  # the query's whole attention falls on the visible keys
