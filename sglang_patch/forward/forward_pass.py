"""One forward of SGLang's own model over tokens the blend chooses, in an extend batch's KV pool.

A `Pass` is built first: segments (sparse_attention.Segment) of one batch row's tokens at their positions, written
to the row's slots, or tokens kept aside (their K/V returned, never written). `Runner.run` then runs it once as a
forward of the model on a copy of the batch that states the pass's own tokens, with `SparseAttention` standing in
for the attention backend.
"""

from __future__ import annotations

import copy
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch

from chunkcache.blend.layer_copy import LayerCopy

from .sparse_attention import Segment, SparseAttention


@dataclass(frozen=True)
class Row:
    """One request of the extend batch, as its forward sees it."""

    req: object  # SGLang's Req
    index: int  # position in the batch
    slots: torch.Tensor  # [seq_len] KV-pool slots of its tokens
    token_ids: torch.Tensor  # [seq_len]
    matched: int  # tokens [0, matched) already hold exact KV (the radix match; all but one for a decode row)

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)

    @property
    def decode(self) -> bool:
        """A decode row of a mixed batch (--enable-mixed-chunk): one new token after the prompt."""
        return self.seq_len - self.matched == 1 and self.seq_len > len(self.req.origin_input_ids)


def batch_rows(model_runner, forward_batch, reqs) -> list[Row]:
    """The extend batch's requests as `Row`s, in batch order."""
    table = model_runner.req_to_token_pool.req_to_token
    rows = []
    for i, req in enumerate(reqs):
        seq_len = int(forward_batch.seq_lens_cpu[i])
        tokens = (list(req.origin_input_ids) + list(req.output_ids))[:seq_len]
        rows.append(Row(req, i, table[forward_batch.req_pool_indices[i], :seq_len].long(),
                        torch.as_tensor(tokens, dtype=torch.long), int(forward_batch.extend_prefix_lens_cpu[i])))
    return rows


def input_logprob_tokens(forward_batch) -> list[int]:
    """Per batch row, how many of its extend tokens SGLang scores with input logprobs (0 for a request that asked for
    output logprobs alone, or none)."""
    if not forward_batch.return_logprob or forward_batch.extend_logprob_start_lens_cpu is None:
        return [0] * len(forward_batch.extend_seq_lens_cpu)
    return [e - s for e, s in zip(forward_batch.extend_seq_lens_cpu, forward_batch.extend_logprob_start_lens_cpu)]


def one_row(forward_batch, n: int):
    """A copy of the extend batch stating one row of `n` tokens, none of them scored for logprobs: what
    Runner.run(logits=True) reads of its batch for a pass of one segment. Its tensors are the batch's or new."""
    fb = copy.copy(forward_batch)
    fb.batch_size = 1
    fb.seq_lens = torch.tensor([n], dtype=forward_batch.seq_lens.dtype, device=forward_batch.seq_lens.device)
    fb.seq_lens_cpu = torch.tensor([n], dtype=torch.int64)
    fb.extend_seq_lens_cpu = [n]
    fb.return_logprob = False
    fb.extend_logprob_start_lens_cpu = None
    fb.top_logprobs_nums = fb.token_ids_logprobs = None
    fb.extend_input_logprob_token_ids_gpu = None
    fb.next_token_logits_buffer = None  # the batch's, which a later forward owns
    fb.is_prefill_only = False
    return fb


