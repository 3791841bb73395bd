"""Query overlap: the context sentences that hold the query's rarest words, recomputed whole.

Why: on real passages a blend answers with another needle's value far more often than full recompute does
(multikey in MuSiQue paragraphs, `synthetic:realkey`): the key the query names sits in one sentence next to its
value, and a top-K pick by attention takes pieces of every needle-like sentence, so no sentence's key and value are
recomputed together. A word of the query that occurs in few context tokens names what the answer is about; its
sentences are where the binding between the query and the answer lives.

Weight of a query token id: 1 / (its occurrences among the context tokens) when it occurs there and its text has a
letter or digit (punctuation and template tokens are never words). A rare id occurs at most RARE times. The sentences
holding a rare id are taken whole, by score (the sum of the weights of the distinct query ids a sentence holds), best
first, while they fit in the share of the budget given to them; the selector spends the rest by its own score.
"""

from __future__ import annotations

import re
from collections import Counter

import torch

from .base import Layout
from .budget import rank

RARE = 2  # a query word this rare in the context names what the question is about (a needle's key occurs once)
_SENTENCE_END = re.compile(r"[.!?](?=\s)|\n")
_WORD = re.compile(r"\w")


def check_overlap(share: float) -> None:
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"overlap must be a share of the budget in [0, 1], got {share}")


def sentence_ids(text: str, offsets: list[tuple[int, int]]) -> torch.Tensor:
    """[N] int64: per token, the index of the sentence its first character falls in."""
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    starts = torch.tensor([s for s, _ in offsets], dtype=torch.long)
    return torch.bucketize(starts, torch.tensor(ends, dtype=torch.long), right=True)


def pick(layout: Layout, text: str, offsets: list[tuple[int, int]], room: int) -> torch.Tensor:
    """Bool [N]: context tokens of the best query-overlap sentences, at most `room` of them."""
    ids, ctx = layout.token_ids, layout.context_mask()
    chosen = torch.zeros(layout.n, dtype=torch.bool)
    if room <= 0:
        return chosen
    q0, q1 = layout.query_span
    words = {int(ids[i]) for i in range(q0, q1) if _wordlike(text, offsets[i])}
    # the context tokens holding a query word (only those are read: the prompt's other tokens never score)
    held_at = [i for i in (ctx & torch.isin(ids, torch.tensor(sorted(words), dtype=ids.dtype))).nonzero().flatten()
               .tolist() if _wordlike(text, offsets[i])]
    if not held_at:
        return chosen
    sent = sentence_ids(text, offsets)
    held_ids, held_sents = ids[held_at].tolist(), sent[held_at].tolist()
    weights = {t: 1.0 / c for t, c in Counter(held_ids).items()}
    held: dict[int, set[int]] = {}  # sentence -> the distinct query ids it holds
    for t, s in zip(held_ids, held_sents):
        held.setdefault(s, set()).add(t)
    scores = {s: sum(weights[t] for t in ts) for s, ts in held.items() if max(weights[t] for t in ts) >= 1 / RARE}
    for s in sorted(scores, key=lambda s: (-scores[s], s)):  # ties: the earlier sentence
        members = ctx & (sent == s)
        size = int(members.sum())
        if size <= room:
            chosen |= members
            room -= size
    return chosen


def _wordlike(text: str, offset: tuple[int, int]) -> bool:
    """A token whose text has a letter or digit (punctuation and template tokens are never words)."""
    return _WORD.search(text, *offset) is not None


def top_k(layout: Layout, scores: torch.Tensor, k: int, text: str, offsets: list[tuple[int, int]],
          share: float) -> torch.Tensor:
    """Indices of k context tokens: the overlap sentences within `share` of k, then the best-scored others."""
    first = pick(layout, text, offsets, int(share * k))
    rest = rank(scores, layout.context_mask() & ~first)[: k - int(first.sum())]
    return torch.cat([first.nonzero().flatten(), rest])
