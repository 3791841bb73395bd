"""SpeCache decoding in SGLang (seed 003), on when `decode.specache.enabled`.

Each decode step runs two rows per request through SGLang's own model: the real token x_t at position p and the
speculative token s_t (the previous step's guess of x_{t+1}) at p + 1; s_t sees x_t, x_t does not see s_t.
Attention (`StepAttention`, standing in for the attention backend during the step) reads each request's context
as SpeCache holds it: the low-bit copy (specache_pool.LowBitPool) with the top-k pairs prefetched for this layer
and KV head replaced by their full-precision values, and the most recent tokens (the residual window) in full
precision, both from SGLang's pool (the host copy). Row 0's logits go back to SGLang, which samples x_{t+1} from
them; row 1's argmax is s_{t+1}, and row 1's attention (GQA-group mean) picks each layer's top-k for step t+1.
Only x_t's K/V reach the pool. A request's first decode step is preceded by SpeCache's pre-decode (Alg. 2): x_1
alone, whose logits give s_1 and whose attention gives the first top-k. This is the reference decode loop
(chunkcache.specache.decode) over SGLang's pools, with the same attention function.

Sampling: SGLang samples x_{t+1} from row 0's logits with the request's own settings (temperature, penalties,
grammar, logprobs all apply to them); s_{t+1} is always row 1's argmax, a guess that only steers the prefetch, so
sampling can lower the prefetch hit rate but never changes what is sampled from.

Memory: the device side of SpeCache is the low-bit pool plus each running request's residual window and top-k
pairs; SGLang's full-precision pool is the host copy. On this CPU both are the same RAM, and SGLang's pool is sized
by max_total_tokens, so max_total_tokens is left as configured (growing it would grow the full-precision copy in
the same memory, not free any): the low-bit and stock bytes per token are reported in /server_info
(internal_states[0]["specache"]) and logged at start-up.

What it cannot run on is refused at start-up (`problems`), never served another way.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field, replace

import torch
from sglang.srt.plugins.hook_registry import HookType

from chunkcache.specache.decode import SUPPORTED_MODELS
from chunkcache.specache.layer_cache import lowbit_bytes
from chunkcache.specache.step import select_topk, speculative_attention

from .specache_pool import LowBitPool

log = logging.getLogger(__name__)


def hooks() -> list[tuple[str, object, HookType]]:
    """SpeCache's entries of plugin.hooks(): its pool built once the runner exists, its decode step, its report."""
    return [
        ("sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs", _attach, HookType.AFTER),
        ("sglang.srt.model_executor.runner.eager_runner.EagerRunner._execute_decode", _decode, HookType.AROUND),
        ("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
         ".get_internal_state", _report, HookType.AFTER),
    ]


def _attach(result, model_runner, *args, **kwargs):
    """Once the runner's pools, backends and graphs exist: check the server can run SpeCache, build its pool."""
    from ..serve.launcher import load_server_config

    cfg = load_server_config().decode.specache
    if cfg.enabled and not model_runner.is_draft_worker:
        bad = problems(cfg, facts(model_runner))
        if bad:
            raise ValueError("decode.specache.enabled: " + "; ".join(bad))
        model_runner.chunkcache_specache = SpeCacheDecode(cfg, model_runner)
    return result


def facts(mr) -> dict:
    """What `problems` checks, read from a model runner once SGLang has resolved its settings."""
    from sglang.srt.runtime_context import get_disagg, get_parallel, get_schedule

    par = get_parallel()
    return {"device": mr.device, "model_type": mr.model_config.hf_config.model_type,
            "sliding_window": mr.sliding_window_size is not None or mr.is_hybrid_swa,
            "kv_pool": type(mr.token_to_kv_pool).__name__, "kv_dtype": mr.token_to_kv_pool.dtype,
            "page_size": get_schedule().page_size or 1, "decode_graph": mr.decode_cuda_graph_runner is not None,
            "mixed_chunk": get_schedule().enable_mixed_chunk, "overlap": not get_schedule().disable_overlap_schedule,
            "speculative": not mr.spec_algorithm.is_none(),
            "workers": (par.tp_size, par.pp_size, par.dp_size), "pdmux": get_disagg().enable_pdmux}


