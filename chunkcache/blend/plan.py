"""One request's blend plan: which chunks it reuses, where they sit, which tokens are computed exactly first.

Pure: built from the prompt, the chunk spans with their store keys and the length of the exact prefix the engine
already holds (SGLang's radix match, or nothing), without reading the store or touching a model. The pipeline
(chunkcache.blend.pipeline) runs it.

    >>> import torch
    >>> plan = plan_request(torch.arange(10), spans=((2, 5), (5, 8)), keys=("a", "b"), matched=3,
    ...                     selector="epic", ratio=0.2)
    >>> [(c.key, c.span, c.chunk) for c in plan.chunks]  # the radix match reaches into chunk "a": its head is exact
    [('a', (3, 5), (2, 5)), ('b', (5, 8), (5, 8))]
    >>> plan.start, plan.query, plan.layout().chunk_spans
    (3, 8, ((3, 5), (5, 8)))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..select.base import Layout


@dataclass(frozen=True)
class Placement:
    """One chunk of a request: the prompt tokens whose KV comes from its stored entry."""

    key: str  # chunk-store key of the whole chunk
    span: tuple[int, int]  # prompt tokens [s, e) blended (the chunk's tail when its head is exact)
    head: int = 0  # tokens of the stored chunk before `span`: held by the exact prefix, or computed before the blend

    @property
    def chunk(self) -> tuple[int, int]:
        """The whole chunk's tokens in the prompt: what its stored entry holds."""
        return self.span[0] - self.head, self.span[1]


@dataclass(frozen=True)
class RequestPlan:
    token_ids: torch.Tensor  # [N] int64, the whole prompt
    matched: int  # tokens [0, matched) hold exact KV before the blend starts
    shared_prefix_len: int  # every chunk's KV is computed right after token_ids[:shared_prefix_len]
    query: int  # first token after the last chunk: the query, the last prompt token among them
    chunks: tuple[Placement, ...]  # in prompt order; empty when the exact prefix covers every chunk
    selector: str
    ratio: float
    max_kl: float | None = None  # the quality floor: rho is then the smallest whose estimate meets it (blend.fidelity)
    kl_over: str = "answer"  # what max_kl bounds (hints.KL_OVER): the answer, or its first token only
    tenant: str = ""  # hashing.tenant_key its chunk keys were made for
    # hashing.prefix_key of token_ids[:shared_prefix_len] when every chunk's key names that context (a client's
    # chunks), so a missing chunk computed after it is what its key names and is stored; None when the keys name
    # another (automatic detection's head and paragraph): a chunk computed here then serves this request only
    context: str | None = None

    @property
    def n(self) -> int:
        return int(self.token_ids.numel())

    @property
    def start(self) -> int:
        """First token without exact KV once the unmatched shared prefix is filled."""
        return self.chunks[0].span[0] if self.chunks else max(self.matched, self.shared_prefix_len)

    @property
    def blends(self) -> bool:
        return bool(self.chunks)

    def layout(self) -> Layout:
        """What selectors see: the exact prefix is everything before the first blended token."""
        return Layout(token_ids=self.token_ids, prefix_len=self.start,
                      chunk_spans=tuple(c.span for c in self.chunks), query_span=(self.query, self.n))

    def chunk_ids(self, c: Placement) -> torch.Tensor:
        s, e = c.chunk
        return self.token_ids[s:e]


def plan_request(token_ids: torch.Tensor, spans: Sequence[tuple[int, int]], keys: Sequence[str], matched: int,
                 selector: str, ratio: float, shared_prefix_len: int | None = None,
                 max_kl: float | None = None, tenant: str = "", context: str | None = None,
                 kl_over: str = "answer") -> RequestPlan:
    """`spans`: the chunks (sorted, disjoint, before the last token) with their store `keys`; `matched`: the exact
    prefix the engine holds; `shared_prefix_len`: by default where the first chunk starts (a prompt without chunks
    must give it); `tenant`, `context`: see RequestPlan. A chunk the exact prefix reaches into keeps the exact KV of
    its head."""
    if len(spans) != len(keys):
        raise ValueError(f"a plan needs one key per span; got {len(spans)} spans and {len(keys)} keys")
    if shared_prefix_len is None:
        if not spans:
            raise ValueError("a plan without chunks needs the shared prefix's length")
        shared_prefix_len = spans[0][0]
    chunks = tuple(Placement(key, (max(s, matched), e), max(s, matched) - s)
                   for (s, e), key in zip(spans, keys) if e > matched)
    return RequestPlan(token_ids=token_ids, matched=matched, shared_prefix_len=shared_prefix_len,
                       query=spans[-1][1] if spans else shared_prefix_len,
                       chunks=chunks, selector=selector, ratio=ratio, max_kl=max_kl, tenant=tenant, context=context,
                       kl_over=kl_over)


def to_compute(plans: Sequence[RequestPlan], stored: set[str] | dict) -> list[tuple[int, Placement]]:
    """The chunks no entry holds, each once (the first request that has it, with its index): a chunk missing from
    several requests of a batch is computed once."""
    seen, out = set(stored), []
    for i, plan in enumerate(plans):
        for c in plan.chunks:
            if c.key not in seen:
                seen.add(c.key)
                out.append((i, c))
    return out


def recompute_set(layout: Layout, picked: torch.Tensor) -> torch.Tensor:
    """The tokens a request recomputes, sorted: the selector's picks and the tokens every blend recomputes (query,
    anything between chunks, the last prompt token)."""
    picked = picked.long().cpu()
    if picked.numel() and (int(picked.min()) < 0 or int(picked.max()) >= layout.n):
        raise ValueError(f"selector picked indices outside the prompt [0, {layout.n})")
    mask = layout.forced_mask()
    mask[picked] = True
    return mask.nonzero().flatten()
