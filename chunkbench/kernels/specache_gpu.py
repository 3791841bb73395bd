"""SpeCache's decode step on a GPU, standalone: needs only torch (Triton optional), never sglang or flashinfer.

What it measures, on Llama-3-8B's shape (32 layers, 32 q heads, 8 KV heads, head dim 128, hidden 4096, FFN 14336;
random weights, no RoPE, no embedding or LM head): a whole decode step through the layer stack (RMSNorm, fused
q/k/v, attention, o, SwiGLU), or with `--attention-only` the q/k/v projection and the attention alone, at each
context L of `--contexts` and batch B of `--batches`:

1. capacity (counted, not measured): bytes per sequence in the device pool at context L, 16-bit KV against
   SpeCache's pool as chunkcache/specache/layer_cache.py counts it (b-bit codes, float16 scale/zero per group,
   16-bit residual window, a 16-bit buffer of `--topk` prefetched pairs per layer per KV head), and so the tokens
   and the batch that fit `--budget-gib` of device memory.
2. step time, CUDA events, median of `--repeats` steps after `--warmup` (time.perf_counter on a CPU):
   - baseline: one token per sequence over its 16-bit KV on the device, one pool per layer; the faster of SDPA
     and a plain matmul-softmax-matmul (cuBLAS splits the long key axis, which SDPA's flash kernel may not at a
     small batch), each reported;
   - SpeCache (Alg. 3): two rows per sequence (x_t and the speculative s_t) attend to the low-bit codes on the
     device with the prefetched positions masked out (a Triton kernel that dequantises in registers, or with
     `--kernel torch` a dequantise-then-attend in torch, which materialises the 16-bit K/V: correct, slow),
     merged by log-sum-exp with a float32 pass over the prefetched pairs, the residual and the two new rows; row
     1's attention, averaged over each GQA group, picks the next step's top-k per KV head (step.select_topk);
     the indices go to the host (pinned), a worker thread gathers those 16-bit pairs from the pinned host copy
     (index_select into a pinned staging buffer per layer) and copies them to the device on a side stream. The
     copy overlaps the rest of the step, and the next step's layer waits on it only when it reaches that layer.
     Every step fetches all k pairs of every layer and head (a real step reuses the pairs already resident:
     an upper bound); "no-pf" is the same step without the transfer (top-k still chosen), so spec - no-pf is
     the prefetch's exposed cost; "H2D ms" sums the copies' own durations and "gather ms" the host's gathers.
   The context stays fixed (the same step repeats; x_t's KV is not appended). Nothing runs in a CUDA graph (the
   host's gather cannot), so at a small batch SpeCache's step, some 40 kernels a layer, is bound by their launches;
   the Triton kernel is a plain one (every element dequantised, no tuning).
3. accuracy, per configuration, all layers of one recorded step, the first two sequences: the step's attention
   output against float32 attention over the same mixed cache (low-bit dequantised, the step's prefetched set in
   16-bit; must agree within the dtype's tolerance: this checks the kernel, the merge and that the prefetched rows
   are the ones chosen), and against the float32 full-precision cache (the quality number: max |diff| / max |ref|
   and the mean cosine, row 0, x_t's output). Then, with top-k at least the quantised context ("exact", at the
   smallest L and B), the step must equal full precision within the dtype's tolerance. K has outlier channels
   (4 channels of each head scaled by 8 and offset by +-4, KIVI's observation) so that its per-channel
   quantisation matters; V is standard normal. On such keys attention spreads over about L/30 tokens, so the
   top-k recovers little and err is mostly the quantisation's own (large at 1 bit); real models concentrate their
   attention, and chunkbench.studies.specache_study measures quality on one. Any failed check makes the exit status 1.

All layers hold copies of one sequence batch's KV (distinct memory, so the timing reads every layer's pool), and the
pinned host copy is that one layer's KV, which every layer gathers from with its own top-k: the transfer and the
gather move the bytes of per-layer copies while the host holds 1/32 of them. A configuration whose 16-bit KV does
not fit the GPU's free memory runs SpeCache alone (the reason printed); one that fits neither is skipped. The
device pool also holds a 1-byte mask per token per KV head per layer (which positions are prefetched), not in the
accounting (+1.6 % at 1 bit).

GPU session (H100 80 GB; the default run should take a few minutes, well inside one 10-minute command):

    PYTHONUNBUFFERED=1 python3 -m chunkbench.kernels.specache_gpu --json $OUT/specache.json 2>&1 | tee $OUT/specache.log

and the attention alone: the same with `--attention-only --json $OUT/attention.json` (and `.log`).

CPU self-check (tests/test_specache_gpu.py runs it in-process, float32; with TRITON_INTERPRET=1 the Triton kernel
runs in Triton's interpreter instead of torch):

    .venv/bin/python -m chunkbench.kernels.specache_gpu --device cpu --shape tiny --contexts 256,512 --batches 1,2 \\
        --topk 8 --group 16 --residual 16 --repeats 2 --warmup 1 --budget-gib 0.01
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

# `python3 -m chunkbench.kernels.specache_gpu` from a plain checkout's root puts the root on sys.path; none of these
# modules imports sglang (chunkcache.config needs only PyYAML)
from chunkcache.config import SpeCacheConfig
from chunkcache.specache import quant
from chunkcache.specache.layer_cache import full_bytes, lowbit_bytes
from chunkcache.specache.step import select_topk, speculative_attention

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

SHAPES = {
    "llama8b": dict(layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, ffn=14336),
    "tiny": dict(layers=2, heads=4, kv_heads=2, head_dim=64, hidden=256, ffn=512),  # seconds on a CPU
}
# max |out - reference| / max |reference|; bf16 rounds q, k, v and p as any bf16 attention kernel does
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
BLOCK_N = 64  # tokens per iteration of the Triton kernel
GIB = 1 << 30


# ---- memory: the accounting of chunkcache.specache.layer_cache ----

def quantised_len(cfg: SpeCacheConfig, n: int) -> int:
    """LayerCache.quantised_len: whole groups older than the residual window."""
    return max(n - cfg.residual, 0) // cfg.group * cfg.group


def pool_bytes(cfg: SpeCacheConfig, shape: dict, n: int) -> int:
    """One sequence of n tokens in SpeCache's device pool, all layers (LayerCache.device_bytes)."""
    h, d, q = shape["kv_heads"], shape["head_dim"], quantised_len(cfg, n)
    return shape["layers"] * (lowbit_bytes(cfg, h, d, q) + (n - q + cfg.topk) * full_bytes(h, d))


