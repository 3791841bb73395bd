"""The blended prefill on a GPU, standalone: needs only torch (flashinfer optional), never sglang.

Part 1, one layer's attention step as chunkcache's blend performs it (`sglang_patch/scheduler/blend.py` recompute pass):
the KV of a whole prompt row sits in a paged pool (reused chunk KV already copied in, fresh KV of the recomputed tokens
written), and the recomputed tokens, a sparse set of positions (K = ceil(rho * chunk tokens) picked uniformly at
random among the chunk tokens, plus every query token), attend to the keys at positions <= their own. Random data of
Llama-3-8B's attention shape (32 q heads, 8 kv heads, head dim 128) at each `--sizes` prompt length, prompt =
64-token shared prefix (matched exactly, never recomputed) + `--chunk`-token chunks + a 64-token query. Variants:

  full_causal          the stock prefill's attention: every position, SDPA is_causal (the baseline)
  flashinfer_paged     sglang_patch.forward.paged_attention.PagedSparsePrefill itself: the rows cut into groups spanning
                       at most 512 positions, each group's keys before it unmasked (FA3 on Hopper) and within it with a
                       small custom mask (FA2), merged with flashinfer.merge_state
  flashinfer_mask      FA2 paged prefill over the whole row with one custom mask (slower than full_causal on an
                       H100: docs/bench/gpu.md)
  flashinfer_two_pass  flashinfer_paged with the rows grouped by chunk instead of by position span (keys before the
                       chunk's start unmasked, not those before the group's first row; the served path does not know
                       the chunks)
  torch_blocks         sglang_patch.forward.sparse_attention.attend_blocks: the path CUDA takes today without flashinfer
  sdpa_mask            one SDPA call with the dense [rows, keys] mask (K/V expanded to the q heads, so the
                       memory-efficient kernel takes it instead of the math fallback)
  flex_mask            FlexAttention with a block mask of the same per-position causality
  flex_two_pass        FlexAttention in two passes per chunk (keys before its start, keys within it), merged in
                       torch from their LSEs

Every variant's output on the selected rows is compared with a float32 reference (max abs difference over the
reference's max abs value); one above the dtype's tolerance, or a variant that fails, makes the exit status 1. `plan` is the once-per-pass setup (masks, FlashInfer plan), `run` one
layer's call (median of --repeats, CUDA events); `vs full` is full_causal's run time over the variant's.

Part 2, a whole prefill of a random-weight model of Llama-3.1-8B's shape (RMSNorm, fused q/k/v, RoPE llama3, o,
SwiGLU; `--layers` of them; the LM head on the last token): stock full prefill against chunkcache's blend at
`--model-rho`, which is (a) the copy of every chunk's stored KV into the pool, K re-rotated from its standalone
positions to its place (chunkcache.rope.Rotation, as BatchEngine.copy does: per layer, all chunks in one call),
from a store (`--sources`) in host memory (as the server's memory tier: pageable `host`, or page-locked `pinned` as
with `store.pin_memory`, copied without blocking; `pinned-int8`/`pinned-int4`: store.compress's codes, decoded on the
device) or already on the device, then (b) one pass of the selected tokens through every layer: linear layers on
those tokens only, fresh K/V written to the pool, each attention variant above that exists there. Each blend runs
twice: `serial`, the whole copy before the pass, and `overlap`, the copy layer by layer on a side stream behind the
pass (chunkcache.blend.layer_copy, as the server copies on CUDA). The stored KV is the full prefill's own, moved
to the chunks' standalone positions, so the blended logits must equal the full prefill's up to rounding: that checks
the re-rotation, the copy and the sparse attention end to end. The selector's own cost is not included (it differs per selector).

Part 3 (`--links`, after part 2): the host-to-device copy rate (page-locked and pageable), the device's decode cost
per token of each codec, and from them and part 2's full prefill cost per token, the fetch-or-compute table: where
store.remote_fetch's rule (chunkcache.store.link) flips for this model at each link rate.

GPU session (H100/H200), two commands of the `run` tool, each well inside its 10 minutes, both with carry [".fi"]
after `bash chunkbench/kernels/pack_flashinfer.sh --aot` here (the .venv's flashinfer 0.7.2 trimmed to 21 MB, its paged
prefill modules compiled here for sm_90a, + the cp312 apache-tvm-ffi wheel and the redis wheel chunkcache's store
imports; without --aot the first command JIT-builds them on the GPU machine, about 2 of its minutes; without the
tarball, install only the wheels: the flashinfer variants are then skipped with the reason printed):

    mkdir -p /tmp/site && tar -xzf .fi/flashinfer.tar.gz -C /tmp/site && python3 -m pip install -q --no-index \
      --no-deps --no-compile --target /tmp/site .fi/*.whl && export PYTHONPATH=/tmp/site \
      FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16;
    PYTHONUNBUFFERED=1 python3 -m chunkbench.kernels.gpu_blend --model-sizes 0 --json $OUT/attention.json 2>&1 \
      | tee $OUT/attention.log

and the same first line, then `PYTHONUNBUFFERED=1 python3 -m chunkbench.kernels.gpu_blend --sizes 0
--model-attention flashinfer_paged --sources device,pinned,pinned-int8 --json $OUT/model.json 2>&1 | tee
$OUT/model.log` (32 layers, 4K-32K: it ran on an H100 in 85 s, docs/bench/gpu.md). The layered copy's
own check runs there too: `python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_layer_copy.py`.

CPU self-check (tests/test_gpu_blend.py runs it in float32):

    .venv/bin/python -m chunkbench.kernels.gpu_blend --device cpu --sizes 512 --model-sizes 512 --layers 2 \
        --shape tiny --chunk 64

FlashInfer on the GPU machine: it has none and no network, and 64 MiB travels per command. The project's .venv holds
flashinfer-python 0.7.2 (a JIT-only py3 wheel, 593 MB installed: 273 MB of csrc for every kernel family, 50 MB of
CUTLASS, 33 MB of CCCL) and apache-tvm-ffi 0.1.11 built for CPython 3.11, while that machine runs 3.12; pip's cache
is empty. chunkbench/kernels/pack_flashinfer.sh says what it keeps and why; a module neither packed nor buildable there
fails its variants with the compiler's message and the others still run. Measured: docs/bench/gpu.md (H100, H200)."""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

