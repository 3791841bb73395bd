"""One decode step's attention, per layer: SGLang's torch-native backend against `chunkcache_torch`
(sglang_patch/decode/decode_attention.py), on real SGLang pools of the default model's attention shape (9 query heads,
3 KV heads, head dim 64), rows of `--context` keys at scattered slots. Alternates the two backends, prints medians and
their ratio, measured in one run.

    .venv/bin/python -m chunkbench.kernels.decode_attention_bench --rows 1,8 --context 800,3300 --dtype bfloat16,float32
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

import torch


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.kernels.decode_attention_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8", help="requests decoding in the step")
    ap.add_argument("--context", default="800,3300", help="keys per request")
    ap.add_argument("--dtype", default="bfloat16,float32", help="KV pool and activation dtype")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()

    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_patch.decode.decode_attention import DecodeAttention

    hq, hk, d = 9, 3, 64
    layer = RadixAttention(hq, d, d ** -0.5, hk, layer_id=0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per layer per step, median of "
          f"{args.repeats}")
    print(f"{'dtype':<10}{'rows':>5}{'keys':>6}{'torch_native':>14}{'chunkcache_torch':>18}{'ratio':>8}")
    for dtype in (getattr(torch, n) for n in args.dtype.split(",")):
        for rows in map(int, args.rows.split(",")):
            for context in map(int, args.context.split(",")):
                size = rows * context + 16
                kv = MHATokenToKVPool(size=size, page_size=1, dtype=dtype, head_num=hk, head_dim=d, layer_num=1,
                                      device="cpu", enable_memory_saver=False)
                reqs = ReqToTokenPool(size=rows, max_context_len=context, device="cpu", enable_memory_saver=False)
                slots = torch.randperm(size)[: rows * context] + 1
                reqs.req_to_token[1: rows + 1] = slots.view(rows, context).int()
                kv.k_buffer[0][:] = torch.randn(size + 1, hk, d).to(dtype)
                kv.v_buffer[0][:] = torch.randn(size + 1, hk, d).to(dtype)
                pool_rows = torch.arange(1, rows + 1)
                seq_lens = torch.full((rows,), context)
                batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, encoder_lens=None, seq_lens=seq_lens,
                                        seq_lens_cpu=seq_lens, req_pool_indices=pool_rows,
                                        out_cache_loc=reqs.req_to_token[pool_rows, context - 1].long())
                runner = SimpleNamespace(device="cpu", req_to_token_pool=reqs, token_to_kv_pool=kv)
                q = torch.randn(rows, hq * d).to(dtype)
                k, v = (torch.randn(rows, hk, d).to(dtype) for _ in range(2))
                backends = {"stock": TorchNativeAttnBackend(runner), "ours": DecodeAttention(runner)}
                times = {name: [] for name in backends}
                for i in range(args.repeats + 2):
                    for name, backend in backends.items():
                        t = time.perf_counter()
                        backend.init_forward_metadata(batch)  # once per step, amortised over the model's layers
                        backend.forward_decode(q, k, v, layer, batch)
                        if i >= 2:
                            times[name].append(time.perf_counter() - t)
                stock, ours = (1e3 * statistics.median(times[n]) for n in ("stock", "ours"))
                print(f"{str(dtype).removeprefix('torch.'):<10}{rows:>5}{context:>6}{stock:>14.3f}{ours:>18.3f}"
                      f"{stock / ours:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
