"""Per-case rows of `chunkcache eval`, appended to a JSONL file as each one finishes, so a sweep of hours survives an
interruption: `--resume` reads the file back and the sweep runs only the rows it lacks.

The first line is the measurement's identity (workload, model, answer length, ...): resuming under another one would
mix incomparable rows, so it is refused. A row is keyed by (task, case id, selector, rho, path). A process killed
mid-write leaves a truncated last line; it is dropped on resume (that row runs again).
"""

from __future__ import annotations

import json
from pathlib import Path

Key = tuple[str, str, str, float | None, str]


def key(row: dict) -> Key:
    return row["task"], row["item"], row["selector"], row["ratio"], row["path"]


class RowLog:
    """The rows measured so far (`rows`, by key), mirrored to `path` (None: kept in memory only)."""

    def __init__(self, path: Path | None, identity: dict, resume: bool = False):
        self.path = path
        self.rows: dict[Key, dict] = {}
        # compared with what a JSONL line decodes to (tuples become lists)
        identity = json.loads(json.dumps(identity, default=str))
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume and path.is_file():
            self._load(identity)
        lines = [{"identity": identity}, *self.rows.values()]
        path.write_text("".join(json.dumps(line, default=str) + "\n" for line in lines))

    def __contains__(self, k: Key) -> bool:
        return k in self.rows

    def append(self, row: dict) -> None:
        self.rows[key(row)] = row
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")

    def _load(self, identity: dict) -> None:
        lines = self.path.read_text().splitlines()
        records = []
        for i, line in enumerate(lines):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines) - 1:
                    raise ValueError(f"{self.path}:{i + 1} is not JSON: the file is damaged, not cut short") from None
        if not records or "identity" not in records[0]:
            raise ValueError(f"{self.path} does not start with an identity line: not a `chunkcache eval` row file")
        found = records[0]["identity"]
        if found != identity:
            diff = {k: (found.get(k), identity.get(k)) for k in found.keys() | identity.keys()
                    if found.get(k) != identity.get(k)}
            raise ValueError(f"{self.path} holds rows of another measurement (file vs now: {diff}); "
                             "resume with the same settings or write to another --out")
        for row in records[1:]:
            self.rows[key(row)] = row
