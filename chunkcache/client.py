"""Client of a chunkcache server's POST /chunkcache/ingest, as `chunkcache ingest FILE --url URL` runs it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import requests
from tqdm import tqdm

INGEST_ROUTE = "/chunkcache/ingest"


@dataclass
class IngestResult:
    documents: int = 0
    new: int = 0  # chunks computed and stored by this call
    existing: int = 0  # already in the store (or repeated in the input)


def read_documents(path: str | Path) -> list[str]:
    """The documents of a JSON Lines file: each line a JSON string or an object with a "text" field."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f'{path}:{lineno}: expected a JSON string or an object with a non-empty "text"')
            docs.append(text)
    if not docs:
        raise ValueError(f"{path}: no documents")
    return docs


def ingest(url: str, documents: Sequence[str], *, batch_size: int = 16, system: str | None = None,
           namespace: str | None = None, cache_salt: str | None = None, progress: bool = True,
           timeout: float = 1800) -> IngestResult:
    """Send `documents` in batches (one request each, so the bar moves and a failure loses one batch at most).
    `cache_salt`: the isolation salt of the requests that will use them (SGLang's; chunks of another salt are never
    shared)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    options = {k: v for k, v in {"system": system, "namespace": namespace, "cache_salt": cache_salt}.items()
               if v is not None}
    total = IngestResult()
    with tqdm(total=len(documents), unit="doc", desc="ingest", disable=not progress) as bar:
        for i in range(0, len(documents), batch_size):
            batch = list(documents[i:i + batch_size])
            r = requests.post(url.rstrip("/") + INGEST_ROUTE, json={"documents": batch, **options}, timeout=timeout)
            if r.status_code != 200:
                raise requests.HTTPError(f"{url}{INGEST_ROUTE}: HTTP {r.status_code}: {_message(r)}", response=r)
            out = r.json()
            total.documents += out["documents"]
            total.new += out["new"]
            total.existing += out["existing"]
            bar.update(len(batch))
            bar.set_postfix(new=total.new, existing=total.existing)
    return total


def _message(r: requests.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:500]