# `python3 -m chunkbench.kernels.gpu_blend` from a plain checkout's root (the GPU machine has no install of this
# project) puts the root on sys.path, so chunkcache and sglang_patch import from it; none of the modules used here
# imports sglang.
from chunkcache.blend.attention import attend_blocks, plan_blocks
from chunkcache.blend.layer_copy import LayerCopy
from chunkcache.rope import RopeSpec, Rotation, rerotate, rotate_half
from chunkcache.store.codec import Codec
from sglang_patch.forward import paged_attention
from sglang_patch.forward.sparse_attention import Segment

SHAPES = {
    # Llama-3.1-8B; rope llama3 so that re-rotation runs its per-frequency scaled inverse frequencies
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256),
    # a few-MB stand-in so the self-check runs in seconds on a CPU
    "tiny": dict(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1000),
}
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
PREFIX, QUERY = 64, 64  # tokens of the shared prefix and of the question
# max |out - reference| / max |reference|: relative, since an attention row over many keys is small (~1/sqrt(keys))
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
VARIANTS = ("full_causal", "flashinfer_paged", "flashinfer_mask", "flashinfer_two_pass", "torch_blocks", "sdpa_mask",
            "flex_mask", "flex_two_pass")
SPARSE = VARIANTS[1:]


class Skip(Exception):
    """A variant that cannot run here, with the reason printed in its place."""


@dataclass
class Layout:
    """One prompt row: where its chunks are and which positions the blend recomputes."""

    n: int
    chunks: list[tuple[int, int]]  # [start, end) of each chunk
    sel: torch.Tensor  # [m] sorted recomputed positions (chunk picks + every query token)
    seg_start: torch.Tensor  # [m] start of the chunk (or of the query) that holds each selected position

    @classmethod
    def make(cls, n: int, rho: float, chunk: int, gen: torch.Generator) -> "Layout":
        query = min(QUERY, n // 8)
        prefix = min(PREFIX, n // 8)
        chunks = [(s, min(s + chunk, n - query)) for s in range(prefix, n - query, chunk)]
        n_ctx = n - query - prefix
        k = min(n_ctx, math.ceil(rho * n_ctx - 1e-9))  # chunkcache.select.base.Layout.budget
        picks = prefix + torch.randperm(n_ctx, generator=gen)[:k]
        sel = torch.cat([picks.sort().values, torch.arange(n - query, n)])
        starts = torch.tensor([s for s, _ in chunks] + [n - query])
        seg_start = starts[torch.searchsorted(starts, sel, right=True) - 1]
        return cls(n, chunks, sel, seg_start)


@dataclass
class Case:
    """One attention step's inputs: q of the selected rows, the pool holding the row's KV at `slots`."""

    layout: Layout
    q: torch.Tensor  # [m, Hq, D]
    k_buf: torch.Tensor  # [pool, Hk, D]
    v_buf: torch.Tensor
    slots: torch.Tensor  # [n] pool slots of positions 0..n-1
    scale: float

    @property
    def context(self) -> slice:
        """The row's slots as a view of the pool (they are one contiguous run, SGLang's usual allocation)."""
        return slice(int(self.slots[0]), int(self.slots[0]) + len(self.slots))


def make_case(n: int, rho: float, chunk: int, shape: dict, dtype, device, gen) -> Case:
    layout = Layout.make(n, rho, chunk, gen)
    hq, hk, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    pool = n + 1  # slot 0 is SGLang's padding slot
    randn = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)  # noqa: E731
    return Case(layout, randn(len(layout.sel), hq, d), randn(pool, hk, d), randn(pool, hk, d),
                torch.arange(1, n + 1, device=device), d ** -0.5)


def reference(c: Case) -> torch.Tensor:
    """float32 attention of the selected rows, in row blocks so that 32K keys fit."""
    group = c.q.shape[1] // c.k_buf.shape[1]
    keys = c.k_buf[c.context].float().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, n, D]
    values = c.v_buf[c.context].float().repeat_interleave(group, 1).transpose(0, 1)
    pos = c.layout.sel.to(c.q.device)
    k_pos = torch.arange(c.layout.n, device=c.q.device)
    out = torch.empty(c.q.shape, dtype=torch.float32, device=c.q.device)
    for i in range(0, len(pos), 256):
        logits = (c.q[i: i + 256].float().transpose(0, 1) @ keys.transpose(1, 2)) * c.scale
        logits.masked_fill_(k_pos[None, None, :] > pos[None, i: i + 256, None], float("-inf"))
        out[i: i + 256] = (logits.softmax(-1) @ values).transpose(0, 1)
    return out


