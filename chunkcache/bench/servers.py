"""The two A/B servers as `chunkcache serve` subprocesses: started in their own session, stopped as a group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, alive: Callable[[], bool], log_path: Path, timeout: float) -> None:
    """Poll `url`/health until it answers 200; RuntimeError (with the log's tail) if `alive()` turns False first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not alive():
            raise RuntimeError(f"server exited; log {log_path}:\n{log_path.read_text()[-3000:]}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"server not healthy after {timeout:.0f} s; log {log_path}")


class Server:
    """`chunkcache serve` (stock SGLang prefix caching when chunk_reuse is False), its output in `log_path`."""

    def __init__(self, log_path: Path, *, chunk_reuse: bool, config: str | None = None, model: str | None = None,
                 startup_timeout: float = 900):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [sys.executable, "-m", "sglang_patch.cli", "serve", "--port", str(self.port), "--enable-metrics"]
        argv += [] if chunk_reuse else ["--no-chunk-reuse"]
        # paths made absolute: the server runs in the log's directory
        if config:
            argv += ["--config", str(Path(config).resolve())]
        if model:
            argv += ["--model", str(Path(model).resolve()) if Path(model).exists() else model]
        with open(log_path, "w") as log:
            # cwd: not the repository root, whose package directories would shadow the installed ones
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, cwd=log_path.parent)
        self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        try:
            wait_healthy(self.url, lambda: self.proc.poll() is None, self.log_path, timeout)
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group outlived its leader
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
