"""Chunks for prompts nobody marked: a prompt's content-defined segments (chunkcache.segment), the stored ones turned
into a chunk hint, and the paragraphs a prompt teaches the store, each encoded on its own.

Contract:
- A segment's entry is a pure function of its key (chunkcache.store.entry): its KV is what the model computes for
  its paragraph on its own, after the server's canonical `head` (`auto.head`: the tokens the model's chat template
  puts before a user message's text, the same for every prompt and tenant) and nothing else. The segment's
  `context` is the head, then its paragraph's tokens before it (a paragraph starts after a line break, or where the
  prompt does); its key hashes the model, the tenant (namespace and `cache_salt`), that context and its tokens. So
  whatever preceded a passage in the prompt that taught the store (an instruction, another tenant's turn, a
  malicious document) has no part in what any prompt is later served, and the same passage taught by two prompts or
  two servers is stored as the same bits under the same key.
- A prompt teaches by naming work, never by handing over KV: `to_encode` lists the paragraphs holding a segment no
  tier holds (`Encode`, the head then the paragraph through its last such segment), which the engine computes in a
  one-row forward of exactly those tokens (an idle turn's work: chunkcache.blend.reuse) and stores. When the store is
  `crowded` (learning would evict), a segment is learned only once seen in `admit_after` prompts (sightings are
  counted always, for the `seen_keys` most recent keys).
- `detect` is pure given the store's answer: the stored segments that end past the exact prefix and before the
  prompt's last token become the hint's chunks when they add up to `min_reuse_tokens`; otherwise None and the
  request is served as stock. A segment the exact prefix reaches into is reused from the prefix's end. No segment
  needs a lead of exact tokens: like a hinted chunk's, its KV saw only the head and its own paragraph.
- A paragraph is also looked up as a wrapper and a taught one (`Form.lead`): read as if its first `lead` tokens
  (1..`edge_tokens`) were not part of it, and its last segment without up to `edge_tokens` of its last tokens, so a
  passage taught bare (ingest, the documents API, a request of its own) is found on a line that wraps it
  (`<document>...</document>`); per paragraph, the reading with the most stored tokens is used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..config import AutoConfig
from ..hashing import entry_key, prefix_key, tenant_key
from ..segment import Segmenter


@dataclass(frozen=True)
class Form:
    """One way a segment of the prompt may be stored: in its paragraph read from `paragraph + lead` on (`lead` tokens
    taken as a wrapper the taught paragraph lacked; 0: the paragraph as it is), as `span` (the segment, or its first
    or last tokens trimmed at the paragraph's edges)."""

    segment: int  # which segment (index into Segments.spans)
    lead: int
    span: tuple[int, int]
    key: str


@dataclass(frozen=True)
class Segments:
    """One prompt's segments that may be reused (at least the segmenter's minimum length), for one tenant."""

    spans: tuple[tuple[int, int], ...]
    keys: tuple[str, ...]  # each segment's key as its paragraph teaches it
    paragraphs: tuple[int, ...]  # where each segment's paragraph starts in the prompt
    contexts: tuple[str, ...]  # each segment's context digest (prefix_key of the head and its paragraph before it)
    tenant: str  # hashing.tenant_key of the namespace and salt its keys were made for
    forms: tuple[Form, ...] = ()  # every form detection looks up: the segments as taught, then the wrapped readings

    def lookup_keys(self, matched: int) -> list[tuple[int, str]]:
        """(tokens, key) of every form that ends past `matched` (one the exact prefix reaches into may be reused from
        there on)."""
        return [(f.span[1] - f.span[0], f.key) for f in self.forms if f.span[1] > matched]


@dataclass(frozen=True)
class Encode:
    """One paragraph to learn: `token_ids` are the head, then the paragraph through its last segment to store; each
    of `entries` is (span in token_ids, key, context digest), its KV what a forward of token_ids from position 0 gives
    at that span (the span's start is its entry's start_pos)."""

    token_ids: torch.Tensor  # [head + paragraph] int64
    entries: tuple[tuple[tuple[int, int], str, str], ...]
    tenant: str

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for _, key, _ in self.entries)


@dataclass(frozen=True)
class Detected:
    spans: tuple[tuple[int, int], ...]  # stored segments past the exact prefix (a hint's chunks), whole
    keys: tuple[str, ...]
    tokens: int  # tokens they cover past the exact prefix (what the blend reuses)


def canonical_head(tokenizer, mode: str) -> list[int]:
    """auto.head's token ids: for "chat", the model's chat template before a user message's text (its default system
    message included), the tokenizer's BOS without a template; nothing for "none"."""
    if mode == "none":
        return []
    if not getattr(tokenizer, "chat_template", None):
        return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    mark = "\x00chunkcache-text\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    return tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"]


