"""Content-defined segments of a token sequence: where an unmarked prompt is cut into reusable pieces.

Contract: a segment's boundaries depend only on the tokens around it, never on its absolute position, so a passage
yields the same segments (the same token ids, hence the same store keys) at any offset and after any text.
  * A token whose text holds a line break is a **hard break**, a segment of its own. RAG templates join retrieved
    documents with "\n\n" or "\n" (LlamaIndex's text QA template, LangChain's stuff-documents prompt), and a BPE
    tokenizer keeps a passage's ids unchanged after a line break (../shared/notes/auto-chunks.md: 550 of 550
    passages), so every document starts a segment exactly; and it ends one exactly whichever break follows it ("\n\n"
    before the next document, "\n" before the template's tail: different tokens), since the break is not part of it.
  * Inside a longer run, a **content-defined cut** follows token i when a hash of the `window` tokens ending at i
    hits 1 in `mean` (`mean` a power of two), at least `min_tokens` after the run's last cut; a run reaching
    `max_tokens` is cut there. `min_tokens >= window`, so a cut's window never reaches back past its run's start
    into whatever preceded the run.
A passage whose first token the tokenizer merges with the text before it (joined by a space, numbered "[1] ...")
loses its first segment only: the cuts after it are content-defined and come back in step.

    >>> seg = Segmenter(break_ids={10}, mean=4, min_tokens=2, max_tokens=6, window=2)
    >>> a = seg.spans([1, 2, 3, 10, 5, 6, 7, 8, 9, 11, 12, 13])
    >>> b = seg.spans([99, 98, 10, 5, 6, 7, 8, 9, 11, 12, 13])  # the run after the break, two tokens earlier
    >>> [(s - 4, e - 4) for s, e in a if s >= 4] == [(s - 3, e - 3) for s, e in b if s >= 3]
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# odd 64-bit multipliers (splitmix64's): the window hash is a polynomial in token ids mod 2^64, then mixed
_MUL = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)


@dataclass(frozen=True)
class Segmenter:
    break_ids: frozenset[int]  # token ids whose text holds a line break: each is a segment alone
    mean: int = 64  # 1 in `mean` window hashes cuts (a power of two): mean distance between content-defined cuts
    min_tokens: int = 16  # a content-defined cut comes at least this many tokens after the run's previous cut
    max_tokens: int = 256  # a run this long without a cut is cut here
    window: int = 8  # tokens hashed per content-defined cut decision

    def __post_init__(self) -> None:
        object.__setattr__(self, "break_ids", frozenset(self.break_ids))
        if self.mean < 1 or self.mean & (self.mean - 1):
            raise ValueError(f"mean must be a power of two, got {self.mean}")
        if not 1 <= self.window <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= window ({self.window}) <= min_tokens ({self.min_tokens}) <= max_tokens "
                             f"({self.max_tokens})")

    def spans(self, token_ids: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
        """Every segment [s, e) of `token_ids`, in order, covering it without gaps."""
        ids = np.asarray(token_ids, dtype=np.int64)
        n = len(ids)
        if n == 0:
            return []
        hard = np.isin(ids, np.fromiter(self.break_ids, dtype=np.int64, count=len(self.break_ids)))
        cut_here = self._content_cuts(ids)
        ends = np.flatnonzero(hard | cut_here) + 1  # candidate segment ends, exclusive
        out, start, last_cut = [], 0, 0
        for end in ends.tolist():
            if hard[end - 1]:  # the text before the line break, then the break alone
                if start < end - 1:
                    out.extend(self._split(start, end - 1))
                out.append((end - 1, end))
                start = last_cut = end
            elif end - last_cut >= self.min_tokens:
                out.extend(self._split(start, end))
                start = last_cut = end
        if start < n:
            out.extend(self._split(start, n))
        return out

    def _split(self, start: int, end: int) -> Iterable[tuple[int, int]]:
        """[start, end) in pieces of at most max_tokens."""
        for s in range(start, end, self.max_tokens):
            yield s, min(s + self.max_tokens, end)

    def _content_cuts(self, ids: np.ndarray) -> np.ndarray:
        """bool [N]: the hash of the window ending at i hits (False before a whole window)."""
        n, w = len(ids), self.window
        if n < w:
            return np.zeros(n, dtype=bool)
        x = (ids.astype(np.uint64) + np.uint64(1)) * _MUL
        with np.errstate(over="ignore"):
            h = np.zeros(n - w + 1, dtype=np.uint64)
            for j in range(w):  # h[i] = sum_j x[i + j] * MUL^(w - j): order-sensitive, mod 2^64
                h = (h + x[j: n - w + 1 + j]) * _MUL
            h ^= h >> np.uint64(31)
            h *= _MIX
            h ^= h >> np.uint64(29)
        hits = (h >> np.uint64(40)) & np.uint64(self.mean - 1) == 0
        return np.concatenate([np.zeros(w - 1, dtype=bool), hits])


def break_ids(texts: Sequence[str], marker: str = "\n") -> frozenset[int]:
    """The ids whose text holds `marker`; `texts[i]` is token i's text."""
    return frozenset(i for i, text in enumerate(texts) if marker in text)
