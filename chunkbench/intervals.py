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