class AutoChunks:
    def __init__(self, config: AutoConfig, break_ids: frozenset[int], fingerprint: str, head: Sequence[int] = ()):
        """`head`: the canonical head every paragraph is encoded after (ChunkReuse picks it from `auto.head`)."""
        self.config, self.fingerprint = config, fingerprint
        self.head = torch.as_tensor(list(head), dtype=torch.long)
        self.segmenter = Segmenter(break_ids, mean=config.segment_mean_tokens, min_tokens=config.segment_min_tokens,
                                   max_tokens=config.segment_max_tokens)
        self._seen: OrderedDict[str, int] = OrderedDict()  # sightings per key, least recent first

    def segments(self, token_ids: Sequence[int] | torch.Tensor, namespace: str, cache_salt: str | None,
                 readings: bool = True) -> Segments:
        """`readings`: with the wrapped readings detection looks up (a prompt that only teaches, a client's chunks,
        needs none: `forms` then holds the segments as taught)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        spans = tuple((s, e) for s, e in self.segmenter.spans(ids.numpy()) if e - s >= self.config.segment_min_tokens)
        arr = ids.numpy()
        after_break = np.isin(arr, np.fromiter(self.segmenter.break_ids, dtype=np.int64)) * np.arange(1, len(arr) + 1)
        paragraph = np.maximum.accumulate(after_break) if len(arr) else after_break  # [i]: a paragraph starts there
        starts = [int(paragraph[s - 1]) if s else 0 for s, _ in spans]
        tenant = tenant_key(namespace, cache_salt)

        def context(p: int, s: int) -> str:
            return prefix_key(torch.cat([self.head, ids[p:s]]))

        contexts = tuple(context(p, s) for (s, _), p in zip(spans, starts))
        keys = tuple(entry_key(self.fingerprint, tenant, c, ids[s:e]) for (s, e), c in zip(spans, contexts))
        forms = [Form(i, 0, span, key) for i, (span, key) in enumerate(zip(spans, keys))]
        edge, floor, n = self.config.edge_tokens if readings else 0, self.config.segment_min_tokens, len(ids)
        last = {p: i for i, p in enumerate(starts)}  # each paragraph's last segment
        for i, ((s, e), p) in enumerate(zip(spans, starts)):
            ends = e == n or int(ids[e]) in self.segmenter.break_ids  # the segment ends its paragraph
            for lead in range(edge + 1):
                a = max(s, p + lead)  # the segment as this reading of its paragraph has it
                c = contexts[i] if lead == 0 else context(p + lead, a)
                cuts = [(a, e)] if lead else []
                cuts += [(a, e - j) for j in range(1, edge + 1) if ends and last[p] == i]
                forms += [Form(i, lead, (x, y), entry_key(self.fingerprint, tenant, c, ids[x:y]))
                          for x, y in cuts if y - x >= floor]
        return Segments(spans, keys, tuple(starts), contexts, tenant, tuple(forms))

    def detect(self, segments: Segments, n: int, matched: int, stored: Container[str]) -> Detected | None:
        """The stored segments of a prompt of `n` tokens past its first `matched` (held exactly), ending before its
        last token; None when they cover fewer than min_reuse_tokens past it. `stored`: the keys every rank holds.
        Per paragraph, the reading (`Form.lead`) whose stored forms cover the most tokens (the paragraph as it is on
        a tie), and per segment its longest stored form in it."""
        best: dict[tuple[int, int], Form] = {}  # (segment, lead) -> its longest stored form
        for f in segments.forms:
            if f.key in stored and matched < f.span[1] < n:
                kept = best.get((f.segment, f.lead))
                if kept is None or f.span[1] - f.span[0] > kept.span[1] - kept.span[0]:
                    best[f.segment, f.lead] = f
        covered: dict[tuple[int, int], int] = {}  # (paragraph, lead) -> its stored tokens
        for (i, lead), f in best.items():
            at = (segments.paragraphs[i], lead)
            covered[at] = covered.get(at, 0) + f.span[1] - f.span[0]
        reading: dict[int, int] = {}  # paragraph -> the lead read
        for (p, lead), tokens in sorted(covered.items()):  # leads in order: a tie keeps the smaller
            if p not in reading or tokens > covered[p, reading[p]]:
                reading[p] = lead
        picked = sorted((f.span, f.key) for (i, lead), f in best.items() if reading[segments.paragraphs[i]] == lead)
        tokens = sum(e - max(s, matched) for (s, e), _ in picked)
        if tokens < self.config.min_reuse_tokens:
            return None
        return Detected(tuple(span for span, _ in picked), tuple(key for _, key in picked), tokens)

    def to_encode(self, segments: Segments, token_ids: Sequence[int] | torch.Tensor, held: Sequence[bool],
                  crowded: bool = False) -> list[Encode]:
        """The paragraphs of a prompt of `token_ids` (its `segments`) holding a segment that `held` (per segment:
        whether every rank's store holds it) says is missing and, when `crowded`, that was now seen admit_after
        times; one Encode per paragraph, storing those segments. The forward covers the paragraph through its last
        segment whichever of them are missing, so its token ids (and the bits of each segment's KV, which a forward
        of another length may round differently) are a function of the head and the paragraph alone."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        by_paragraph: dict[int, list[int]] = {}
        for i, (key, have) in enumerate(zip(segments.keys, held)):
            if not have and (self._sighted(key) >= self.config.admit_after or not crowded):
                by_paragraph.setdefault(segments.paragraphs[i], []).append(i)
        ends = {p: e for (_, e), p in zip(segments.spans, segments.paragraphs)}  # each paragraph's last segment's end
        out, h = [], len(self.head)
        for p, todo in by_paragraph.items():
            end = ends[p]
            entries = tuple(((h + s - p, h + e - p), segments.keys[i], segments.contexts[i])
                            for i in todo for s, e in [segments.spans[i]])
            out.append(Encode(torch.cat([self.head, ids[p:end]]), entries, segments.tenant))
        return out

    def forget(self) -> None:
        """Drop every sighting (a flush, or a purge: a sighting counts a key, which does not say its tenant)."""
        self._seen.clear()

    def _sighted(self, key: str) -> int:
        n = self._seen.pop(key, 0) + 1
        self._seen[key] = n
        while len(self._seen) > self.config.seen_keys:
            self._seen.popitem(last=False)
        return n
