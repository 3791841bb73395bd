"""One server of the remote tier as the tier sees it (its one endpoint, or one primary of a cluster): a circuit
breaker and the server's own counters.

Contract:
- available() is False for `retry_s` after a failed command: meanwhile the tier sends the server nothing (its gets
  miss, its puts are dropped: `skipped`); then the next command tries again, and retrying() is True until one
  succeeds or fails.
- failed(e) counts an error and (re)opens the breaker; the first failure since the last success starts an outage:
  counted in `outages`, one WARNING. working() ends the outage in progress: one INFO. So the log gets two lines per
  outage whatever the request rate.
- `link` measures the server's round trips for gets (link.py): what the tier predicts a fetch from it costs.
- Thread-safe: the scheduler counts gets while the tier's writer thread counts puts.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from .link import LinkCost, LinkEstimate

log = logging.getLogger("chunkcache.store.remote")  # the tier's one logger, whichever server speaks


@dataclass(frozen=True)
class NodeStats:
    node: str  # host:port
    serving: bool  # a primary of the tier's latest view of the cluster (False: failed over, or left the cluster)
    up: bool  # False while an outage of this node is in progress (its breaker open or retrying)
    hits: int
    misses: int
    errors: int
    outages: int
    skipped: int  # gets and puts not sent because the node was down
    writes: int
    link: LinkEstimate | None = None  # its gets' measured latency and bandwidth; None before two round trips


class Endpoint:
    COUNTERS = ("hits", "misses", "errors", "outages", "skipped", "writes")

    def __init__(self, name: str, retry_s: float, label: str | None = None):
        """`name`: the server in stats; `label`: how log lines call it (default: the name)."""
        self.name = name
        self.label = label or name
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._down_until = 0.0  # time.monotonic() before which the server is not contacted
        self._down_since: float | None = None  # start of the outage in progress
        self._n = dict.fromkeys(self.COUNTERS, 0)
        self.link = LinkCost()

    def available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def retrying(self) -> bool:
        """An outage is in progress and its retry interval has passed: the next command is a retry."""
        with self._lock:
            return self._down_since is not None and time.monotonic() >= self._down_until

    @property
    def up(self) -> bool:
        with self._lock:
            return self._down_since is None

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] += n

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._n)

    def failed(self, e: Exception) -> None:
        with self._lock:
            self._n["errors"] += 1
            self._down_until = time.monotonic() + self.retry_s
            if self._down_since is not None:
                return
            self._down_since = time.monotonic()
            self._n["outages"] += 1
        log.warning("chunkcache: remote store %s unavailable (%s: %s); chunks are computed and kept locally, puts "
                    "dropped, retrying every %.1f s", self.label, type(e).__name__, e, self.retry_s)

    def working(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            seconds, self._down_since = time.monotonic() - self._down_since, None
        log.info("chunkcache: remote store %s is back after %.1f s", self.label, seconds)

    def stats(self, serving: bool) -> NodeStats:
        with self._lock:
            counters, up = dict(self._n), self._down_since is None
        return NodeStats(node=self.name, serving=serving, up=up, **counters, link=self.link.estimate())