def problems(cfg, f: dict) -> list[str]:
    """Why SpeCache cannot run with these settings (`facts`), one reason per setting; empty if it can."""
    rules = [
        (f["device"] == "cpu", f"runs on CPU (its attention is a torch path), not on {f['device']!r}"),
        (f["model_type"] in SUPPORTED_MODELS, f"supports model types {SUPPORTED_MODELS}, not {f['model_type']!r}"),
        (not f["sliding_window"], "does not support sliding-window attention"),
        (f["kv_pool"] == "MHATokenToKVPool" and f["kv_dtype"] in (torch.bfloat16, torch.float16, torch.float32),
         f"needs SGLang's MHA KV pool in 16 or 32 bits, not {f['kv_pool']} ({f['kv_dtype']})"),
        (f["page_size"] % cfg.group == 0,
         f"needs SGLang's page size to be a multiple of decode.specache.group ({cfg.group}), so that a K group is "
         f"one run of KV slots; got {f['page_size']} (`chunkcache serve` sets it to the group)"),
        (not f["decode_graph"], "needs eager decoding (a captured decode graph would bypass it)"),
        (not f["mixed_chunk"], "cannot decode rows inside mixed prefill batches: drop --enable-mixed-chunk"),
        (not f["overlap"], "is built and tested for the scheduler without overlap (as `chunkcache serve` runs it on "
                           "CPU): pass --disable-overlap-schedule"),
        (not f["speculative"], "cannot run beside SGLang's speculative decoding"),
        (f["workers"] == (1, 1, 1), f"runs on one worker (tp, pp, dp sizes 1), not {f['workers']}"),
        (not f["pdmux"], "does not support --enable-pdmux"),
    ]
    return [f"SpeCache {why}" for ok, why in rules if not ok]


@dataclass
class ReqState:
    """One running request's SpeCache state (between steps)."""

    row: int  # its req_to_token row
    n: int  # context tokens (before the step's x_t) at its last step
    quantised: int = 0  # positions [0, quantised) are in the low-bit pool
    prefetched: list = field(default_factory=list)  # per layer: [H, k'] positions held in full precision
    spec: int | None = None  # s_t: the speculative token to feed with the next x_t
    fed: int | None = None  # the speculative token fed at the last step: its guess of this step's x_t


@dataclass
class Plan:
    """One request's rows in one pass."""

    state: ReqState
    slots: torch.Tensor  # KV slots of its context, in position order
    candidates: int  # the top-k is chosen among positions [0, candidates): low-bit at the next step