def capacity(cfg: SpeCacheConfig, shape: dict, n: int, budget: int) -> dict:
    full = shape["layers"] * n * full_bytes(shape["kv_heads"], shape["head_dim"])
    spec = pool_bytes(cfg, shape, n)
    return dict(full_seq_bytes=full, spec_seq_bytes=spec, full_batch=budget // full, spec_batch=budget // spec,
                full_tokens=budget // full * n, spec_tokens=budget // spec * n)


# ---- the random-weight model ----

def make_model(shape: dict, attention_only: bool, dtype, device, gen) -> SimpleNamespace:
    h, f, hq, hk, d = shape["hidden"], shape["ffn"], shape["heads"], shape["kv_heads"], shape["head_dim"]

    def w(rows, cols, std=None):  # N(0, 1/fan_in): q entries ~ N(0, 1); residual branches keep x O(1)
        std = cols ** -0.5 if std is None else std
        return torch.empty(rows, cols, dtype=dtype, device=device).normal_(0, std, generator=gen)

    out_std = lambda cols: (2 * shape["layers"] * cols) ** -0.5  # noqa: E731
    layers = [SimpleNamespace(qkv=w((hq + 2 * hk) * d, h), o=None if attention_only else w(h, hq * d, out_std(hq * d)),
                              gate_up=None if attention_only else w(2 * f, h),
                              down=None if attention_only else w(h, f, out_std(f)))
              for _ in range(shape["layers"])]
    return SimpleNamespace(layers=layers, hq=hq, hk=hk, d=d, g=hq // hk, scale=d ** -0.5)


def project(model, layer, x: torch.Tensor):
    """x [B, M, hidden] -> q [B, M, Hq, D], k, v [B, M, Hkv, D]."""
    B, M = x.shape[:2]
    q, k, v = (F.rms_norm(x, x.shape[-1:]) @ layer.qkv.T).split(
        [model.hq * model.d, model.hk * model.d, model.hk * model.d], -1)
    return q.view(B, M, model.hq, model.d), k.view(B, M, model.hk, model.d), v.view(B, M, model.hk, model.d)


def finish(layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The rest of the layer after attention attn [B, M, Hq * D]; nothing with --attention-only."""
    if layer.o is None:
        return x
    x = x + attn @ layer.o.T
    gate, up = (F.rms_norm(x, x.shape[-1:]) @ layer.gate_up.T).chunk(2, -1)
    return x + (F.silu(gate) * up) @ layer.down.T


def make_kv(B: int, n: int, model, dtype, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [B, Hkv, n, D]: standard normal, K with a few large, offset channels per head."""
    hk, d = model.hk, model.d
    outliers = torch.randperm(d, generator=torch.Generator().manual_seed(0))[:4]
    scale = torch.ones(hk, 1, d, device=device)
    bias = torch.zeros(hk, 1, d, device=device)
    scale[..., outliers] = 8.0
    bias[..., outliers] = 4.0 * torch.tensor([1.0, -1.0, 1.0, -1.0], device=device)
    k = torch.empty(B, hk, n, d, dtype=dtype, device=device)
    v = torch.empty_like(k)
    for b in range(B):  # a sequence at a time: float32 temporaries stay small
        k[b] = torch.randn(hk, n, d, generator=gen, device=device) * scale + bias
        v[b] = torch.randn(hk, n, d, generator=gen, device=device)
    return k, v


# ---- the baseline: one token per sequence over 16-bit KV ----

def attend_sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def attend_matmul(q, k, v, scale):
    return ((q @ k.transpose(-1, -2)).float() * scale).softmax(-1).to(q.dtype) @ v


def baseline_step(model, pools, x, attend):
    """pools[l] = (K, V) [B, Hkv, n + 1, D]: the context, then the new token's slot. The G query heads of a KV
    head are G rows over that head's keys (one token: nothing to mask)."""
    B = x.shape[0]
    for layer, (K, V) in zip(model.layers, pools):
        q, k, v = project(model, layer, x)
        K[:, :, -1], V[:, :, -1] = k[:, 0], v[:, 0]
        o = attend(q.reshape(B, model.hk, model.g, model.d), K, V, model.scale)
        x = finish(layer, x, o.reshape(B, 1, -1))
    return x


# ---- SpeCache ----

def quantise(K: torch.Tensor, V: torch.Tensor, cfg: SpeCacheConfig, nq: int) -> tuple[torch.Tensor, ...]:
    """Codes and parameters of tokens [0, nq) of K, V [B, H, n, D], laid out [B, H, tokens (or groups), ...]:
    K codes, scale, zero, V codes, scale, zero (quant.quantize_keys / quantize_values per sequence)."""
    B, H, _, D = K.shape
    b, g, dev = cfg.bits, cfg.group, K.device
    kc = torch.empty(B, H, nq, D * b // 8, dtype=torch.uint8, device=dev)
    ks = torch.empty(B, H, nq // g, D, dtype=quant.PARAM_DTYPE, device=dev)
    vc = torch.empty_like(kc)
    vs = torch.empty(B, H, nq, D // g, dtype=quant.PARAM_DTYPE, device=dev)
    kz, vz = torch.empty_like(ks), torch.empty_like(vs)
    for i in range(B):
        for out, got in zip((kc, ks, kz), quant.quantize_keys(K[i, :, :nq].transpose(0, 1), b, g)):
            out[i] = got.transpose(0, 1)
        for out, got in zip((vc, vs, vz), quant.quantize_values(V[i, :, :nq].transpose(0, 1), b, g)):
            out[i] = got.transpose(0, 1)
    return kc, ks, kz, vc, vs, vz


def dequantise(lowbit: tuple[torch.Tensor, ...], cfg: SpeCacheConfig, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [..., tokens, D] float32, rounded to `dtype` as the kernel rounds them before its products."""
    kc, ks, kz, vc, vs, vz = lowbit
    g = cfg.group
    k = quant.dequantize_keys(kc, ks.repeat_interleave(g, -2), kz.repeat_interleave(g, -2), cfg.bits)
    v = quant.dequantize_values(vc, vs, vz, cfg.bits)
    return k.to(dtype).float(), v.to(dtype).float()


class Prefetcher:
    """Per layer: the device buffer of the prefetched 16-bit pairs [B, Hkv, k, 2D] (K then V of a pair side by
    side, so one host row holds both), and a pinned index buffer and staging buffer. `submit` sends a layer's
    chosen rows of the host copy [B * Hkv * tokens, 2D] on their way; `wait` (before that layer runs again)
    makes the compute stream wait for their arrival."""

    def __init__(self, host: torch.Tensor, layers: int, shape: tuple[int, int, int], device: torch.device):
        self.host, self.cuda = host, device.type == "cuda"
        rows, width = math.prod(shape), host.shape[1]
        self.buf = [torch.empty(*shape, width, dtype=host.dtype, device=device) for _ in range(layers)]
        self.idx = [torch.empty(rows, dtype=torch.long, pin_memory=self.cuda) for _ in range(layers)]
        self.staging = [torch.empty(rows, width, dtype=host.dtype, pin_memory=self.cuda) for _ in range(layers)]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.chosen = [torch.cuda.Event() if self.cuda else None for _ in range(layers)]
        self.arrived: list = [None] * layers
        self.pending: dict = {}
        self.log: list[tuple] = []  # per transfer: (gather seconds, copy start, copy end events)
        self.worker = ThreadPoolExecutor(1)  # one thread: transfers stay in layer order

    def submit(self, layer: int, rows: torch.Tensor) -> None:
        self.idx[layer].copy_(rows.reshape(-1), non_blocking=True)
        if self.cuda:
            self.chosen[layer].record()
        self.pending[layer] = self.worker.submit(self._fetch, layer)

    def _fetch(self, layer: int) -> None:
        # the staging buffer is free: this layer's previous copy finished before the compute stream ran the
        # attention whose top-k is being fetched now (wait below)
        if self.cuda:
            self.chosen[layer].synchronize()
        t = time.perf_counter()
        torch.index_select(self.host, 0, self.idx[layer], out=self.staging[layer])
        gather = time.perf_counter() - t
        dst = self.buf[layer].view(-1, self.host.shape[1])
        if not self.cuda:
            dst.copy_(self.staging[layer])
            self.log.append((gather, None, None))
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            dst.copy_(self.staging[layer], non_blocking=True)
            end.record()
        self.arrived[layer] = end
        self.log.append((gather, start, end))

    def wait(self, layer: int) -> None:
        job = self.pending.pop(layer, None)
        if job is not None:
            job.result()  # re-raises the worker's error
        if self.cuda and self.arrived[layer] is not None:
            torch.cuda.current_stream().wait_event(self.arrived[layer])

    def drain(self) -> None:
        for layer in list(self.pending):
            self.pending.pop(layer).result()
        if self.cuda:
            torch.cuda.synchronize()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.worker.shutdown()


class SpeCache:
    """The device side of every layer (codes, residual, mask of the prefetched positions, which positions they
    are) and the host copy behind the prefetcher, for K, V [B, Hkv, n, D]."""

    def __init__(self, K, V, cfg: SpeCacheConfig, layers: int, kernel: str):
        B, H, n, D = K.shape
        self.K, self.V, self.cfg, self.kernel = K, V, cfg, kernel
        self.nq = nq = quantised_len(cfg, n)
        if nq == 0:
            raise ValueError(f"context {n} leaves no whole group of {cfg.group} before the {cfg.residual}-token "
                             f"residual window")
        self.k = k = min(cfg.topk, nq)
        self.base = quantise(K, V, cfg, nq)
        # one copy per layer: every layer's step reads its own pool
        self.lowbit = [self.base] + [tuple(t.clone() for t in self.base) for _ in range(layers - 1)]
        self.residual = [torch.cat([K[:, :, nq:], V[:, :, nq:]], -1) for _ in range(layers)]
        self.mask = [torch.zeros(B, H, nq, dtype=torch.uint8, device=K.device) for _ in range(layers)]
        cuda = K.device.type == "cuda"
        host = torch.empty(B * H * nq, 2 * D, dtype=K.dtype, pin_memory=cuda)
        for b in range(B):
            host.view(B, H, nq, 2 * D)[b].copy_(torch.cat([K[b, :, :nq], V[b, :, :nq]], -1))
        self.prefetch = Prefetcher(host, layers, (B, H, k), K.device)
        self.offsets = torch.arange(B * H, device=K.device).view(B, H, 1) * nq  # rows of host per (b, h)
        # pre-decode stand-in: the last k quantised tokens; the first steps replace them with chosen ones
        first = torch.arange(nq - k, nq, device=K.device).expand(B, H, k)
        self.kappa = [first] * layers
        for layer in range(layers):
            self.mask[layer].scatter_(-1, first, 1)
            self.prefetch.submit(layer, first + self.offsets)

    def dequantised(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantise(self.lowbit[layer], self.cfg, self.K.dtype)

    def lowbit_attention(self, layer: int, q: torch.Tensor):
        """q [B, H, 2G, D] over the codes of tokens [0, nq), prefetched positions masked out. Returns per split
        the output [B, H, S, 2G, D] and log-sum-exp [B, H, S, 2G] (float32), and the speculative row's scores
        [B, H, G, nq] (float32, unmasked)."""
        if self.kernel == "triton":
            return lowbit_triton(q, self.lowbit[layer], self.mask[layer], self.cfg)
        G = q.shape[2] // 2
        k, v = self.dequantised(layer)
        s = q.float() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        spec = s[:, :, G:].clone()
        s.masked_fill_(self.mask[layer].bool()[:, :, None], float("-inf"))
        lse = s.logsumexp(-1)
        o = (s - lse.clamp(min=-1e30)[..., None]).exp() @ v  # every position masked: lse -inf, weights 0
        return o[:, :, None], lse[:, :, None], spec


if triton is not None:
    @triton.jit
    def _lowbit_kernel(Q, KC, KS, KZ, VC, VS, VZ, MASK, O, LSE, SPEC, n, split, scale,
                       D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (b*H + h, s): the 2G query rows of KV head h over tokens [s*split, (s+1)*split) of n, K and V
        dequantised in registers; writes the split's normalised output and log-sum-exp, and row 1's raw
        scores."""
        PER: tl.constexpr = 8 // BITS
        DB: tl.constexpr = D // PER
        bh = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        S = tl.num_programs(1)
        rows = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        real = rows < 2 * G
        q = tl.load(Q + bh * 2 * G * D + rows[:, None] * D + d[None, :], mask=real[:, None], other=0.0)
        byte = d // PER
        shift = (d % PER) * BITS
        spec_row = (rows >= G) & real
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(s * split, tl.minimum(s * split + split, n), BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            ok = t < n
            kc = tl.load(KC + bh * n * DB + t[:, None] * DB + byte[None, :], mask=ok[:, None], other=0)
            kp = bh * (n // GROUP) * D + (t // GROUP)[:, None] * D + d[None, :]
            ks = tl.load(KS + kp, mask=ok[:, None], other=0.0).to(tl.float32)
            kz = tl.load(KZ + kp, mask=ok[:, None], other=0.0).to(tl.float32)
            k = (((kc.to(tl.int32) >> shift[None, :]) & (2**BITS - 1)).to(tl.float32) * ks + kz).to(q.dtype)
            sc = tl.dot(q, tl.trans(k)) * scale
            tl.store(SPEC + bh * G * n + (rows - G)[:, None] * n + t[None, :], sc,
                     mask=spec_row[:, None] & ok[None, :])
            fetched = tl.load(MASK + bh * n + t, mask=ok, other=1)
            sc = tl.where((fetched == 0)[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block: weights 0, not nan
            p = tl.exp(sc - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            vc = tl.load(VC + bh * n * DB + t[:, None] * DB + byte[None, :], mask=ok[:, None], other=0)
            vp = bh * n * (D // GROUP) + t[:, None] * (D // GROUP) + (d // GROUP)[None, :]
            vs = tl.load(VS + vp, mask=ok[:, None], other=0.0).to(tl.float32)
            vz = tl.load(VZ + vp, mask=ok[:, None], other=0.0).to(tl.float32)
            v = (((vc.to(tl.int32) >> shift[None, :]) & (2**BITS - 1)).to(tl.float32) * vs + vz).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
            m_i = m_new
        out = bh * S + s
        tl.store(O + out * 2 * G * D + rows[:, None] * D + d[None, :], acc / tl.where(l_i > 0, l_i, 1.0)[:, None],
                 mask=real[:, None])
        tl.store(LSE + out * 2 * G + rows, tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf")), mask=real)


def lowbit_triton(q: torch.Tensor, lowbit, mask: torch.Tensor, cfg: SpeCacheConfig):
    B, H, M2, D = q.shape
    n, G = mask.shape[-1], M2 // 2
    # flash-decoding: split the tokens so that about 4 programs run per SM whatever the batch
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    splits = max(1, min(triton.cdiv(n, BLOCK_N), triton.cdiv(4 * sms, B * H)))
    split = triton.cdiv(triton.cdiv(n, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(n, split)
    o = torch.empty(B, H, splits, M2, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, splits, M2, dtype=torch.float32, device=q.device)
    spec = torch.empty(B, H, G, n, dtype=torch.float32, device=q.device)
    _lowbit_kernel[(B * H, splits)](q, *lowbit, mask, o, lse, spec, n, split, D ** -0.5, D=D, BITS=cfg.bits,
                                    GROUP=cfg.group, G=G, BLOCK_M=max(16, triton.next_power_of_2(M2)),
                                    BLOCK_N=BLOCK_N, num_warps=8)  # 8 warps: the dequantised tiles are large
    return o, lse, spec


def specache_step(model, st: SpeCache, x: torch.Tensor, prefetch: bool = True, record: list | None = None):
    """One decode step of rows x [B, 2, hidden] (x_t, s_t) through every layer. Without `prefetch` the top-k is
    chosen but nothing moves (and the prefetched set stays as it is)."""
    B, (H, G, D) = x.shape[0], (model.hk, model.g, model.d)
    for layer_i, layer in enumerate(model.layers):
        q, k, v = project(model, layer, x)
        qh = q.view(B, 2, H, G, D).transpose(1, 2).reshape(B, H, 2 * G, D)  # row r*G + g: token r, q head h*G+g
        if prefetch:
            st.prefetch.wait(layer_i)
        o_lb, lse_lb, spec = st.lowbit_attention(layer_i, qh)
        # 16-bit part: prefetched pairs, residual, the two new rows (x_t does not see s_t)
        kv = torch.cat([st.prefetch.buf[layer_i], st.residual[layer_i],
                        torch.cat([k, v], -1).transpose(1, 2)], 2).float()
        s = qh.float() @ kv[..., :D].transpose(-1, -2) * model.scale
        s[:, :, :G, -1] = float("-inf")
        lse_fp = s.logsumexp(-1)
        o_fp = (s - lse_fp[..., None]).exp() @ kv[..., D:]
        lse = torch.cat([lse_lb, lse_fp[:, :, None]], 2)
        o = (lse.softmax(2)[..., None] * torch.cat([o_lb, o_fp[:, :, None]], 2)).sum(2)  # [B, H, 2G, D]
        lse = lse.logsumexp(2)
        out = o.view(B, H, 2, G, D).transpose(1, 2).reshape(B, 2, H * G, D).to(x.dtype)
        kappa = st.kappa[layer_i]
        if record is not None:
            record.append((q, k, v, out, kappa))
        # the next step's top-k from s_t's attention, the prefetched pairs scored at full precision
        spec.scatter_(-1, kappa[:, :, None].expand(-1, -1, G, -1), s[:, :, G:, : st.k])
        probs = (spec - lse[:, :, G:, None]).exp().mean(2)
        chosen = select_topk(probs.flatten(0, 1), st.nq, st.k).view(B, H, -1)
        if prefetch:
            st.mask[layer_i].scatter_(-1, kappa, 0).scatter_(-1, chosen, 1)
            st.kappa[layer_i] = chosen
            st.prefetch.submit(layer_i, chosen + st.offsets)
        x = finish(layer, x, out.reshape(B, 2, -1))
    return x


def check_step(st: SpeCache, record: list, scale: float, seqs: int) -> dict:
    """The recorded step's outputs against float32 attention over the mixed cache and over full precision."""
    mixed_err = full_err = 0.0
    cos = []
    nq = st.nq
    for b in range(seqs):
        kq, vq = (t.transpose(0, 1) for t in dequantise(tuple(t[b] for t in st.base), st.cfg, st.K.dtype))
        kf, vf = st.K[b].transpose(0, 1).float(), st.V[b].transpose(0, 1).float()  # [n, H, D]
        for q, k, v, out, kappa in record:
            idx = kappa[b].T  # [k, H]
            heads = torch.arange(idx.shape[1], device=idx.device)
            km, vm = kq.clone(), vq.clone()
            km[idx, heads], vm[idx, heads] = kf[idx, heads], vf[idx, heads]
            args = (q[b].float(), k[b].float(), v[b].float())
            ref_m, _ = speculative_attention(*args, torch.cat([km, kf[nq:]]), torch.cat([vm, vf[nq:]]), scale)
            ref_f, _ = speculative_attention(*args, kf, vf, scale)
            got = out[b].float()
            mixed_err = max(mixed_err, float((got - ref_m).abs().max() / ref_m.abs().max()))
            full_err = max(full_err, float((got[0] - ref_f[0]).abs().max() / ref_f[0].abs().max()))
            cos.append(float(F.cosine_similarity(got[0], ref_f[0], dim=-1).mean()))
    return dict(mixed_err=mixed_err, full_err=full_err, cos=statistics.fmean(cos))


# ---- timing ----

def timed(step, warmup: int, repeats: int, device: torch.device, before=None) -> list[float]:
    """Milliseconds of each of `repeats` steps, back to back (CUDA events on a GPU), after `warmup` ones;
    `before()` runs between the two."""
    for _ in range(warmup):
        step()
    if before is not None:
        before()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t))
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def free_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def run_specache(args, model, K, V, cfg, device, exact: bool = False) -> dict:
    B = K.shape[0]
    st = SpeCache(K, V, cfg, len(model.layers), args.kernel)
    x = torch.randn(B, 2, args.hidden, generator=args.gen, device=device).to(K.dtype)
    row = {}
    try:
        if not exact:
            ms = timed(lambda: specache_step(model, st, x), args.warmup, args.repeats, device, st.prefetch.drain)
            st.prefetch.drain()
            log = st.prefetch.log[-args.repeats * len(model.layers):]
            per_step = [log[i: i + len(model.layers)] for i in range(0, len(log), len(model.layers))]
            row.update(spec_ms=statistics.median(ms),
                       gather_ms=statistics.median(1e3 * sum(g for g, _, _ in s) for s in per_step),
                       h2d_ms=(statistics.median(sum(a.elapsed_time(b) for _, a, b in s) for s in per_step)
                               if device.type == "cuda" else None),
                       nopf_ms=statistics.median(timed(lambda: specache_step(model, st, x, prefetch=False),
                                                       1, args.repeats, device)))
        else:
            specache_step(model, st, x)  # so that the recorded step reads pairs a step chose (here: all)
        record = []
        specache_step(model, st, x, record=record)
        st.prefetch.drain()
        row.update(check_step(st, record, model.scale, min(B, 2)),
                   h2d_bytes=len(model.layers) * st.prefetch.buf[0].numel() * K.element_size(), topk=st.k)
    finally:
        st.prefetch.close()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.kernels.specache_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="llama8b", choices=list(SHAPES))
    ap.add_argument("--contexts", type=ints, default=[8192, 16384, 32768])
    ap.add_argument("--batches", type=ints, default=[1, 8, 32])
    ap.add_argument("--bits", type=ints, default=[1, 2])
    ap.add_argument("--topk", type=int, default=64, help="prefetched pairs per layer per KV head")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--residual", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=40.0, help="device memory for KV, for the capacity table")
    ap.add_argument("--attention-only", action="store_true", help="no o projection and MLP in the layers")
    ap.add_argument("--kernel", default="auto", choices=["auto", "triton", "torch"],
                    help="SpeCache's low-bit attention; auto: Triton on CUDA (or under TRITON_INTERPRET=1), with "
                         "torch as the fallback if it fails to run")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device, shape = torch.device(args.device), SHAPES[args.shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = TOLERANCE[dtype]
    args.hidden = shape["hidden"]
    args.gen = torch.Generator(device).manual_seed(args.seed)
    cfgs = {b: SpeCacheConfig(enabled=True, bits=b, group=args.group, residual=args.residual, topk=args.topk)
            for b in args.bits}
    for cfg in cfgs.values():
        cfg.check()
        quant.check_layout(cfg.bits, cfg.group, shape["head_dim"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device {name}; torch {torch.__version__}; {dtype}; shape {args.shape} {shape}"
          f"{', attention only' if args.attention_only else ''}")
    asked = args.kernel
    kernel_note = pick_kernel(args, device, shape, dtype)
    ok = kernel_note is None or asked != "triton"
    budget = int(args.budget_gib * GIB)

    print(f"\n== capacity in {args.budget_gib:g} GiB of device KV (bytes per token, all layers, residual "
          f"{args.residual} and top-k {args.topk} buffers amortised over L)")
    print(f"{'L':>7}{'bits':>5}{'16-bit B/tok':>14}{'SpeCache B/tok':>16}{'ratio':>7}{'tokens 16-bit':>15}"
          f"{'tokens SpeCache':>17}{'batch 16-bit':>14}{'batch SpeCache':>16}")
    caps = {}
    for n in args.contexts:
        for b, cfg in cfgs.items():
            c = caps[n, b] = capacity(cfg, shape, n, budget)
            print(f"{n:>7}{b:>5}{c['full_seq_bytes'] / n:>14.0f}{c['spec_seq_bytes'] / n:>16.0f}"
                  f"{c['spec_seq_bytes'] / c['full_seq_bytes']:>7.3f}{c['full_tokens']:>15}{c['spec_tokens']:>17}"
                  f"{c['full_batch']:>14}{c['spec_batch']:>16}")

    model = make_model(shape, args.attention_only, dtype, device, args.gen)
    print(f"\n== decode step, {shape['layers']} layers, {'attention' if args.attention_only else 'whole layers'}; "
          f"ms per step, median of {args.repeats}; low-bit attention: {args.kernel}; ratio = baseline / SpeCache; "
          f"err = max |diff| / max |ref| of x_t's output vs 16-bit (float32), mixed = vs float32 over the same "
          f"mixed cache (tolerance {tol:g})")
    print(f"{'L':>6}{'B':>4}{'bits':>5}{'sdpa':>8}{'matmul':>8}{'spec':>8}{'ratio':>7}{'no-pf':>8}{'H2D MB':>8}"
          f"{'H2D ms':>8}{'gather':>8}{'err':>9}{'cos':>8}{'mixed':>9}{'tok 16b':>9}{'tok spec':>10}"
          f"{'B 16b':>7}{'B spec':>8}")
    rows = []
    for n in args.contexts:
        for B in args.batches:
            print(f"-- L {n}, batch {B}", flush=True)
            K, V = make_kv(B, n, model, dtype, device, args.gen)
            base = run_baseline(args, model, K, V, device)
            for b, cfg in cfgs.items():
                row = dict(L=n, B=B, bits=b, **base, **caps[n, b])
                need = B * (pool_bytes(cfg, shape, n) + shape["layers"] * n * shape["kv_heads"]
                            + 3 * shape["heads"] * n * 4)  # pool, mask, float32 scores of a layer
                if need > free_bytes(device) - GIB:
                    row["spec_skipped"] = f"SpeCache's pool ({need / GIB:.1f} GiB) does not fit"
                else:
                    try:
                        row.update(run_specache(args, model, K, V, cfg, device))
                    except torch.OutOfMemoryError:
                        row["spec_skipped"] = "out of device memory"
                    except Exception as e:  # noqa: BLE001  report, go on with the other configurations
                        row["spec_failed"] = f"{type(e).__name__}: {e}"
                row["ok"] = not ("spec_failed" in row or "base_failed" in row) and row.get("mixed_err", 0) <= tol
                ok &= row["ok"]
                rows.append(row)
                print_row(row, tol)
            del K, V
    exact = []
    n, B = min(args.contexts), min(args.batches)
    print(f"\n== exact: top-k = the whole quantised context (L {n}, batch {B}) must equal 16-bit within {tol:g}")
    K, V = make_kv(B, n, model, dtype, device, args.gen)
    for b, cfg in cfgs.items():
        cfg = SpeCacheConfig(enabled=True, bits=b, group=args.group, residual=args.residual,
                             topk=quantised_len(cfg, n))
        try:
            row = dict(L=n, B=B, bits=b, **run_specache(args, model, K, V, cfg, device, exact=True))
            row["ok"] = row["full_err"] <= tol and row["mixed_err"] <= tol
        except Exception as e:  # noqa: BLE001
            row = dict(L=n, B=B, bits=b, failed=f"{type(e).__name__}: {e}", ok=False)
        ok &= row["ok"]
        exact.append(row)
        print(f"  bits {b}: " + (f"err {row['full_err']:.2e} (mixed {row['mixed_err']:.2e})"
                                 if "failed" not in row else f"FAILED: {row['failed'][:300]}")
              + ("" if row["ok"] else "  FAILS"))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=name, torch=torch.__version__, dtype=str(dtype), kernel=args.kernel, kernel_note=kernel_note,
            args={k: v for k, v in vars(args).items() if k != "gen"}, capacity=[dict(L=n, bits=b, **c)
                                                                             for (n, b), c in caps.items()],
            steps=rows, exact=exact, ok=ok), indent=1))
    print("all checks pass" if ok else "SOME CHECKS FAIL")
    return 0 if ok else 1


def run_baseline(args, model, K, V, device) -> dict:
    """Both baseline attentions over 16-bit pools of K, V (one copy per layer), or why they were not run."""
    B, H, n, D = K.shape
    need = len(model.layers) * B * (n + 1) * full_bytes(H, D) + 3 * B * model.hq * n * 4
    if need > free_bytes(device) - GIB:
        print(f"   16-bit KV ({need / GIB:.1f} GiB with the matmul's scores) does not fit: baseline skipped")
        return dict(base_skipped=f"needs {need / GIB:.1f} GiB")
    try:
        pools = [(torch.cat([K, K[:, :, :1]], 2), torch.cat([V, V[:, :, :1]], 2)) for _ in model.layers]
        x = torch.randn(B, 1, args.hidden, generator=args.gen, device=device).to(K.dtype)
        return {f"{name}_ms": statistics.median(timed(lambda: baseline_step(model, pools, x, attend), args.warmup,
                                                      args.repeats, device))
                for name, attend in (("sdpa", attend_sdpa), ("matmul", attend_matmul))}
    except torch.OutOfMemoryError:
        print("   baseline: out of device memory")
        return dict(base_skipped="out of device memory")
    except Exception as e:  # noqa: BLE001  report, go on with SpeCache
        print(f"   baseline FAILED: {type(e).__name__}: {str(e)[:300]}")
        return dict(base_failed=f"{type(e).__name__}: {e}")


def pick_kernel(args, device, shape, dtype) -> str | None:
    """Resolve --kernel auto, and try the Triton kernel once on a small case; returns why Triton is not used, if
    it was asked for (or None)."""
    usable = triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    if args.kernel == "torch" or (args.kernel == "auto" and not usable):
        args.kernel = "torch"
        return None
    if not usable:
        note = "Triton needs CUDA (or TRITON_INTERPRET=1 on a CPU)" if triton else "Triton is not importable"
    else:
        try:
            H, G, D, g = shape["kv_heads"], shape["heads"] // shape["kv_heads"], shape["head_dim"], args.group
            cfg = SpeCacheConfig(bits=min(args.bits), group=g)
            k = torch.randn(1, H, 4 * g, D, device=device).to(dtype)
            lowbit_triton(torch.randn(1, H, 2 * G, D, device=device).to(dtype), quantise(k, k, cfg, 4 * g),
                          torch.zeros(1, H, 4 * g, dtype=torch.uint8, device=device), cfg)
            args.kernel = "triton"
            return None
        except Exception as e:  # noqa: BLE001  a kernel that does not build here: fall back, say why
            note = f"Triton kernel failed: {type(e).__name__}: {str(e)[:500]}"
    print(f"{note}; low-bit attention in torch instead")
    args.kernel = "torch"
    return note


def print_row(r: dict, tol: float) -> None:
    f = lambda key, w, p=2: f"{r[key]:>{w}.{p}f}" if r.get(key) is not None else f"{'-':>{w}}"  # noqa: E731
    base = min((r[k] for k in ("sdpa_ms", "matmul_ms") if k in r), default=None)
    ratio = f"{base / r['spec_ms']:>7.2f}" if base and "spec_ms" in r else f"{'-':>7}"
    line = f"{r['L']:>6}{r['B']:>4}{r['bits']:>5}{f('sdpa_ms', 8)}{f('matmul_ms', 8)}{f('spec_ms', 8)}{ratio}"
    if "spec_ms" in r:
        line += (f"{f('nopf_ms', 8)}{r['h2d_bytes'] / 1e6:>8.2f}{f('h2d_ms', 8)}{f('gather_ms', 8)}"
                 f"{r['full_err']:>9.2e}{r['cos']:>8.4f}{r['mixed_err']:>9.2e}")
    else:
        line += f"  SpeCache {r.get('spec_skipped') or 'FAILED: ' + r['spec_failed'][:300]}"
    line += f"{r['full_tokens']:>9}{r['spec_tokens']:>10}{r['full_batch']:>7}{r['spec_batch']:>8}"
    print(line + ("" if r["ok"] else "  FAILS"), flush=True)


if __name__ == "__main__":
    sys.exit(main())
