"""POST /chunkcache/ingest: compute and store chunk KV ahead of traffic (HTTP server process).

    {"documents": ["...", "..."], "system": "...", "namespace": "kb1"}  ->  {"documents": 2, "new": 2, "existing": 0}

Each document goes through SGLang's own generate path as a one-document RAG prompt (chunkcache.prompt.build with the
defaults of /v1/chat/completions, so its chunk key is the one chat requests with the same system message look up),
with one new token and the `none` selector: the blend computes a chunk missing from the store standalone and stores
it, and the request's report says whether it was missing. Every call gets a radix namespace of its own (a fresh
`extra_key`), because a prompt the radix tree matches whole is not blended and reports nothing; so a second call
still asks the store, and ingesting the same documents again reports 0 new.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import uuid

from fastapi import Request
from fastapi.responses import ORJSONResponse
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from chunkcache.documents import INGEST_KEYS, Documents, DocumentsError, parse
from chunkcache.prompt import DEFAULT_SYSTEM, build

ROUTE = "/chunkcache/ingest"


def register() -> None:
    # Only the server's main process runs the HTTP app; spawned SGLang children (scheduler, detokenizer) skip it.
    if multiprocessing.parent_process() is None:
        HookRegistry.register("sglang.srt.entrypoints.http_server.launch_server", add_route, HookType.BEFORE)


def add_route(*args, **kwargs) -> None:
    from sglang.srt.entrypoints.http_server import app

    if not any(getattr(route, "path", None) == ROUTE for route in app.routes):
        app.add_api_route(ROUTE, ingest, methods=["POST"])


async def ingest(request: Request):
    from sglang.srt.entrypoints.http_server import get_global_state

    try:
        docs = parse(await request.json(), where="ingest", allowed=INGEST_KEYS)
    except ValueError as exc:  # DocumentsError, or a body that is not JSON
        return _error(str(exc) if isinstance(exc, DocumentsError) else f"the body must be JSON: {exc}", 400)
    manager = get_global_state().tokenizer_manager
    extra_key = f"chunkcache-ingest:{uuid.uuid4().hex}"
    unique = list(dict.fromkeys(docs.documents))  # a repeated document is stored once and counted as existing
    try:
        reports = await asyncio.gather(*(_store(manager, doc, docs, extra_key, request) for doc in unique))
    except ValueError as exc:
        return _error(str(exc), 400)
    for doc, report in zip(unique, reports):
        where = f"documents[{docs.documents.index(doc)}]"
        if report is None:
            return _error(f"{where} was computed without chunk reuse (no chunk report): is the server running with "
                          f"chunk reuse (not --no-chunk-reuse)? its log says why", 501)
        if "fallback" in report:  # e.g. longer than the chunked-prefill size: computed in full, nothing stored
            return _error(f"{where} was not stored ({report['fallback']}): {report['detail']}", 422)
    new = sum(report["chunk_misses"] for report in reports)
    return {"documents": len(docs.documents), "new": new, "existing": len(docs.documents) - new}


async def _store(manager, doc: str, docs: Documents, extra_key: str, request: Request) -> dict | None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    prompt = build(manager.tokenizer, [doc], "", system=docs.system or DEFAULT_SYSTEM)
    obj = GenerateReqInput(input_ids=prompt.input_ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                           kv_hints=prompt.kv_hints(selector="none", namespace=docs.namespace), extra_key=extra_key)
    out = await manager.generate_request(obj, request).__anext__()
    return out["meta_info"].get("chunkcache")


def _error(message: str, status: int) -> ORJSONResponse:
    return ORJSONResponse({"error": {"message": message}}, status_code=status)
