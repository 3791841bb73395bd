"""What the examples ask a chunkcache server between their questions (imported from the scripts beside it)."""

from __future__ import annotations

import time

import requests


def learned(url: str, timeout_s: float = 120.0) -> None:
    """Wait until the server has encoded the paragraphs a question taught it: automatic detection learns them when
    it is idle (`encodes_waiting` in /server_info; a server that does not say it returns at once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = requests.get(url + "/server_info", timeout=30).json()["internal_states"][0].get("chunkcache", {})
        if not state.get("encodes_waiting"):
            return
        time.sleep(0.2)