# Each variant maps a Case to its plan: building it is the once-per-pass work, calling it one layer's attention.

def full_causal(c: Case):
    n, sel = c.layout.n, c.layout.sel.to(c.q.device)
    q = torch.randn(n, *c.q.shape[1:], dtype=c.q.dtype, device=c.q.device)
    q[sel] = c.q  # every position is a query; the selected ones carry the case's q, for the error check
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, c.k_buf[c.context], c.v_buf[c.context]))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=c.scale,
                                                  enable_gqa=True)[0].transpose(0, 1)[sel]


def _flashinfer(c: Case):
    if not paged_attention.available(c.q.device):
        raise Skip("needs a CUDA device and flashinfer (not importable here)")
    import flashinfer

    return flashinfer


def flashinfer_paged(c: Case):
    _flashinfer(c)
    hq, hk, d = c.q.shape[1], c.k_buf.shape[1], c.q.shape[2]
    plan = paged_attention.PagedSparsePrefill([Segment(slice(0, len(c.q)), c.layout.sel.to(c.q.device), c.slots)],
                                              hq, hk, d, d, c.scale, c.q.dtype, c.k_buf.dtype, c.q.device)
    return lambda: plan.run(c.q, c.k_buf, c.v_buf)


def flashinfer_mask(c: Case):
    flashinfer = _flashinfer(c)
    dev, sel = c.q.device, c.layout.sel.to(c.q.device)
    hq, hk, d = c.q.shape[1], c.k_buf.shape[1], c.q.shape[2]
    i32 = dict(dtype=torch.int32, device=dev)
    mask = (torch.arange(c.layout.n, device=dev)[None, :] <= sel[:, None]).flatten()
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev),
                                                             "NHD", backend="fa2")
    wrapper.plan(torch.tensor([0, len(sel)], **i32), torch.tensor([0, c.layout.n], **i32), c.slots.to(**i32),
                 torch.ones(1, **i32), hq, hk, d, 1, head_dim_vo=d, custom_mask=mask, sm_scale=c.scale,
                 q_data_type=c.q.dtype, kv_data_type=c.k_buf.dtype)
    return lambda: wrapper.run(c.q, (c.k_buf, c.v_buf))


def flashinfer_two_pass(c: Case):
    """PagedSparsePrefill with the rows grouped by the chunk that holds them (which the served path does not know)."""
    _flashinfer(c)
    hq, hk, d = c.q.shape[1], c.k_buf.shape[1], c.q.shape[2]
    _, counts = torch.unique_consecutive(c.layout.seg_start, return_counts=True)
    ends = counts.cumsum(0).tolist()
    by_chunk = list(zip([0] + ends[:-1], ends))
    plan = paged_attention.PagedSparsePrefill([Segment(slice(0, len(c.q)), c.layout.sel.to(c.q.device), c.slots)],
                                              hq, hk, d, d, c.scale, c.q.dtype, c.k_buf.dtype, c.q.device,
                                              grouping=lambda q_pos: by_chunk)
    return lambda: plan.run(c.q, c.k_buf, c.v_buf)


def torch_blocks(c: Case):
    blocks = plan_blocks(c.layout.sel.to(c.q.device), torch.arange(c.layout.n, device=c.q.device), False)
    return lambda: attend_blocks(c.q, c.k_buf[c.context], c.v_buf[c.context], blocks, c.scale)


def sdpa_mask(c: Case):
    group = c.q.shape[1] // c.k_buf.shape[1]
    pos = c.layout.sel.to(c.q.device)
    allowed = torch.arange(c.layout.n, device=c.q.device)[None, :] <= pos[:, None]
    bias = torch.zeros(allowed.shape, dtype=c.q.dtype, device=c.q.device).masked_fill_(~allowed, float("-inf"))

    def run():  # the expansion reads this layer's pool, so it is per-layer work
        qt = c.q.transpose(0, 1)[None]
        kt = c.k_buf[c.context].repeat_interleave(group, 1).transpose(0, 1)[None]
        vt = c.v_buf[c.context].repeat_interleave(group, 1).transpose(0, 1)[None]
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=c.scale)[0].transpose(0, 1)
    return run


