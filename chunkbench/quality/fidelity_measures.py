"""Fidelity of a blended prefill to full recompute, in measures that degrade gracefully where exact-text agreement
collapses (a weak model's reply changes wholesale at one flipped token):

* teacher-forced agreement: full recompute's greedy answer fed after the blended prompt; the share of its positions
  where the blended model's argmax is full's token;
* KL(full || blended) of the first answer token's distribution, in nats. The reference path has both logit vectors
  (exact); a server returns top-k logprobs, so there it is computed over full's top-k tokens plus one bucket for the
  rest of the vocabulary: merging outcomes never increases a KL divergence, so this is a lower bound of the exact
  value, equal to it when the top-k hold all the mass.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

# probabilities are clamped here before a log: a bucket the server rounds to zero must not make the KL infinite
_FLOOR = 1e-12


def agreement(predicted: Sequence[int], continuation: Sequence[int]) -> float:
    """Share of positions t where `predicted[t]` (the argmax after the prompt and continuation[:t]) is
    `continuation[t]`."""
    if len(predicted) != len(continuation):
        raise ValueError(f"{len(predicted)} predictions for a continuation of {len(continuation)} tokens")
    if not continuation:
        raise ValueError("an empty continuation has no positions to agree on")
    return sum(p == c for p, c in zip(predicted, continuation)) / len(continuation)


def kl_top(full: Mapping[int, float], blended: Mapping[int, float]) -> float:
    """KL(full || blended) over full's top-k tokens plus the remainder bucket. `full`: token id -> logprob of full's
    top-k; `blended`: the blended distribution's logprob of each of those ids."""
    missing = set(full) - set(blended)
    if missing:
        raise ValueError(f"the blended logprobs lack full's top-k tokens {sorted(missing)[:5]}")
    kl = sum(math.exp(lp) * (lp - blended[t]) for t, lp in full.items())
    rest_full = 1.0 - sum(math.exp(lp) for lp in full.values())
    rest_blended = 1.0 - sum(math.exp(blended[t]) for t in full)
    if rest_full > _FLOOR:
        kl += rest_full * (math.log(rest_full) - math.log(max(rest_blended, _FLOOR)))
    # the terms are exact only up to the logprobs' rounding: a KL of identical distributions may come out -1e-9
    return max(kl, 0.0)
