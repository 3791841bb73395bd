"""sglang_patch.serve.server_process on a stand-in server (a few lines of http.server): health, a group stop that
reaches a child ignoring SIGTERM, a detached start, and the failures of a start."""

import sys
import time

import psutil
import pytest

from sglang_patch.serve.server_process import ServerProcess, free_port

# argv: PORT [stubborn]; with "stubborn" it first forks a child that ignores SIGTERM (only SIGKILL stops it)
STANDIN = """
import http.server, signal, subprocess, sys
port = int(sys.argv[1])
if sys.argv[2:] == ["stubborn"]:
    subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "time.sleep(600)"])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("stand-in up", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def standin(tmp_path, *args, **kwargs) -> ServerProcess:
    port = free_port()
    return ServerProcess([sys.executable, "-c", STANDIN, str(port), *args], url=f"http://127.0.0.1:{port}",
                         log_path=tmp_path / "server.log", **kwargs)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_stop_reaches_the_whole_group_and_kills_what_ignores_sigterm(tmp_path):
    server = standin(tmp_path, "stubborn").wait_healthy(30)
    assert server.alive() and "stand-in up" in server.log()
    deadline = time.time() + 10
    while not (children := psutil.Process(server.pid).children()):
        assert time.time() < deadline
        time.sleep(0.05)
    t = time.time()
    server.stop(grace=1)
    assert not server.alive() and not any(running(c.pid) for c in children)
    assert time.time() - t < 10
    server.stop()  # idempotent


def test_detached_is_not_a_descendant(tmp_path):
    with standin(tmp_path, detach=True) as server:
        server.wait_healthy(30)
        assert server.proc is None and server.pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    assert not server.alive()


def test_exit_before_healthy_raises_with_the_log(tmp_path):
    server = ServerProcess([sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                           url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "server.log")
    with pytest.raises(RuntimeError, match="no model here"):
        server.wait_healthy(30)
    assert server.wait() == 3


def test_not_healthy_in_time_is_stopped(tmp_path):
    server = ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"],
                           url=f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "server.log")
    with pytest.raises(TimeoutError):
        server.wait_healthy(1)
    assert not server.alive()
