import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def default_model() -> Path:
    from chunkcache.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


class Server:
    """A `chunkcache serve` process on a free port, its output captured to a log file."""

    def __init__(self, log_path: Path, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_patch.cli", "serve", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT / "tests",
            env={**os.environ, **(env or {})},
        )
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"server not healthy after 600 s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory, default_model):
    srv = Server(tmp_path_factory.mktemp("server") / "server.log", "--enable-metrics")  # /metrics is tested too
    yield srv
    srv.stop()
