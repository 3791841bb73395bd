"""ContextPilot's documented online API (`contextpilot.optimize(docs, query)`, PyPI `contextpilot`) behind a pipe,
run by the Python of a venv of its own (its pins clash with ours): one JSON object per line in,
`{"docs": [...], "query": "..."}`, one per line out, `{"messages": [...], "seconds": s}`. Imports nothing of this
repository. ContextPilot prints progress on stdout; it goes to stderr here, stdout carries the answers only."""

import json
import sys
import time


def main() -> None:
    out, sys.stdout = sys.stdout, sys.stderr
    import contextpilot

    for line in sys.stdin:
        ask = json.loads(line)
        t = time.perf_counter()
        messages = contextpilot.optimize(ask["docs"], ask["query"])
        out.write(json.dumps({"messages": messages, "seconds": time.perf_counter() - t}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
