"""The `chunkcache_torch` backend's decode against SGLang's own torch-native decode on the same pools (the oracle),
and against a float64 reference where the pool is bfloat16."""

import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sglang_patch.decode.decode_attention import DecodeAttention  # noqa: E402

HQ, HK, D = 6, 2, 32
LENS = [1, 7, 300, 1000]  # one row that sees only its own token; rows of very different lengths


def pools(dtype):
    torch.manual_seed(0)
    kv = MHATokenToKVPool(size=4096, page_size=1, dtype=dtype, head_num=HK, head_dim=D, layer_num=1, device="cpu",
                          enable_memory_saver=False)
    reqs = ReqToTokenPool(size=8, max_context_len=2048, device="cpu", enable_memory_saver=False)
    slots = torch.randperm(4000)[: sum(LENS)] + 1  # scattered slots, as after many allocations and frees
    pool_rows = torch.tensor([3, 1, 6, 2])
    start = 0
    for row, n in zip(pool_rows.tolist(), LENS):
        reqs.req_to_token[row, :n] = slots[start: start + n].int()
        start += n
    kv.k_buffer[0][1:] = torch.randn(4096, HK, D).to(dtype)
    kv.v_buffer[0][1:] = torch.randn(4096, HK, D).to(dtype)
    seq_lens = torch.tensor(LENS)
    last = reqs.req_to_token[pool_rows, seq_lens - 1].long()  # this step's token: the last slot of each row
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, encoder_lens=None, seq_lens=seq_lens,
                            seq_lens_cpu=seq_lens, req_pool_indices=pool_rows, out_cache_loc=last)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=reqs, token_to_kv_pool=kv)
    layer = RadixAttention(HQ, D, D ** -0.5, HK, layer_id=0)
    q = torch.randn(len(LENS), HQ * D).to(dtype)
    k, v = (torch.randn(len(LENS), HK, D).to(dtype) for _ in range(2))  # as RadixAttention passes them
    return runner, batch, layer, q, k, v


def decode(backend_cls, runner, batch, layer, q, k, v):
    backend = backend_cls(runner)
    backend.init_forward_metadata(batch)
    return backend.forward_decode(q, k, v, layer, batch).view(len(LENS), HQ, D)


def reference(runner, batch, layer, q):
    """Softmax attention of each row's query over its row's slots, in float64."""
    kv, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    out = []
    for i, (row, n) in enumerate(zip(batch.req_pool_indices.tolist(), LENS)):
        slots = table[row, :n].long()
        keys = kv.get_key_buffer(0)[slots].double().repeat_interleave(HQ // HK, 1)  # [n, HQ, D]
        values = kv.get_value_buffer(0)[slots].double().repeat_interleave(HQ // HK, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].view(HQ, D).double(), keys) * layer.scaling
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(out)


def test_float32_decode_equals_sglangs_torch_native_decode():
    case = pools(torch.float32)
    ours = decode(DecodeAttention, *case)
    stock = decode(TorchNativeAttnBackend, *case)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.double(), reference(*case[:4]), rtol=1e-4, atol=1e-4)


def test_bfloat16_decode_is_at_least_as_close_to_float64_as_sglangs():
    case = pools(torch.bfloat16)
    ours = decode(DecodeAttention, *case)
    stock = decode(TorchNativeAttnBackend, *case)
    ref = reference(*case[:4])
    assert ours.dtype == torch.bfloat16
    ours_err = (ours.double() - ref).abs().max().item()
    stock_err = (stock.double() - ref).abs().max().item()
    assert ours_err <= max(stock_err, 1e-2), (ours_err, stock_err)  # one bf16 rounding of the output at most
    # the step's own K/V were written to the pool before attending (row 0 sees only its own token)
    torch.testing.assert_close(ours[0].view(HK, HQ // HK, D), case[5][0][:, None].expand(HK, HQ // HK, D))


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED])
def test_prefill_batches_are_not_planned_as_decode(mode):
    runner, batch, *_ = pools(torch.float32)
    batch.forward_mode = mode
    backend = DecodeAttention(runner)
    backend.init_forward_metadata(batch)
    assert backend.row_slots is None
