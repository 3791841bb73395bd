"""What fetching from one remote server costs, measured on the requests' own fetches.

Contract:
- observe(bytes, seconds) records one round trip to the server (one MGET, or one cluster node's pipeline): the bytes
  its replies carried and the wall time from send to the last reply.
- estimate() is the link's latency and bandwidth (a round trip carrying b bytes: latency + b / bandwidth), fitted
  over the last WINDOW round trips by Theil-Sen (the median of the pairwise slopes, then the median intercept): a
  round trip held up by a busy host or a preempted thread moves neither, where a least-squares fit would follow it.
  None until MIN_SAMPLES were observed, or while every round trip carried nothing (misses): the caller then fetches,
  which measures. Round trips all of one size leave the two undetermined: then all of the cost is charged per byte
  (latency 0), the larger prediction for a larger fetch.
- age() is the seconds since the last observation (inf before any): a link judged too slow is fetched from no more,
  so the caller probes it again now and then (probing(), then the round trip); a probe far faster than the fit
  restarts the window from itself, and the caller, the link unmeasured again, fetches, which measures it anew.
- Thread-safe: the scheduler and the tier's node threads observe at once.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkEstimate:
    latency_s: float  # a round trip's fixed cost
    bytes_per_s: float  # its cost per byte carried, as a rate
    samples: int


class LinkCost:
    WINDOW = 8  # round trips: a link that degrades is followed after ~5 (the median), one stall is ignored
    # a probe this many times faster than the fit restarts the window (a link that got faster); a slow link's probes
    # scatter about 2x around a fit of whole requests' fetches (bench: 4 MB/s), so that must not restart it
    PROBE_MISS = 4.0
    MIN_SAMPLES = 2

    def __init__(self):
        self._lock = threading.Lock()
        self._samples: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)
        self._last = -math.inf
        self._probe = False

    def probing(self) -> None:
        """The next round trip is a probe of a link judged too slow: if it is more than PROBE_MISS times faster than
        the fit predicts, the link changed, and the window restarts from it."""
        with self._lock:
            self._probe = True

    def observe(self, nbytes: int, seconds: float) -> None:
        est = self.estimate() if self._probe else None
        with self._lock:
            if est is not None:
                predicted = est.latency_s + nbytes / est.bytes_per_s
                if seconds * self.PROBE_MISS < predicted:
                    self._samples.clear()
            self._probe = False
            self._samples.append((nbytes, max(seconds, 0.0)))
            self._last = time.monotonic()

    def age(self) -> float:
        with self._lock:
            return time.monotonic() - self._last

    def estimate(self) -> LinkEstimate | None:
        with self._lock:
            samples = list(self._samples)
        if len(samples) < self.MIN_SAMPLES or not any(b for b, _ in samples):  # misses alone: no bandwidth
            return None
        slopes = [(t2 - t1) / (b2 - b1) for i, (b1, t1) in enumerate(samples) for b2, t2 in samples[i + 1:]
                  if b2 != b1]
        per_byte = statistics.median(slopes) if slopes else 0.0
        latency = statistics.median(t - per_byte * b for b, t in samples)
        if per_byte <= 0 or latency < 0:  # sizes too alike (or noise) to tell latency from bandwidth
            per_byte = statistics.median(t for _, t in samples) / max(statistics.median(b for b, _ in samples), 1.0)
            latency = 0.0
        return LinkEstimate(latency, 1.0 / per_byte if per_byte > 0 else math.inf, len(samples))


def worth_fetching(link: LinkCost, chunks: list[tuple[str, int, float]], probe_s: float) -> tuple[list[str], bool]:
    """Which of `chunks` ((key, its bytes, seconds to compute it here)), all held by the server behind `link`, to
    fetch from it rather than compute, and whether that fetch is a probe. Every chunk whose bytes arrive faster than it
    computes is a candidate; the candidates are fetched together when their one round trip (latency included) is
    predicted faster than computing them all. An unmeasured link is fetched from (that measures it); from a link judged
    too slow the smallest chunk is fetched anyway, as a probe, once its last measurement is `probe_s` old."""
    est = link.estimate()
    if est is None:
        return [key for key, _, _ in chunks], False
    faster = [(key, size, compute) for key, size, compute in chunks if size / est.bytes_per_s < compute]
    fetch_s = est.latency_s + sum(size for _, size, _ in faster) / est.bytes_per_s
    if faster and fetch_s < sum(compute for _, _, compute in faster):
        return [key for key, _, _ in faster], False
    if link.age() >= probe_s:
        link.probing()
        return [min(chunks, key=lambda c: c[1])[0]], True
    return [], False