@functools.cache
def _compiled_flex():
    """flex_attention compiled: its fused kernel. Each case's mask_mod closes over its own position tensors and
    each size is a new shape, so it recompiles per case: dynamo's default limit (8) would drop it to eager."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    return torch.compile(flex_attention)


def _flex_call(c: Case, masks, lse: bool):
    try:
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
    except ImportError as e:
        raise Skip(f"this torch has no FlexAttention with return_aux ({e})") from e
    dev = c.q.device
    # eager (unfused, scores materialised) off CUDA: enough for the CPU self-check, and no compiler run there
    fn = _compiled_flex() if dev.type == "cuda" else flex_attention
    m = len(c.q)
    block_masks = [create_block_mask(mod, None, None, m, c.layout.n, device=dev) for mod in masks]

    def call(bm):
        qt = c.q.transpose(0, 1)[None]
        kt, vt = (b[c.context].transpose(0, 1)[None] for b in (c.k_buf, c.v_buf))
        if not lse:
            return fn(qt, kt, vt, block_mask=bm, scale=c.scale, enable_gqa=True)[0].transpose(0, 1), None
        out, aux = fn(qt, kt, vt, block_mask=bm, scale=c.scale, enable_gqa=True,
                      return_aux=AuxRequest(lse=True))
        return out[0].transpose(0, 1), aux.lse[0].transpose(0, 1)  # [m, H, D], [m, H]
    return block_masks, call


def flex_mask(c: Case):
    pos = c.layout.sel.to(c.q.device)
    (bm,), call = _flex_call(c, [lambda b, h, q_idx, kv_idx: kv_idx <= pos[q_idx]], lse=False)
    return lambda: call(bm)[0]


def merge_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Two partial softmax attentions over disjoint key sets ([m, H, D] with natural-log LSE [m, H]) as one."""
    lse = torch.logaddexp(lse1, lse2)
    return (o1 * (lse1 - lse).exp()[..., None] + o2 * (lse2 - lse).exp()[..., None]).to(o1.dtype)


def flex_two_pass(c: Case):
    pos, start = c.layout.sel.to(c.q.device), c.layout.seg_start.to(c.q.device)
    (before, within), call = _flex_call(c, [
        lambda b, h, q_idx, kv_idx: kv_idx < start[q_idx],
        lambda b, h, q_idx, kv_idx: (kv_idx >= start[q_idx]) & (kv_idx <= pos[q_idx]),
    ], lse=True)

    def run():
        return merge_lse(*call(before), *call(within))
    return run


def timed(fn, repeats: int, device: torch.device) -> tuple[float, object]:
    """Median milliseconds of `repeats` calls (CUDA events on a GPU), and the last result."""
    times, out = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            out = fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times), out


def bench_attention(args, shape, dtype, device, gen) -> tuple[list[dict], bool]:
    rows, ok = [], True
    print(f"\n== attention, one layer: {shape['heads']} q / {shape['kv_heads']} kv heads, head dim "
          f"{shape['head_dim']}, {str(dtype).removeprefix('torch.')}; ms, median of {args.repeats}; "
          f"err = max |diff| / max |value| against float32 on the selected rows (tolerance {TOLERANCE[dtype]:g})")
    print(f"{'tokens':>7}{'rho':>6}{'rows':>7}  {'variant':<21}{'plan ms':>9}{'run ms':>9}{'vs full':>9}"
          f"{'err':>10}")
    for n in args.sizes:
        for rho in args.rhos:
            c = make_case(n, rho, args.chunk, shape, dtype, device, gen)
            want = reference(c)
            full_ms = None
            for name in args.variants:
                row = dict(tokens=n, rho=rho, rows=len(c.q), variant=name)
                try:
                    make = globals()[name]
                    make(c)()  # warm-up: compiles, JIT, autotuning
                    plan_ms, run = timed(lambda: make(c), min(3, args.repeats), device)
                    run_ms, out = timed(run, args.repeats, device)
                except Skip as e:
                    row["skipped"] = str(e)
                except torch.OutOfMemoryError:
                    row["skipped"] = "out of device memory"
                except Exception as e:  # noqa: BLE001  a kernel that fails to build or run here must not stop the rest
                    row.update(failed=f"{type(e).__name__}: {e}", ok=False)
                    ok = False
                if "skipped" in row or "failed" in row:
                    why = f"skipped: {row['skipped']}" if "skipped" in row else f"FAILED: {row['failed'][:300]}"
                    print(f"{n:>7}{rho:>6}{len(c.q):>7}  {name:<21}{why}")
                    rows.append(row)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                err = float((out.float() - want).abs().max() / want.abs().max())
                good = err <= TOLERANCE[dtype]
                ok &= good
                full_ms = run_ms if name == "full_causal" else full_ms
                ratio = f"{full_ms / run_ms:.2f}" if full_ms else "-"
                row.update(plan_ms=plan_ms, run_ms=run_ms, max_err=err, ok=good)
                rows.append(row)
                print(f"{n:>7}{rho:>6}{len(c.q):>7}  {name:<21}{plan_ms:>9.3f}{run_ms:>9.3f}{ratio:>9}"
                      f"{err:>10.2e}{'' if good else '  FAILS'}")
            del c, want
    return rows, ok


