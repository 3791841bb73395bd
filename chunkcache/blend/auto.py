"""Chunks for prompts nobody marked: a prompt's content-defined segments (chunkcache.segment), the stored ones
turned into a chunk hint, and the policy that decides which segments a prefill teaches the store.

Contract:
- A segment's key is its token ids' content key (hashing.chunk_key with the AUTO_PREFIX field instead of a shared
  prefix's digest) with the model, the namespace and the request's `cache_salt`: no tenant finds another's segments,
  and an auto segment never answers for a hinted chunk (whose KV was computed standalone after a known prefix) or
  the other way round. Its entry's KV is what some earlier prefill computed for those tokens in its own context, at
  the positions they had there (`start_pos`): the same kind of deviation a hinted chunk has after other chunks,
  which the selector repairs.
- `detect` is pure given the store's answer: the segments the store holds past the exact prefix, and before the
  prompt's last token (whole, or else trimmed at a paragraph's edge: `Segments.edges`), become the hint's chunks
  when they add up to `min_reuse_tokens`; otherwise None and the
  request is served as stock. The first `exact_lead_tokens` from the first such segment's start are the lead
  (`Detected.exact_until`): the engine computes them after the exact prefix, and a segment the lead ends inside is
  reused from there on (its head is computed). The first text after a prompt's prefix is where a segment's KV,
  learned after other text, deviates most from what this prompt gives it. A first segment learned within its own
  prompt's first `exact_lead_tokens` (a passage ingested, sent alone or leading an earlier prompt) saw no more text
  before it than the lead would compute, a template's head and no other passage: it is reused from its first token,
  as a hinted chunk computed after the prefix is; such a form (whole or trimmed) of the first segment is preferred to
  one learned deeper.
- `to_learn` names the segments a finished prefill computed in this prompt's own context that no tier holds; when the
  store is `crowded` (learning would evict), only those seen in `admit_after` prefills (sightings are counted always,
  for the `seen_keys` most recent keys). The engine copies their KV out of its pool into entries.
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


@dataclass(frozen=True)
class Segments:
    """One prompt's segments that may be reused: at least the segmenter's minimum length. `edges[i]`: segment i's
    trimmed forms (span, key), tried in order when the whole segment is not stored: a segment that starts a
    paragraph without up to `edge_tokens` of its first tokens, one that ends a paragraph without up to that many of
    its last (a passage stored bare, wrapped here by a template on its own line); never learned, only looked up."""

    spans: tuple[tuple[int, int], ...]
    keys: tuple[str, ...]
    edges: tuple[tuple[tuple[tuple[int, int], str], ...], ...] = ()

    def lookup_keys(self, matched: int) -> list[tuple[int, str]]:
        """(tokens, key) of every form worth asking the store for: the segments, and their trimmed forms, that start
        at or after `matched`."""
        forms = [((s, e), k) for (s, e), k in zip(self.spans, self.keys)]
        forms += [form for trimmed in self.edges for form in trimmed]
        return [(e - s, k) for (s, e), k in forms if s >= matched]


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
        key = lambda s, e: chunk_key(self.fingerprint, namespace, AUTO_PREFIX, ids[s:e], cache_salt)  # noqa: E731
        trimmed = tuple(tuple(((s, e), key(s, e)) for s, e in self._trimmed(ids, span)) for span in spans) if edges \
            else ()
        return Segments(spans, tuple(key(s, e) for s, e in spans), trimmed)

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
        fits = lambda form: form[0][0] >= matched and form[0][1] < n  # noqa: E731
        stored = [forms for forms in (_stored_forms(segments, i, learned_at) for i in range(len(segments.spans)))
                  if forms and fits(forms[0])]
        picked = [forms[0] for forms in stored]
        lead = self.config.exact_lead_tokens
        if stored:  # a form of the first segment learned in its prompt's head (no other passage before it): no lead
            head = next((f for f in stored[0] if fits(f) and learned_at[f[1]] < lead), None)
            if head is not None:
                picked[0], lead = head, 0
        lead_end = picked[0][0][0] + lead if picked else matched
        picked = [(span, key) for span, key in picked if span[1] > lead_end]
        tokens = sum(e - max(s, lead_end) for (s, e), _ in picked)
        if tokens < self.config.min_reuse_tokens:
            return None
        return Detected(tuple(span for span, _ in picked), tuple(key for _, key in picked), tokens, lead_end)

    def to_learn(self, segments: Segments, computed: torch.Tensor, stored,
                 crowded: bool = False) -> list[tuple[tuple[int, int], str]]:
        """(span, key) of each segment whose every token `computed` (bool [N]) marks as computed in this prompt's
        context and that `stored` (a container of keys) lacks; when `crowded`, only those now seen admit_after
        times."""
        out = []
        for span, key in zip(segments.spans, segments.keys):
            if key in stored or not bool(computed[span[0]: span[1]].all()):
                continue
            if self._sighted(key) >= self.config.admit_after or not crowded:
                out.append((span, key))
        return out

    def _sighted(self, key: str) -> int:
        n = self._seen.pop(key, 0) + 1
        self._seen[key] = n
        while len(self._seen) > self.config.seen_keys:
            self._seen.popitem(last=False)
        return n


def _stored_forms(segments: Segments, i: int, stored) -> list[tuple[tuple[int, int], str]]:
    """Segment i's stored forms (span, key): whole first, then its trimmed ones in order."""
    forms = [(segments.spans[i], segments.keys[i]), *(segments.edges[i] if segments.edges else ())]
    return [(span, key) for span, key in forms if key in stored]
