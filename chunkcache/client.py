"""Client of a chunkcache server's admin routes, POST /chunkcache/ingest and POST /chunkcache/purge, as `chunkcache
ingest FILE --url URL` and `chunkcache purge --namespace NS --url URL` run them. Both are SGLang admin routes
(docs/security.md): `api_key` is the server's `--admin-api-key` (its `--api-key` when it has no admin key), sent as
`Authorization: Bearer KEY`; the commands read it from $CHUNKCACHE_API_KEY when not given (SGLang itself names no
variable for its keys)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import requests
from tqdm import tqdm

INGEST_ROUTE = "/chunkcache/ingest"
PURGE_ROUTE = "/chunkcache/purge"
API_KEY_ENV = "CHUNKCACHE_API_KEY"


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
           timeout: float = 1800, api_key: str | None = None) -> IngestResult:
    """Send `documents` in batches (one request each, so the bar moves and a failure loses one batch at most).
    `cache_salt`: the isolation salt of the requests that will use them (SGLang's; chunks of another salt are never
    shared). `api_key`: see above."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    options = {k: v for k, v in {"system": system, "namespace": namespace, "cache_salt": cache_salt}.items()
               if v is not None}
    total = IngestResult()
    with tqdm(total=len(documents), unit="doc", desc="ingest", disable=not progress) as bar:
        for i in range(0, len(documents), batch_size):
            batch = list(documents[i:i + batch_size])
            out = _post(url, INGEST_ROUTE, {"documents": batch, **options}, api_key, timeout)
            total.documents += out["documents"]
            total.new += out["new"]
            total.existing += out["existing"]
            bar.update(len(batch))
            bar.set_postfix(new=total.new, existing=total.existing)
    return total


def purge(url: str, *, namespace: str | None = None, cache_salt: str | None = None, api_key: str | None = None,
          timeout: float = 600) -> dict[str, int]:
    """Remove one tenant's chunks from the server's tiers and the shared one: the entries removed per tier."""
    body = {k: v for k, v in {"namespace": namespace, "cache_salt": cache_salt}.items() if v is not None}
    return _post(url, PURGE_ROUTE, body, api_key, timeout)["purged"]


def _post(url: str, route: str, body: dict, api_key: str | None, timeout: float) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = requests.post(url.rstrip("/") + route, json=body, headers=headers, timeout=timeout)
    if r.status_code != 200:
        hint = " (the server wants its admin key: --api-key or $CHUNKCACHE_API_KEY)" if r.status_code == 401 else ""
        raise requests.HTTPError(f"{url}{route}: HTTP {r.status_code}: {_message(r)}{hint}", response=r)
    return r.json()


def _message(r: requests.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:500]