class SpeCacheDecode:
    def __init__(self, cfg, model_runner):
        self.cfg, self.mr = cfg, model_runner
        self.pool = LowBitPool(cfg, model_runner.token_to_kv_pool)
        self.states: dict[str, ReqState] = {}
        # s_t sits one past x_t; at the context's very end that position has no rotary angle (and no next step)
        self.max_pos = model_runner.model_config.hf_config.max_position_embeddings - 1
        self.counts = dict(steps=0, tokens=0, pre_decodes=0, read_bytes=0, stock_read_bytes=0, fetch_bytes=0,
                           spec_matches=0, spec_guesses=0, errors=0)
        info = self.info()
        log.info("chunkcache: SpeCache decoding (b=%d, g=%d, R=%d, k=%d): device pool %d B/token low-bit vs %d "
                 "B/token stock (%.3f) + %d B per running request; low-bit pool %.1f MiB for %d slots; "
                 "max_total_tokens unchanged (the full-precision copy is SGLang's pool, in the same memory)",
                 cfg.bits, cfg.group, cfg.residual, cfg.topk, info["lowbit_bytes_per_token"],
                 info["stock_bytes_per_token"], info["lowbit_ratio"], info["request_overhead_bytes"],
                 info["lowbit_pool_bytes"] / 2**20, info["pool_slots"])

    def quantised_len(self, n: int) -> int:
        g = self.cfg.group
        return max(n - self.cfg.residual, 0) // g * g

    def info(self) -> dict:
        p, cfg = self.pool, self.cfg
        row = 2 * p.heads * p.head_dim * p.elem_bytes  # one token's K and V, one layer
        return {
            "config": {"bits": cfg.bits, "group": cfg.group, "residual": cfg.residual, "topk": cfg.topk},
            "lowbit_bytes_per_token": p.lowbit_bytes_per_token(),
            "stock_bytes_per_token": p.full_bytes_per_token(),
            "lowbit_ratio": p.lowbit_bytes_per_token() / p.full_bytes_per_token(),
            # at most residual + group - 1 recent tokens in full precision, and topk pairs per KV head, per layer
            "request_overhead_bytes": ((cfg.residual + cfg.group - 1) * row + cfg.topk * row) * p.layers,
            "pool_slots": p.codes_k.shape[1], "lowbit_pool_bytes": p.allocated_bytes(),
            "max_total_tokens_grown": False, "tracked_requests": len(self.states), **self.counts,
        }

    def step(self, forward_batch):
        """One decode step of the batch; returns SGLang's LogitsProcessorOutput (row 0 of every request)."""
        fb = forward_batch
        table = self.mr.req_to_token_pool.req_to_token
        lens = (fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens).tolist()
        ids = fb.input_ids.tolist()
        states, plans, fresh, new_groups = {}, [], [], []
        for i, (rid, row, seq_len) in enumerate(zip(fb.rids, fb.req_pool_indices.tolist(), lens)):
            n = seq_len - 1  # x_t's slot is the row's last
            st = self.states.get(rid)
            if st is None or st.row != row or st.n != n - 1:  # new, or back after a retraction: start over
                st = ReqState(row, n, prefetched=[_none(self.pool)] * self.pool.layers)
                fresh.append(i)
            else:
                self.counts["spec_guesses"] += 1
                self.counts["spec_matches"] += st.fed == ids[i]
            st.n = n
            slots = table[row, :n].long()
            hi = self.quantised_len(n)
            if hi > st.quantised:  # whole groups that left the residual window since the last step
                new_groups.append(slots[st.quantised: hi])
                st.quantised = hi
            states[rid] = st
            plans.append(Plan(st, slots, self.quantised_len(n + 1)))
        self.states = states  # requests no longer decoding (finished, retracted) drop out
        if new_groups:
            self.pool.quantise(torch.cat(new_groups))
        if fresh:
            self._pre_decode(fb, fresh, [plans[i] for i in fresh])
        spec = torch.tensor([p.state.spec for p in plans], dtype=fb.input_ids.dtype, device=fb.input_ids.device)
        out = self._run(fb, torch.stack([fb.input_ids, spec], 1).flatten(),
                        torch.stack([fb.positions, (fb.positions + 1).clamp(max=self.max_pos)], 1).flatten(),
                        StepAttention(self, plans, rows=2, write_loc=fb.out_cache_loc))
        for p, s in zip(plans, out.next_token_logits[1::2].argmax(-1).tolist()):
            p.state.fed, p.state.spec = p.state.spec, s
        self.counts["steps"] += 1
        self.counts["tokens"] += len(plans)
        out.next_token_logits = out.next_token_logits[0::2].contiguous()
        for name in ("hidden_states", "last_hidden_states"):
            value = getattr(out, name, None)
            if isinstance(value, torch.Tensor) and value.shape[0] == 2 * len(plans):
                setattr(out, name, value[0::2].contiguous())
        return out

    def _pre_decode(self, fb, index: list[int], plans: list[Plan]) -> None:
        """Alg. 2 for requests at their first decode step: x_1 alone over the low-bit context (nothing prefetched
        yet); its logits give s_1, its attention the first top-k among the tokens low-bit now. Its K/V are not
        kept: the step that follows computes x_1 again, over the prefetched pairs."""
        plans = [Plan(p.state, p.slots, p.state.quantised) for p in plans]  # x_1 is not appended: no new group
        at = torch.tensor(index, device=fb.input_ids.device)
        out = self._run(fb, fb.input_ids[at], fb.positions[at], StepAttention(self, plans, rows=1, write_loc=None))
        for p, s in zip(plans, out.next_token_logits.argmax(-1).tolist()):
            p.state.spec = s
        self.counts["pre_decodes"] += len(plans)

    def _run(self, fb, input_ids, positions, attention: "StepAttention"):
        """SGLang's model forward over `input_ids` at `positions` (decode mode: logits for every row), with
        `attention` as the attention backend."""
        from sglang.srt.model_executor.forward_context import (ForwardContext, forward_context,
                                                               get_forward_context, has_forward_context)

        p = copy.copy(fb)
        n = input_ids.numel()
        p.input_ids, p.positions = input_ids, positions
        p.next_token_logits_buffer = None  # sized for the batch, not for its two rows per request
        p.global_num_token_non_padded_cpu = n
        if fb.global_num_token_non_padded is not None:
            p.global_num_token_non_padded = torch.tensor(n, dtype=torch.int32, device=input_ids.device)
        if fb.num_token_non_padded is not None:
            p.num_token_non_padded = torch.tensor(n, dtype=fb.num_token_non_padded.dtype, device=input_ids.device)
        ctx = (replace(get_forward_context(), attn_backend=attention) if has_forward_context()
               else ForwardContext(attn_backend=attention))
        with forward_context(ctx, forward_batch=p):
            return self.mr.model.forward(p.input_ids, p.positions, p)