class Pass:
    """The tokens of one forward, as segments with their ids, positions and pool slots; built first, then run once."""

    def __init__(self):
        self.segments: list[Segment] = []
        self.ids: list[torch.Tensor] = []
        self.pos: list[torch.Tensor] = []
        self.loc: list[torch.Tensor] = []
        self.counts: list[int] = []  # tokens per segment

    @property
    def n(self) -> int:
        return sum(self.counts)

    def add(self, row: Row, sel: torch.Tensor, ctx: int, visible: torch.Tensor | None = None) -> Segment:
        """Tokens `sel` of `row`, written to its slots, attending to its slots [0, ctx), or only to those at the
        sorted positions `visible` (which hold `sel`)."""
        slots = row.slots[:ctx] if visible is None else row.slots[visible.to(row.slots.device)]
        seg = Segment(slice(self.n, self.n + len(sel)), sel.to(row.slots.device), slots, ctx_pos=visible)
        return self._append(seg, row.token_ids[sel], sel, row.slots[sel])

    def add_aside(self, ids: torch.Tensor, q_pos: torch.Tensor, ctx_slots: torch.Tensor,
                  ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Segment:
        """Tokens at positions `q_pos` attending to `ctx_slots` (or to `ctx_kv`, the K/V of positions 0..c-1 per
        layer, given outright) and to each other; their K/V are kept in the segment's kept_kv, never written to the
        pool."""
        if ctx_kv is not None:  # the key axis' length; nothing of the pool is read
            ctx_slots = torch.zeros(len(ctx_kv[0][0]), dtype=torch.long, device=ctx_slots.device)
        seg = Segment(slice(self.n, self.n + len(ids)), q_pos.to(ctx_slots.device), ctx_slots, to_pool=False,
                      ctx_kv=ctx_kv)
        return self._append(seg, ids, q_pos, torch.zeros(len(ids), dtype=torch.long))

    def _append(self, seg: Segment, ids, pos, loc) -> Segment:
        self.segments.append(seg)
        self.ids.append(ids)
        self.pos.append(pos.cpu())
        self.loc.append(loc)
        self.counts.append(len(ids))
        return seg


class Runner:
    """Runs passes as forwards of SGLang's model on a copy of the batch that states the pass's own tokens."""

    def __init__(self, model_runner, forward_batch):
        self.model_runner, self.forward_batch = model_runner, forward_batch
        self.device = forward_batch.input_ids.device if forward_batch.input_ids is not None else model_runner.device
        self.forwards = 0
        self.copied: LayerCopy | None = None  # the batch's chunk KV copy; a pass's attention waits for its layers

    def run(self, p: Pass, logits: bool = False, layers: int | None = None):
        """One forward over `p`. With `logits`, `p` holds one segment per request of the batch, each ending with
        that request's last prompt token, and the logits output is returned; otherwise only the KV side effects
        (pool writes, segment kept_kv and attention sums) matter. `layers` stops the forward after that many layers."""
        from sglang.srt.model_executor.forward_context import forward_context, get_forward_context, has_forward_context

        src = self.forward_batch
        device = self.device
        fb = copy.copy(src)
        fb.input_ids = torch.cat(p.ids).to(device)
        fb.positions = torch.cat(p.pos).to(device)
        fb.out_cache_loc = torch.cat(p.loc).to(device=device, dtype=src.out_cache_loc.dtype)
        n = fb.input_ids.numel()
        lens = p.counts if logits else [n]
        scored = ()
        fb.extend_num_tokens = n
        fb.extend_seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        fb.extend_seq_lens_cpu = list(lens)
        fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
        # SGLang narrows q/k/v to the batch's real token count (graph_utils.padded_extend_real_tokens): a pass
        # states its own, or one with more tokens than the scheduled extend would be cut short
        fb.global_num_token_non_padded_cpu = n
        if src.global_num_token_non_padded is not None:
            fb.global_num_token_non_padded = torch.tensor(n, dtype=torch.int32, device=device)
        if src.num_token_non_padded is not None:
            fb.num_token_non_padded = torch.tensor(n, dtype=src.num_token_non_padded.dtype, device=device)
        if logits:
            fb.extend_prefix_lens = src.seq_lens - fb.extend_seq_lens
            fb.extend_prefix_lens_cpu = [int(s) - c for s, c in zip(src.seq_lens_cpu, lens)]
            # each row keeps the input logprobs SGLang scheduled for it (its last tokens: a row computed exactly
            # has them all; a blended row asked for none, scheduler.blend), so the batch's logprob token ids still
            # line up
            scored = input_logprob_tokens(src)
            if src.extend_logprob_start_lens_cpu is not None:
                fb.extend_logprob_start_lens_cpu = [c - n for c, n in zip(lens, scored)]
        lasts_only = logits and not any(scored) and not (fb.capture_hidden_mode and fb.capture_hidden_mode.is_full())
        backend = SparseAttention(self.model_runner.attn_backend, p.segments, fb.out_cache_loc, device,
                                  copied=self.copied,
                                  final_layer=_last_layer(self.model_runner.model) if lasts_only else None)
        if has_forward_context():
            ctx = replace(get_forward_context(), attn_backend=backend)
        else:
            from sglang.srt.model_executor.forward_context import ForwardContext

            ctx = ForwardContext(attn_backend=backend)
        model = self.model_runner.model
        self.forwards += 1
        with forward_context(ctx, forward_batch=fb), (_first_layers(model, layers) if layers else nullcontext()):
            if logits:
                return model.forward(fb.input_ids, fb.positions, fb)
            model.model(fb.input_ids, fb.positions, fb)
            return None


def _last_layer(model) -> int | None:
    """The id of the model's last decoder layer (its attention's layer_id; under pipeline parallelism only the last
    stage holds it), or None when the model states no layer count (every layer then attends every row)."""
    config = getattr(model, "config", None)
    layers = getattr(getattr(config, "text_config", config), "num_hidden_layers", None)
    return None if layers is None else layers - 1


@contextmanager
def _first_layers(model, n: int):
    """Run only the first `n` decoder layers: most SGLang models loop over `model.model.start_layer..end_layer`;
    those without (Gemma 3) over `model.model.layers`, which is cut for the pass (its output is not used)."""
    inner = model.model
    if hasattr(inner, "end_layer"):
        name, cut = "end_layer", min(inner.end_layer, inner.start_layer + n)
    elif isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        name, cut = "layers", inner.layers[:n]
    else:
        raise NotImplementedError(f"{type(inner).__name__} has neither end_layer nor layers: cannot stop its forward "
                                  f"early")
    whole = getattr(inner, name)
    setattr(inner, name, cut)
    try:
        yield
    finally:
        setattr(inner, name, whole)


class Aside:
    """What an idle job keeps of the extend batch that queued it (chunkcache.blend.idle): the model runner and a
    shallow copy of the batch as the template of one-row forwards (`one_row`), never the batch's engine. Its forwards
    run a prompt from position 0, one row kept aside: nothing of the KV pool read or written (the batch, and its
    requests' slots, are long gone when they run). They run a slice at a time: each step (`next()`) is one forward of
    at most `slice_tokens` tokens attending to the K/V the earlier slices kept, so that a request arriving meanwhile
    waits for one slice, not the whole prompt (None: one forward). The slicing is a function of the prompt's length
    alone, so the same prompt always gets the same bits."""

    def __init__(self, model_runner, forward_batch, slice_tokens: int | None = None):
        self.model_runner, self.template, self.slice_tokens = model_runner, copy.copy(forward_batch), slice_tokens

    def kv(self, token_ids: torch.Tensor, layers: int | None = None) -> Generator[None, None, tuple[torch.Tensor,
                                                                                                      torch.Tensor]]:
        """Steps; returns K and V [layers, tokens, heads, dim] on the host of `token_ids` through the first `layers`
        layers (None: every layer)."""
        kept = yield from self._slices(token_ids, layers=layers)
        return torch.stack([k for k, _ in kept]).cpu(), torch.stack([v for _, v in kept]).cpu()

    def logits(self, token_ids: torch.Tensor, answer: torch.Tensor | None = None) -> Generator[None, None,
                                                                                                torch.Tensor]:
        """Steps; returns [1 + len(answer), V] float32 on the host, computed exactly through every layer: the last
        token's logits of `token_ids`, then, teacher-forced, those after each token of `answer` (the prompt followed
        by the answer so far). The answer's tokens are forwards of one token each, after the prompt's slices: the
        prompt is sliced as without them, so its bits do not depend on the answer."""
        answer = token_ids.new_zeros(0) if answer is None else answer.to(token_ids)
        out: list = []
        yield from self._slices(torch.cat([token_ids, answer]), logits=out, tail=len(answer))
        return torch.stack([o.next_token_logits[0].detach().float().cpu() for o in out])

    def _slices(self, token_ids: torch.Tensor, layers: int | None = None, logits: list | None = None, tail: int = 0):
        """Per layer, the (K, V) of every token, computed slice by slice (one forward each, a step between them): the
        first `len - tail` tokens in slices of `slice_tokens`, the last `tail` one token each. With `logits`, the
        output of the prompt's last slice and of every tail slice is appended to it."""
        n = len(token_ids)
        prompt = n - tail
        size = self.slice_tokens or prompt
        ends = [*range(size, prompt, size), prompt, *range(prompt + 1, n + 1)]
        kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        start = 0
        for end in ends:
            runner = Runner(self.model_runner, one_row(self.template, end))
            p = Pass()
            seg = p.add_aside(token_ids[start:end], torch.arange(start, end),
                              torch.zeros(0, dtype=torch.long, device=runner.device), ctx_kv=kept)
            wanted = logits is not None and end >= prompt
            with torch.no_grad():
                out = runner.run(p, logits=True) if wanted else runner.run(p, layers=layers)
            if wanted:
                logits.append(out)
            kept = seg.kept_kv if kept is None else [(torch.cat([k0, k1]), torch.cat([v0, v1]))
                                                     for (k0, v0), (k1, v1) in zip(kept, seg.kept_kv)]
            start = end
            if end < n:
                yield
        return kept