# ---- part 2: the whole prefill of an 8B-shaped model with random weights ----

class Model(torch.nn.Module):
    """Llama decoder with random weights, laid out as SGLang runs it (fused qkv and gate_up, a KV pool per layer)."""

    def __init__(self, shape: dict, layers: int, dtype, device, gen):
        super().__init__()
        h, f, hq, hk, d = shape["hidden"], shape["ffn"], shape["heads"], shape["kv_heads"], shape["head_dim"]
        self.hq, self.hk, self.d = hq, hk, d

        # drawn where they live, from a generator seeded off the run's seed: 8B weights drawn on the CPU and
        # moved take tens of seconds of the GPU machine's time; a CUDA tensor refuses a CPU generator
        local = torch.Generator(device).manual_seed(int(torch.randint(2 ** 62, (1,), generator=gen)))

        def w(rows, cols, std=None):  # N(0, 1/fan_in): q.k/sqrt(d) ~ N(0, 1), so attention depends on its keys
            std = cols ** -0.5 if std is None else std
            return torch.empty(rows, cols, dtype=dtype, device=device).normal_(0, std, generator=local)
        out_std = lambda cols: (2 * layers * cols) ** -0.5  # noqa: E731  residual branches: x stays O(1)
        self.embed, self.lm_head = w(shape["vocab"], h, 1.0), w(shape["vocab"], h)
        self.layers = [SimpleNamespace(qkv=w((hq + 2 * hk) * d, h), o=w(h, hq * d, out_std(hq * d)),
                                       gate_up=w(2 * f, h), down=w(h, f, out_std(f))) for _ in range(layers)]
        config = SimpleNamespace(rope_parameters=ROPE, head_dim=d, hidden_size=h, num_attention_heads=hq,
                                 max_position_embeddings=131072)
        self.rope = RopeSpec.from_config(config)

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """RoPE as transformers applies it: float32 angles p * inv_freq, cos/sin in the activation dtype."""
        angles = pos.float()[:, None] * self.rope.inv_freq.to(pos.device)[None, :]
        cos, sin = (t.repeat(1, 2)[:, None, :].to(x.dtype) for t in (angles.cos(), angles.sin()))
        return x * cos + rotate_half(x) * sin

    def forward(self, ids, pos, write_slots, k_pool, v_pool, attend, copied: LayerCopy | None = None):
        """Logits of the last of `ids` (at positions `pos`); K/V written to the pools at `write_slots` before
        `attend(q, k, v, layer)` runs, so a sparse pass reads reused and fresh keys alike from the pool; with
        `copied`, after that layer's copy (as sglang_patch.forward.sparse_attention waits for it)."""
        x = self.embed[ids]
        for i, layer in enumerate(self.layers):
            qkv = F.rms_norm(x, x.shape[-1:]) @ layer.qkv.T
            q, k, v = qkv.split([self.hq * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
            q = self.rotate(q.view(-1, self.hq, self.d), pos)
            k = self.rotate(k.view(-1, self.hk, self.d), pos)
            v = v.view(-1, self.hk, self.d)
            if copied is not None:
                copied.wait(i)
            k_pool[i][write_slots], v_pool[i][write_slots] = k, v
            x = x + attend(q, k, v, i).flatten(1) @ layer.o.T
            gate, up = (F.rms_norm(x, x.shape[-1:]) @ layer.gate_up.T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.down.T
        return F.rms_norm(x[-1:], x.shape[-1:]) @ self.lm_head.T


def full_prefill(model: Model, ids, slots, k_pool, v_pool, scale):
    def attend(q, k, v, _layer):  # fresh K/V of the whole prompt, contiguous: the flash kernel's causal case
        qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                              enable_gqa=True)[0].transpose(0, 1)
    return model(ids, torch.arange(len(ids), device=ids.device), slots, k_pool, v_pool, attend)


def copy_chunks(model: Model, store, slots, k_pool, v_pool, device, codec: Codec | None = None) -> LayerCopy:
    """sglang_patch.scheduler.blend.BatchEngine.copy on plain tensors: per layer, the stored chunks' KV (K post-RoPE
    at positions start_pos.., [layers, tokens, Hk, D], or the codec's tensors of them, decoded on the device after
    the copy) gathered on the device, K re-rotated to its place in one call and one write per buffer; layer by layer
    on a side stream on CUDA (chunkcache.blend.layer_copy)."""
    dst = torch.cat([slots[s:e] for s, e, *_ in store])
    dtype = k_pool[0].dtype
    rotation = Rotation.of(torch.cat([torch.full((e - s,), s - p) for s, e, p, *_ in store]), model.rope,
                           torch.cat([torch.arange(p, p + e - s) for s, e, p, *_ in store]), device)

    # chunks whose tokens fill whole K groups (all but the last) decode as one: their codes and groups concatenate
    whole_groups = codec is not None and all((e - s) % codec.group == 0 for s, e, *_ in store[:-1])

    def write(layer: int) -> None:
        if codec is None:
            k, v = (torch.cat([t[layer].to(device, non_blocking=True) for t in ts]) for ts in zip(*(
                (sk, sv) for *_, sk, sv in store)))
        else:  # sk: the codec's tensors [layers, ...], sv unused; one layer's copied, decoded on the device
            parts = [{name: t[layer: layer + 1].to(device, non_blocking=True) for name, t in sk.items()}
                     for *_, sk, _ in store]
            decoded = ([codec.decode({name: torch.cat([p[name] for p in parts], 1) for name in parts[0]}, dtype)]
                       if whole_groups else [codec.decode(p, dtype) for p in parts])
            k, v = (torch.cat([d[i][0] for d in decoded]) for i in (0, 1))
        k_pool[layer][dst], v_pool[layer][dst] = rotation.layer(layer).apply(k), v
    return LayerCopy(len(k_pool), device, write)


def blended_prefill(model, ids, layout, slots, k_pool, v_pool, store, scale, variant, device, codec=None,
                    overlap=True):
    copied = copy_chunks(model, store, slots, k_pool, v_pool, device, codec)
    if not overlap:  # the copy done before the pass starts
        copied.wait_all()
    sel = layout.sel.to(device)
    case = Case(layout, None, None, None, slots, scale)
    run = []

    def attend(q, _k, _v, layer):  # reads the pool, where the copy and this layer's fresh K/V went
        case.q, case.k_buf, case.v_buf = q, k_pool[layer], v_pool[layer]
        if not run:  # the plan is made once per pass, at the first layer, as SparseAttention does
            run.append(globals()[variant](case))
        return run[0]()
    return model(ids[sel], sel, slots[sel], k_pool, v_pool, attend, copied)


def stored(device_store, source: str, device) -> tuple[list, Codec | None]:
    """The chunks' KV as the store would hold it: on the device, in pageable (`host`) or page-locked (`pinned`)
    host memory, or compressed by store.compress's codec (`pinned-int8`, `pinned-int4`: encoded on the device,
    kept page-locked, decoded on the device after the copy)."""
    if source == "device":
        return device_store, None
    place = (lambda t: t.cpu()) if source == "host" else (
        (lambda t: t.cpu().pin_memory()) if device.type == "cuda" else (lambda t: t.clone()))
    if source in ("host", "pinned"):
        return [(s, e, p, place(k), place(v)) for s, e, p, k, v in device_store], None
    codec = Codec(int(source.removeprefix("pinned-int")))
    return [(s, e, p, {name: place(t) for name, t in codec.encode(k, v).items()}, None)
            for s, e, p, k, v in device_store], codec


def stored_bytes(store) -> int:
    return sum(t.nbytes for *_, k, v in store for t in ([*k.values()] if isinstance(k, dict) else [k, v]))


def bench_model(args, shape, dtype, device, gen) -> tuple[list[dict], bool]:
    rows, ok = [], True
    model = Model(shape, args.layers, dtype, device, gen)
    scale = shape["head_dim"] ** -0.5
    print(f"\n== whole prefill, {args.layers} layers of Llama-3.1-8B's shape ({args.shape}), random weights, "
          f"{str(dtype).removeprefix('torch.')}, rho {args.model_rho}; ms, median of {args.model_repeats}; "
          f"ratio = full / blended; err = max |logit diff| / max |logit| against the full prefill; copy = the "
          f"copy alone; serial: the pass starts after the whole copy, overlap: layer i + 1 copied during layer i")
    print(f"{'tokens':>7}{'rows':>7}  {'blend attention':<18}{'KV from':<13}{'B/token':>9}{'full ms':>10}"
          f"{'copy ms':>9}{'serial ms':>10}{'ratio':>7}{'overlap ms':>11}{'ratio':>7}{'err':>10}")
    for n in args.model_sizes:
        layout = Layout.make(n, args.model_rho, args.chunk, gen)
        ids = torch.randint(shape["vocab"], (n,), generator=gen).to(device)
        slots = torch.arange(1, n + 1, device=device)
        k_pool = [torch.zeros(n + 1, model.hk, model.d, dtype=dtype, device=device) for _ in model.layers]
        v_pool = [torch.zeros_like(t) for t in k_pool]
        full_prefill(model, ids, slots, k_pool, v_pool, scale)  # warm-up
        full_ms, want = timed(lambda: full_prefill(model, ids, slots, k_pool, v_pool, scale), args.model_repeats,
                              device)
        # the store: each chunk's KV as computed standalone right after the prefix (positions PREFIX..), here the
        # full prefill's own KV moved there, so that a correct blend reproduces the full prefill's logits
        layers_k, layers_v = torch.stack(k_pool)[:, 1:], torch.stack(v_pool)[:, 1:]
        prefix = layout.chunks[0][0]
        device_store = [(s, e, prefix, rerotate(layers_k[:, s:e], prefix - s, model.rope, torch.arange(s, e)),
                         layers_v[:, s:e].clone()) for s, e in layout.chunks]
        chunk_tokens = layout.chunks[-1][1] - prefix
        del layers_k, layers_v
        for variant in args.model_attention:
            for source in args.sources:
                row = dict(tokens=n, rows=len(layout.sel), attention=variant, kv_from=source, full_ms=full_ms,
                           full_ms_per_token=full_ms / n)
                try:
                    store, codec = stored(device_store, source, device)
                    row["bytes_per_token"] = per_token = stored_bytes(store) / chunk_tokens
                    for t in k_pool + v_pool:  # the chunks' slots must come from the copy, never from the full run
                        t[slots[prefix: layout.chunks[-1][1]]] = float("nan")
                    got = blended_prefill(model, ids, layout, slots, k_pool, v_pool, store, scale, variant, device,
                                          codec)
                    copy_ms, _ = timed(lambda: copy_chunks(model, store, slots, k_pool, v_pool, device,
                                                           codec).wait_all(), args.model_repeats, device)
                    blend = {overlap: timed(lambda: blended_prefill(model, ids, layout, slots, k_pool, v_pool, store,
                                                                    scale, variant, device, codec, overlap),
                                            args.model_repeats, device)[0] for overlap in (False, True)}
                except Skip as e:
                    print(f"{n:>7}{len(layout.sel):>7}  {variant:<18}skipped: {e}")
                    rows.append(dict(row, skipped=str(e)))
                    break
                except torch.OutOfMemoryError:
                    print(f"{n:>7}{len(layout.sel):>7}  {variant:<18}{source:<13}skipped: out of device memory")
                    rows.append(dict(row, skipped="out of device memory"))
                    torch.cuda.empty_cache()
                    continue
                except Exception as e:  # noqa: BLE001  as in bench_attention: report, go on with the others
                    print(f"{n:>7}{len(layout.sel):>7}  {variant:<18}{source:<13}FAILED: {type(e).__name__}: "
                          f"{str(e)[:300]}")
                    rows.append(dict(row, failed=f"{type(e).__name__}: {e}", ok=False))
                    ok = False
                    continue
                err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                # rounding differences grow through the layers; a compressed store's error is its codec's, reported
                good = err <= 5 * TOLERANCE[dtype] or codec is not None
                ok &= good
                serial, overlap = blend[False], blend[True]
                rows.append(dict(row, copy_ms=copy_ms, blend_ms=serial, ratio=full_ms / serial, overlap_ms=overlap,
                                 overlap_ratio=full_ms / overlap, err=err, ok=good))
                print(f"{n:>7}{len(layout.sel):>7}  {variant:<18}{source:<13}{per_token:>9.0f}{full_ms:>10.2f}"
                      f"{copy_ms:>9.2f}{serial:>10.2f}{full_ms / serial:>7.2f}{overlap:>11.2f}{full_ms / overlap:>7.2f}"
                      f"{err:>10.2e}{'' if good else '  FAILS'}")
                del store
        del k_pool, v_pool, device_store
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, ok


def bench_link(args, shape, dtype, device, gen, model_rows: list[dict]) -> dict:
    """The host-to-device copy rate (page-locked and pageable), the device's decode cost per token for each codec,
    and from them and the whole prefill's measured cost per token, where store.remote_fetch's rule (fetch a chunk
    when its bytes arrive faster than it computes: chunkcache.store.link) flips for this model at each link rate."""
    mib = args.copy_rate_mib
    src = torch.empty(mib << 20, dtype=torch.uint8)
    rates = {}
    for name, host in (("pageable", src), ("page-locked", src.pin_memory() if device.type == "cuda" else src)):
        ms, _ = timed(lambda: host.to(device, non_blocking=True), args.model_repeats, device)
        rates[name] = (mib << 20) / ms / 1e6  # GB/s
    L, hk, d, n = args.layers, shape["kv_heads"], shape["head_dim"], args.chunk * 8
    k = torch.randn(L, n, hk, d, generator=gen).to(device, dtype)
    v = torch.randn(L, n, hk, d, generator=gen).to(device, dtype)
    codecs = {"none": (None, 2 * k.nbytes / n, 0.0)}
    for bits in (8, 4):
        codec = Codec(bits)
        enc = codec.encode(k, v)
        ms, _ = timed(lambda: codec.decode(enc, dtype), args.model_repeats, device)
        codecs[f"int{bits}"] = (codec, sum(t.nbytes for t in enc.values()) / n, 1e3 * ms / n)  # B, us per token
    print(f"\n== fetch or compute, {L} layers of {args.shape}'s KV: host-to-device copy {rates['page-locked']:.1f} "
          f"GB/s page-locked, {rates['pageable']:.1f} GB/s pageable ({mib} MiB, median of {args.model_repeats}); "
          f"decode on the device per token: " + ", ".join(f"{c} {us:.3f} us" for c, (_, _, us) in codecs.items()
                                                          if c != "none"))
    print("fetch us/token = bytes / link + bytes / page-locked copy + decode; compute us/token = the full prefill's "
          "ms / tokens at that size; flip = the link rate above which fetching wins")
    links = [float(g) for g in args.links]
    print(f"{'tokens':>7}{'compute us':>11}  {'codec':<6}{'B/token':>9}"
          + "".join(f"{f'fetch@{g:g}G':>12}" for g in links) + f"{'flip Gb/s':>11}")
    table = []
    full = {r["tokens"]: r["full_ms_per_token"] for r in model_rows if "full_ms_per_token" in r}
    for tokens, c_ms in sorted(full.items()):
        compute_us = 1e3 * c_ms
        for name, (_, per_token, decode_us) in codecs.items():
            staged_us = per_token / rates["page-locked"] / 1e3 + decode_us  # B / (GB/s) = ns
            fetch = {g: per_token * 8 / (g * 1e3) + staged_us for g in links}  # B * 8 / (Gb/s * 1e3) = us
            room = compute_us - staged_us
            flip = per_token * 8 / (room * 1e3) if room > 0 else float("inf")
            table.append(dict(tokens=tokens, compute_us=compute_us, codec=name, bytes_per_token=per_token,
                              decode_us=decode_us, fetch_us=fetch, flip_gbps=flip))
            print(f"{tokens:>7}{compute_us:>11.2f}  {name:<6}{per_token:>9.0f}"
                  + "".join(f"{fetch[g]:>11.2f}{'*' if fetch[g] < compute_us else ' '}" for g in links)
                  + f"{flip:>11.1f}")
    print("* fetching is predicted faster than computing")
    return dict(copy_gb_per_s=rates, table=table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.kernels.gpu_blend", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    ap.add_argument("--sizes", type=ints, default=[4096, 8192, 16384, 32768],
                    help="prompt tokens, attention part (0: skip it)")
    ap.add_argument("--rhos", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 0.15, 0.3])
    ap.add_argument("--chunk", type=int, default=512, help="tokens per retrieved chunk")
    ap.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--model-sizes", type=ints, default=[4096, 8192, 16384, 32768],
                    help="prompt tokens, whole-prefill part (0: skip it)")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the random model")
    ap.add_argument("--model-rho", type=float, default=0.15)
    ap.add_argument("--model-attention", type=lambda s: s.split(","),
                    default=["flashinfer_paged", "flex_mask", "torch_blocks"], help="sparse variants the blend uses")
    ap.add_argument("--model-repeats", type=int, default=5)
    ap.add_argument("--sources", type=lambda s: s.split(","), default=["device", "pinned", "pinned-int8"],
                    help="where the stored KV is: device, host (pageable), pinned, pinned-int8, pinned-int4")
    ap.add_argument("--copy-rate-mib", type=int, default=1024, help="bytes per host-to-device rate measurement")
    ap.add_argument("--links", type=lambda s: s.split(","), default=["25", "100", "400"],
                    help="link rates (Gb/s) of the fetch-or-compute table (empty: skip it)")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants + args.model_attention if v not in VARIANTS]
    if unknown or "full_causal" in args.model_attention:
        ap.error(f"unknown or non-sparse variants {unknown or ['full_causal']}; choose from {', '.join(SPARSE)}")
    device, dtype, shape = torch.device(args.device), getattr(torch, args.dtype), SHAPES[args.shape]
    gen = torch.Generator().manual_seed(args.seed)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    fi = "flashinfer " + __import__("flashinfer").__version__ if paged_attention.available(device) else "no flashinfer"
    print(f"device {name}; torch {torch.__version__}; {fi}")
    attention, ok_a = bench_attention(args, shape, dtype, device, gen) if args.sizes != [0] else ([], True)
    model, ok_m = bench_model(args, shape, dtype, device, gen) if args.model_sizes != [0] else ([], True)
    link = bench_link(args, shape, dtype, device, gen, model) if model and args.links != [""] else {}
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=name, torch=torch.__version__, flashinfer=fi,
                                                   args=vars(args), attention=attention, model=model, link=link),
                                              indent=1))
    print("all outputs match the reference" if ok_a and ok_m else "SOME OUTPUTS DO NOT MATCH THE REFERENCE")
    return 0 if ok_a and ok_m else 1


if __name__ == "__main__":
    sys.exit(main())
