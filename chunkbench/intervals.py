"""Confidence intervals of a mean over cases: a seeded percentile bootstrap (scipy.stats.bootstrap), so the same
values always give the same interval and a resumed sweep prints the table an uninterrupted one would.

Percentile rather than scipy's default BCa: BCa is undefined on a degenerate bootstrap distribution, and columns that
are constant or nearly so (full recompute's agreement with itself, a selector that never misses) are common here.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
RESAMPLES = 9999
SEED = 0


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                  seed: int = SEED) -> tuple[float, float]:
    """(low, high) of the two-sided `confidence` interval of the mean; NaN for no values."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return math.nan, math.nan
    if np.all(data == data[0]):
        # every resample is the constant itself (scipy would only warn that the distribution is degenerate)
        return float(data[0]), float(data[0])
    result = stats.bootstrap((data,), np.mean, n_resamples=resamples, confidence_level=confidence,
                             method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def wilson(hits: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """(low, high) of the Wilson score interval of a proportion `hits` / `n`; NaN for n = 0. Unlike the bootstrap
    it stays informative at 0 or n hits (a share that must stay under a bound, observed never exceeded)."""
    if n == 0:
        return math.nan, math.nan
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # exactly 0 (1) at no (every) hit, where the formula leaves rounding
    return (0.0 if hits == 0 else centre - half), (1.0 if hits == n else centre + half)
