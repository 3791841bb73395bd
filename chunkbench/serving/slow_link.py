"""A loopback TCP proxy that makes a link slow: each request waits `latency_s` before it is passed on, and replies
come back at most `bytes_per_s`. The settings can change while connections are open (a test or a bench flips the
link). Used by the fetch-or-compute tests and bench (chunkbench.serving.fetch_or_compute)."""

from __future__ import annotations

import socket
import threading
import time

from sglang_patch.serve.server_process import free_port

BLOCK = 64 << 10
PIECE = 8 << 10  # bytes sent per pause on a capped link


class SlowLink:
    def __init__(self, target_port: int, latency_s: float = 0.0, bytes_per_s: float = float("inf")):
        self.target_port, self.latency_s, self.bytes_per_s = target_port, latency_s, bytes_per_s
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def set(self, latency_s: float = 0.0, bytes_per_s: float = float("inf")) -> None:
        self.latency_s, self.bytes_per_s = latency_s, bytes_per_s

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, request: bool) -> None:
        try:
            while data := src.recv(BLOCK):
                if request:
                    time.sleep(self.latency_s)
                    dst.sendall(data)
                    continue
                for i in range(0, len(data), PIECE):  # paced in pieces: no read waits long for the next bytes
                    time.sleep(len(data[i:i + PIECE]) / self.bytes_per_s)
                    dst.sendall(data[i:i + PIECE])
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
