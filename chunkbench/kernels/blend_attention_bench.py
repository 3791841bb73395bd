"""One layer of the blend's recompute attention on CPU: `chunkcache.blend.attention.attend` (per 64-row block: GQA heads
stacked, keys before the block's first row unmasked, the rest masked, merged by log-sum-exp) against one masked SDPA
call per block over all its keys. The default model's attention shape (9 query heads, 3 KV heads, head dim
64); rho of the context recomputed plus a 40-token query tail, positions drawn uniformly or late-biased (ProphetKV's
picks in a 16-chunk prompt sat ~80 % in its last 40 %). Sides alternate; medians and ratios from one run.

    .venv/bin/python -m chunkbench.kernels.blend_attention_bench --context 3200,6400 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from chunkcache.blend.attention import QUERY_BLOCK, attend


def positions(n: int, m: int, late: bool, gen: torch.Generator) -> torch.Tensor:
    body = n - 40
    if late:  # 20 % over the first 60 %, 80 % over the last 40 %
        early = int(0.2 * m)
        picks = torch.cat([torch.randperm(int(0.6 * body), generator=gen)[:early],
                           int(0.6 * body) + torch.randperm(body - int(0.6 * body), generator=gen)[: m - early]])
    else:
        picks = torch.randperm(body, generator=gen)[:m]
    return torch.cat([picks.sort().values, torch.arange(body, n)])


def one_masked_call(q, keys, values, q_pos, scale):
    out = torch.empty_like(q)
    kt, vt = keys.transpose(0, 1), values.transpose(0, 1)
    for start in range(0, len(q_pos), QUERY_BLOCK):
        rows = slice(start, start + QUERY_BLOCK)
        qp = q_pos[rows]
        n = int(qp.max()) + 1
        bias = torch.zeros(len(qp), n, dtype=q.dtype).masked_fill_(torch.arange(n)[None] > qp[:, None], float("-inf"))
        out[rows] = F.scaled_dot_product_attention(q[rows].transpose(0, 1), kt[:, :n], vt[:, :n], attn_mask=bias,
                                                   scale=scale, enable_gqa=True).transpose(0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.kernels.blend_attention_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", default="3200,6400")
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per layer, median of {args.repeats}")
    print(f"{'dtype':<10}{'keys':>6}{'rows':>6}{'picks':>9}{'one masked':>12}{'split':>8}{'ratio':>7}{'max |diff|':>12}")
    for dtype in (getattr(torch, d) for d in args.dtype.split(",")):
        for n in map(int, args.context.split(",")):
            for late in (False, True):
                q_pos = positions(n, int(args.ratio * n), late, gen)
                q = torch.randn(len(q_pos), 9, 64, generator=gen).to(dtype)
                keys, values = (torch.randn(n, 3, 64, generator=gen).to(dtype) for _ in range(2))
                sides = {"one": lambda: one_masked_call(q, keys, values, q_pos, 0.125),
                         "split": lambda: attend(q, keys, values, q_pos, torch.arange(n), 0.125)}
                times = {k: [] for k in sides}
                for i in range(args.repeats + 1):
                    for k, fn in sides.items():
                        t = time.perf_counter()
                        fn()
                        if i:
                            times[k].append(time.perf_counter() - t)
                diff = (sides["one"]().float() - sides["split"]().float()).abs().max().item()
                one, split = (1e3 * statistics.median(times[k]) for k in ("one", "split"))
                print(f"{str(dtype).removeprefix('torch.'):<10}{n:>6}{len(q_pos):>6}{'late' if late else 'uniform':>9}"
                      f"{one:>12.1f}{split:>8.1f}{one / split:>7.2f}{diff:>12.4f}", flush=True)


if __name__ == "__main__":
    main()
