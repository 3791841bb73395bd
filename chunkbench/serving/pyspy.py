"""A profiling switch for the benches: py-spy (an SGLang dependency) samples the server's scheduler process while the
measured requests run, and the most expensive functions are printed (inclusive seconds, the share of samples).

    with sampled(pid, "profile.txt"):
        ... requests ...
    print_top("profile.txt")
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

RATE = 100  # samples per second


@contextmanager
def sampled(pid: int, out: str | Path):
    """py-spy's collapsed stacks of process `pid` (and its threads) into `out` while the block runs."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    proc = subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", str(RATE), "--format", "raw", "--output",
                             str(out), "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if proc.returncode not in (0, -signal.SIGINT) and not Path(out).exists():
            raise RuntimeError(f"py-spy failed ({proc.returncode}): {err.decode()[-400:]}")


def top(path: str | Path, n: int = 30, keep: tuple[str, ...] = ("chunkcache", "sglang_patch", "torch")) -> list:
    """(function, inclusive seconds, share of busy samples) of the `n` costliest frames whose file path contains one
    of `keep`; idle samples (the scheduler waiting on its sockets) are left out of the shares."""
    inclusive: collections.Counter = collections.Counter()
    busy = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or "recv_requests" in stack or "_poll" in stack or "select.poll" in stack:
            continue
        busy += int(count)
        for frame in set(stack.split(";")):
            if any(k in frame for k in keep):
                inclusive[frame] += int(count)
    return [(frame, c / RATE, c / max(busy, 1)) for frame, c in inclusive.most_common(n)]


def print_top(path: str | Path, n: int = 30) -> None:
    print(f"\nprofile of the scheduler during the measured blended requests ({path}): inclusive s, share of busy")
    for frame, seconds, share in top(path, n):
        print(f"{seconds:9.2f} {100 * share:6.1f} %  {frame}")
