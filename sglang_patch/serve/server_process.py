"""One server subprocess's life, for the CLI (`chunkcache serve`), the benchmark harness (chunkbench), the example
cluster and the tests.

Contract:
- `free_port()`: a loopback TCP port free at the time of the call, outside the range client sockets take theirs from.
- `ServerProcess(argv, url=..., log_path=..., env=..., cwd=..., own_session=True, detach=False)` starts `argv` at
  once. With `log_path` its stdout and stderr go to that file (truncated) and stdin is /dev/null; without one it
  inherits all three from the caller. `env` adds to (does not replace) this process's environment.
- `own_session=True` (the default): the server leads a session and process group of its own, so `stop()` reaches
  every process it forks (SGLang's scheduler and detokenizer) and a terminal's Ctrl-C does not. `own_session=False`
  keeps it in the caller's group (`chunkcache serve` does this, so that a group stop of the CLI reaches SGLang);
  signals then go to the process alone.
- `detach=True` (implies its own session): started through a short-lived intermediate process, so the server is
  not a descendant of the caller: a caller that kills all its own descendants (`sgl.Engine.shutdown()`, in the
  tests) does not reach it. Only its pid is known; `wait()` is not available.
- `alive()`: False once the server process has exited; a zombie counts as dead (a detached server is reparented,
  and in a container whose init does not reap it may linger as one).
- `wait_healthy(timeout)`: returns once `url` + "/health" answers 200; a server that exits first (RuntimeError
  with the log's tail) or is not healthy within `timeout` s (TimeoutError), or a Ctrl-C meanwhile, is stopped
  before the exception propagates. The module function `wait_healthy(url, alive, log_path, timeout)` is the same
  poll without the stop.
- `stop(grace)`: SIGTERM to the group (or the process), up to `grace` s for every process of it to exit, then
  SIGKILL to whatever is left, up to 10 s more; returns at once when nothing is running. Idempotent. A context
  manager's exit stops it too.
- `terminate()` sends SIGTERM and returns (for signal handlers); `wait()` is a non-detached server's exit status;
  `log()` is its log file's text ("" without one).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import requests

# The intermediate of a detached start: it starts the server in a new session, prints its pid and exits, so the
# server is reparented away from the caller.
_DETACH = ("import subprocess, sys; "
           "p = subprocess.Popen(sys.argv[1:], start_new_session=True, "
           "stdin=subprocess.DEVNULL, stdout=sys.stdout, stderr=subprocess.STDOUT); print(p.pid, file=sys.stderr)")


# Where free_port looks: below the kernel's ephemeral range (32768 and up by default), from which every client
# socket takes its local port (a server that binds a minute after the check would otherwise race the connections
# made meanwhile: a test cluster's worker lost its port to one), and below SGLang's own pick for a port its
# scheduler binds later (22000-29999, get_free_port_below_ephemeral).
PORTS = range(10000, 22000)


def free_port() -> int:
    for port in random.sample(PORTS, 64):
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
    with socket.socket() as s:  # the range is crowded: any port the kernel hands out
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """A port p with p .. p+n-1 all free (examples/cluster.py's router and its servers)."""
    for _ in range(100):
        base = free_port()
        if base + n > 65535:
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no run of {n} free ports")


def wait_healthy(url: str, alive: Callable[[], bool], log_path: Path | None = None, timeout: float = 900, *,
                 path: str = "/health", ready: Callable[[requests.Response], bool] | None = None,
                 interval: float = 1.0) -> None:
    """Poll `url` + `path` until it answers 200 (and `ready(response)`, when given, is true); RuntimeError (with the
    log's tail) if `alive()` turns False first, TimeoutError after `timeout` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not alive():
            tail = f"; log {log_path}:\n{Path(log_path).read_text(errors='replace')[-3000:]}" if log_path else ""
            raise RuntimeError(f"server {url} exited{tail}")
        try:
            r = requests.get(url + path, timeout=5)
            if r.status_code == 200 and (ready is None or ready(r)):
                return
        except (requests.RequestException, ValueError, KeyError):  # ValueError, KeyError: from `ready`
            pass
        time.sleep(interval)
    raise TimeoutError(f"server {url} not healthy after {timeout:.0f} s" + (f"; log {log_path}" if log_path else ""))


class ServerProcess:
    """A server subprocess: started in its own session (or detached), health-checked, stopped as a group."""

    def __init__(self, argv: list[str], *, url: str | None = None, log_path: Path | None = None,
                 env: dict | None = None, cwd: str | Path | None = None, own_session: bool = True,
                 detach: bool = False):
        if detach and not own_session:
            raise ValueError("a detached server always has its own session")
        self.argv = [str(a) for a in argv]
        self.url = url
        self.log_path = Path(log_path) if log_path is not None else None
        self.own_session = own_session
        self.proc: subprocess.Popen | None = None  # None when detached
        full_env = {**os.environ, **env} if env else None
        log = open(self.log_path, "w") if self.log_path is not None else None
        try:
            if detach:
                launcher = subprocess.run([sys.executable, "-c", _DETACH, *self.argv], stdout=log,
                                          stderr=subprocess.PIPE, text=True, check=True, env=full_env, cwd=cwd)
                self.pid = int(launcher.stderr.strip().splitlines()[-1])
            else:
                redirect = {} if log is None else {"stdin": subprocess.DEVNULL, "stdout": log,
                                                   "stderr": subprocess.STDOUT}
                self.proc = subprocess.Popen(self.argv, start_new_session=own_session, env=full_env, cwd=cwd,
                                             **redirect)
                self.pid = self.proc.pid
        finally:
            if log is not None:
                log.close()

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None  # reaps it once it exited
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def wait_healthy(self, timeout: float = 900, **kwargs) -> "ServerProcess":
        try:
            wait_healthy(self.url, self.alive, self.log_path, timeout, **kwargs)
        except BaseException:
            self.stop()
            raise
        return self

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        if self.proc is None:
            raise RuntimeError("a detached server's exit status is its init's")
        return self.proc.wait(timeout)

    def stop(self, grace: float = 60) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
            if not self._running() or not self._signal(sig):
                return
            deadline = time.time() + wait
            while self._running() and time.time() < deadline:
                time.sleep(0.25)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path is not None else ""

    def _signal(self, sig: int) -> bool:
        """Send `sig` to the group (or the process); False when there was nothing to send it to."""
        try:
            if self.own_session:
                os.killpg(self.pid, sig)
            elif self.proc.poll() is None:
                self.proc.send_signal(sig)
            else:
                return False
        except ProcessLookupError:
            return False
        return True

    def _running(self) -> bool:
        """Whether any process of the server (its group, with its own session) is running, zombies not counted."""
        if self.alive():
            return True
        if not self.own_session:
            return False
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        for p in psutil.process_iter(["status"]):  # the leader is gone: did something of its group outlive it?
            try:
                if os.getpgid(p.pid) == self.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    return True
            except OSError:
                pass
        return False

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def chunkcache_serve(*args: str, log_path: Path | None = None, timeout: float = 900, **kwargs) -> ServerProcess:
    """`chunkcache serve --port FREE *args` on 127.0.0.1 (`python -m sglang_patch.serve.cli`, this interpreter),
    healthy; `kwargs` go to `ServerProcess`. A server that does not come up is stopped and the error raised."""
    port = free_port()
    argv = [sys.executable, "-m", "sglang_patch.serve.cli", "serve", "--port", str(port), *args]
    server = ServerProcess(argv, url=f"http://127.0.0.1:{port}", log_path=log_path, **kwargs)
    return server.wait_healthy(timeout)