def _none(pool: LowBitPool) -> torch.Tensor:
    return torch.empty(pool.heads, 0, dtype=torch.long, device=pool.codes_k.device)


class StepAttention:
    """The attention backend of one SpeCache pass: `rows` consecutive rows per request (x_t, then s_t)."""

    def __init__(self, decode: SpeCacheDecode, plans: list[Plan], rows: int, write_loc: torch.Tensor | None):
        self.decode, self.plans, self.rows, self.write_loc = decode, plans, rows, write_loc
        self.token_to_kv_pool = decode.mr.token_to_kv_pool
        self.req_to_token_pool = decode.mr.req_to_token_pool

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        hq, hk, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        q, k, v = q.view(-1, hq, d), k.view(-1, hk, d), v.view(-1, hk, dv)
        M, lid = self.rows, layer.layer_id
        if self.write_loc is not None:  # x_t's K/V into the full-precision pool; s_t's are dropped
            self.token_to_kv_pool.set_kv_buffer(layer, self.write_loc, k[0::M], v[0::M])
        dec = self.decode
        cfg, pool, counts = dec.cfg, dec.pool, dec.counts
        row_bytes = d * 2 * pool.elem_bytes  # one head's K and V of one token
        out = q.new_empty(q.shape[0], hq, dv)
        for i, p in enumerate(self.plans):
            r = slice(i * M, (i + 1) * M)
            st, n = p.state, len(p.slots)
            old = st.prefetched[lid]
            keys, values = pool.context(lid, p.slots, st.quantised, old)
            out[r], probs = speculative_attention(q[r], k[r], v[r], keys, values, layer.scaling)
            new = select_topk(probs[-1], p.candidates, cfg.topk)
            st.prefetched[lid] = new
            if self.write_loc is not None:  # a decode step's traffic (the pre-decode's is part of its request's)
                resident = int((new[:, :, None] == old[:, None, :]).any(-1).sum())
                counts["read_bytes"] += (lowbit_bytes(cfg, hk, d, st.quantised) + (n - st.quantised) * hk * row_bytes
                                         + old.numel() * row_bytes)
                counts["stock_read_bytes"] += n * hk * row_bytes
                counts["fetch_bytes"] += (new.numel() - resident) * row_bytes
        return out.view(-1, hq * dv)


def _decode(original, runner, forward_batch, pp_proxy_tensors=None):
    specache = getattr(runner.model_runner, "chunkcache_specache", None)
    if specache is None or forward_batch.rids is None:  # off, or a batch without requests (a warm-up)
        return original(runner, forward_batch, pp_proxy_tensors)
    try:
        return specache.step(forward_batch)
    except Exception:  # noqa: BLE001 - a bug here must not take the scheduler (and every request) down
        # Counted in /server_info ("errors") and logged; the step is decoded in full precision, and the batch's
        # requests start SpeCache over (their speculative tokens and top-k sets are stale).
        log.exception("chunkcache: SpeCache decode step failed; this step is decoded by the attention backend")
        specache.counts["errors"] += 1
        specache.states = {}
        return original(runner, forward_batch, pp_proxy_tensors)


def _report(result, controller, *args, **kwargs):
    """/server_info: internal_states[i]["specache"], the pool's bytes per token and the decode's counters."""
    specache = getattr(controller.scheduler.tp_worker.model_runner, "chunkcache_specache", None)
    if specache is not None:
        result.internal_state["specache"] = specache.info()
    return result
