"""Chunks for prompts nobody marked: a prompt's content-defined segments (chunkcache.segment), the stored ones
turned into a chunk hint, and the policy that decides which segments a prefill teaches the store.

Contract:
- A segment's key is its token ids' content key (hashing.chunk_key with the AUTO_PREFIX field instead of a shared
  prefix's digest) with the model, the namespace and the request's `cache_salt`: no tenant finds another's segments,
  and an auto segment never answers for a hinted chunk (whose KV was computed standalone after a known prefix) or
  the other way round. Its entry's KV is what some earlier prefill computed for those tokens in its own context, at
  the positions they had there (`start_pos`): the same kind of deviation a hinted chunk has after other chunks,
  which the selector repairs.
- `detect` is pure given the store's answer: the segments the store holds that end past the exact prefix and before
  the prompt's last token (whole, or else trimmed at a paragraph's edge: `Segments.edges`), become the hint's chunks
  when they add up to `min_reuse_tokens`; otherwise None and the request is served as stock. The first
  `exact_lead_tokens` from the first such segment's start are the lead (`Detected.exact_until`): the engine computes
  them after the exact prefix, and a segment the lead ends inside is reused from there on (its head is computed). The
  first text after a prompt's head is where a segment's KV, learned after other text, deviates most from what this
  prompt gives it. A first segment learned within its own prompt's first `exact_lead_tokens` (a passage ingested, sent
  alone or leading an earlier prompt) saw no more text before it than the lead would compute, a template's head and no
  other passage: it is reused from its first token, as a hinted chunk computed after the prefix is; such a form
  (whole, trimmed or its head form) of the first segment is preferred to one learned deeper; and a later segment
  learned in its prompt's head that starts before the lead would end ends the lead at its start. A first segment whose
  reuse starts at or past position `exact_lead_tokens` (the exact prefix holds a passage before it, as the radix tree
  does for prompts that begin alike) is not in the head either: it follows other text here as it did where it was
  learned, so it gets no lead, and when the exact prefix reaches into it, it is reused from the prefix's end (with a
  lead due there, it is not reused: the lead starts at the next).
- `to_learn` names the segments a finished prefill computed in this prompt's own context that no tier holds; when the
  store is `crowded` (learning would evict), only those seen in `admit_after` prefills (sightings are counted always,
  for the `seen_keys` most recent keys). A stored segment that starts in the prompt's head (its first
  `exact_lead_tokens`) and that the prefill computed exactly there (in a lead, or in a prompt served as stock) is
  learned again under its head key (`Segments.heads`): a passage that led a prompt once needs no lead when it leads
  again, while its deep copy keeps serving it deep. The engine copies their KV out of its pool into entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..config import AutoConfig
from ..hashing import chunk_key
from ..segment import Segmenter

AUTO_PREFIX = "auto-segment"  # never a prefix_key digest (those are 32 hex digits)
HEAD_PREFIX = "auto-segment-head"  # the same tokens' KV as learned in a prompt's head (Segments.heads)


@dataclass(frozen=True)
class Segments:
    """One prompt's segments that may be reused: at least the segmenter's minimum length. `edges[i]`: segment i's
    trimmed forms (span, key), tried in order when the whole segment is not stored: a segment that starts a
    paragraph without up to `edge_tokens` of its first tokens, one that ends a paragraph without up to that many of
    its last (a passage stored bare, wrapped here by a template on its own line); never learned, only looked up."""

    spans: tuple[tuple[int, int], ...]
    keys: tuple[str, ...]
    edges: tuple[tuple[tuple[tuple[int, int], str], ...], ...] = ()
    # segment i's head key where it starts within the prompt's first exact_lead_tokens, else None: its KV as computed
    # there, stored beside a copy learned deeper (which serves a segment used deep better), so that a passage that
    # led a prompt, its lead computed exactly, is reused from its first token when it leads again
    heads: tuple[str | None, ...] = ()
    # segment i's head key where it starts a paragraph at or past the prompt's first exact_lead_tokens (a passage
    # after the first), else None: the key of the head form an idle server computes for it (AutoChunks.head_forms)
    deep_heads: tuple[str | None, ...] = ()

    def lookup_keys(self, matched: int) -> list[tuple[int, str]]:
        """(tokens, key) of every form worth asking the store for: the segments, their trimmed forms and their head
        forms, that end past `matched` (one the exact prefix reaches into may be reused from there on)."""
        forms = [((s, e), k) for (s, e), k in zip(self.spans, self.keys)]
        forms += [form for trimmed in self.edges for form in trimmed]
        forms += [(span, k) for span, k in zip(self.spans, self.heads) if k is not None]
        return [(e - s, k) for (s, e), k in forms if e > matched]


@dataclass(frozen=True)
class HeadForm:
    """A segment that starts a paragraph deep in a prompt (a passage after its first), computed again right after
    that prompt's head as if it led the prompt: the KV a lead would compute there, which, stored under the segment's
    head key, spares the passage a lead when it leads a later prompt (an idle server's work: `auto.idle_head_forms`)."""

    token_ids: torch.Tensor  # [head + T] int64: the prompt's head, then the segment
    start: int  # the head's length: where the segment starts in token_ids (its entry's start_pos)
    key: str  # the segment's head key
    deep_key: str  # its key as learned deep: a head form is computed only while the store holds that


@dataclass(frozen=True)
class Detected:
    spans: tuple[tuple[int, int], ...]  # stored segments past the exact prefix (a hint's chunks), whole
    keys: tuple[str, ...]
    tokens: int  # tokens they cover from exact_until on (what the blend reuses)
    exact_until: int  # the lead's end: tokens before it are computed, the first span's head included


class AutoChunks:
    def __init__(self, config: AutoConfig, break_ids: frozenset[int], fingerprint: str):
        self.config, self.fingerprint = config, fingerprint
        self.segmenter = Segmenter(break_ids, mean=config.segment_mean_tokens, min_tokens=config.segment_min_tokens,
                                   max_tokens=config.segment_max_tokens)
        self._seen: OrderedDict[str, int] = OrderedDict()  # sightings per key, least recent first

    def segments(self, token_ids: Sequence[int], namespace: str, cache_salt: str | None,
                 edges: bool = True) -> Segments:
        """`edges`: with the trimmed forms detection looks up (a prompt that only teaches the store, a hinted one,
        needs none)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        spans = tuple((s, e) for s, e in self.segmenter.spans(ids.numpy())
                      if e - s >= self.config.segment_min_tokens)

        def key(s: int, e: int, kind: str = AUTO_PREFIX) -> str:
            return chunk_key(self.fingerprint, namespace, kind, ids[s:e], cache_salt)

        trimmed = tuple(tuple(((s, e), key(s, e)) for s, e in self._trimmed(ids, span)) for span in spans) if edges \
            else ()
        lead, breaks = self.config.exact_lead_tokens, self.segmenter.break_ids
        heads = tuple(key(s, e, HEAD_PREFIX) if s < lead else None for s, e in spans)
        deep = tuple(key(s, e, HEAD_PREFIX) if s >= lead and int(ids[s - 1]) in breaks else None for s, e in spans) \
            if self.config.idle_head_forms else ()
        return Segments(spans, tuple(key(s, e) for s, e in spans), trimmed, heads, deep)

    def head_forms(self, segments: Segments, token_ids: torch.Tensor) -> list[HeadForm]:
        """The head forms worth computing for a prompt of `token_ids` (its `segments`): each segment that starts a
        paragraph past the prompt's head and ends before its last token, after the prompt's head, the tokens before
        the last paragraph that starts within its first `exact_lead_tokens` (where its passages begin, after the
        template and an instruction). None when no paragraph starts there (a prompt that long before its passages
        gives none of them a lead) or head forms are off."""
        lead, breaks, n = self.config.exact_lead_tokens, self.segmenter.break_ids, len(token_ids)
        starts = [s for s, _ in segments.spans if s < lead and (s == 0 or int(token_ids[s - 1]) in breaks)]
        if not starts or not segments.deep_heads:
            return []
        head = token_ids[: starts[-1]]
        return [HeadForm(torch.cat([head, token_ids[s:e]]), len(head), key, deep)
                for (s, e), key, deep in zip(segments.spans, segments.deep_heads, segments.keys)
                if key is not None and e < n]

    def _trimmed(self, ids: torch.Tensor, span: tuple[int, int]) -> list[tuple[int, int]]:
        """Segment `span`'s trimmed forms: without its first 1..edge_tokens tokens when it starts a paragraph, then
        without its last ones when it ends one; each at least segment_min_tokens long."""
        (s, e), n, floor = span, len(ids), self.config.segment_min_tokens
        breaks = self.segmenter.break_ids
        starts = s == 0 or int(ids[s - 1]) in breaks
        ends = e == n or int(ids[e]) in breaks
        trims = self.config.edge_tokens
        return ([(s + j, e) for j in range(1, trims + 1) if starts and e - s - j >= floor]
                + [(s, e - j) for j in range(1, trims + 1) if ends and e - s - j >= floor])

    def detect(self, segments: Segments, n: int, matched: int, learned_at: Mapping[str, int]) -> Detected | None:
        """The stored segments of a prompt of `n` tokens past its first `matched` (held exactly), ending before its
        last token, less the lead; None when they cover fewer than min_reuse_tokens past it. `learned_at`: the
        stored keys, each with the position its KV was learned at (its entry's start_pos)."""
        fits = lambda form: matched < form[0][1] < n  # noqa: E731
        lead = self.config.exact_lead_tokens

        def head_learned(forms):
            """A segment's form learned in its prompt's head (no other passage before it there), or None."""
            return next((f for f in forms if fits(f) and learned_at[f[1]] < lead), None)

        def leadless(forms):
            """The form of a first stored segment reused with no lead, or None: one learned in its prompt's head, or
            any when its reuse starts at or past `lead` into this prompt (the exact prefix holds a passage before it:
            it follows other text here too)."""
            head = head_learned(forms)
            return forms[0] if head is None and max(forms[0][0][0], matched) >= lead else head

        stored = [forms for forms in (_stored_forms(segments, i, learned_at) for i in range(len(segments.spans)))
                  if forms and fits(forms[0])]
        straddles = bool(stored) and stored[0][0][0][0] < matched  # the first form's span starts inside the prefix
        if straddles and leadless(stored[0]) is None:
            stored = stored[1:]  # the exact prefix reaches into it and so would the lead: the lead starts at the next
        first = leadless(stored[0]) if stored else None
        if stored and first is None:
            # a head-learned segment inside the lead ends it at its start: what precedes it is computed, as it would
            # be for that segment leading the prompt (a passage whose first segments were learned deep, its next one
            # in its own prompt's head: a cut its first words shifted, a copy another prompt stored first)
            ends = stored[0][0][0][0] + lead
            for j, forms in enumerate(stored[1:], 1):
                if forms[0][0][0] >= ends:
                    break
                if (head := head_learned(forms)) is not None:
                    stored, first = stored[j:], head
                    break
        picked = [forms[0] for forms in stored]
        if first is not None:
            picked[0], lead = first, 0
        lead_end = max(picked[0][0][0] + lead, matched) if picked else matched
        picked = [(span, key) for span, key in picked if span[1] > lead_end]
        tokens = sum(e - max(s, lead_end) for (s, e), _ in picked)
        if tokens < self.config.min_reuse_tokens:
            return None
        return Detected(tuple(span for span, _ in picked), tuple(key for _, key in picked), tokens, lead_end)

    def to_learn(self, segments: Segments, computed: torch.Tensor, stored, crowded: bool = False,
                 exact: int = 0) -> list[tuple[tuple[int, int], str]]:
        """(span, key) of each segment whose every token `computed` (bool [N]) marks as computed in this prompt's
        context and that `stored` (a container of keys) lacks; when `crowded`, only those now seen admit_after
        times. A segment in the prompt's head that `stored` holds (possibly learned deeper: membership does not say
        where) goes in under its head key when it lies within the first `exact` tokens, which this prefill computed
        exactly in the prompt's own context (a lead, a prompt served as stock)."""
        out = []
        for span, key, head in zip(segments.spans, segments.keys, segments.heads or [None] * len(segments.spans)):
            if not bool(computed[span[0]: span[1]].all()):
                continue
            if key in stored:
                key = head if head is not None and span[1] <= exact and head not in stored else None
            if key is not None and (self._sighted(key) >= self.config.admit_after or not crowded):
                out.append((span, key))
        return out

    def _sighted(self, key: str) -> int:
        n = self._seen.pop(key, 0) + 1
        self._seen[key] = n
        while len(self._seen) > self.config.seen_keys:
            self._seen.popitem(last=False)
        return n


def _stored_forms(segments: Segments, i: int, stored) -> list[tuple[tuple[int, int], str]]:
    """Segment i's stored forms (span, key): whole first, then its trimmed ones in order, then its head form."""
    forms = [(segments.spans[i], segments.keys[i]), *(segments.edges[i] if segments.edges else ())]
    if segments.heads and segments.heads[i] is not None:
        forms.append((segments.spans[i], segments.heads[i]))
    return [(span, key) for span, key in forms if key in stored]
