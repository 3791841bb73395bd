"""POST /chunkcache/ingest: compute and store chunk KV ahead of traffic (HTTP server process).

    {"documents": ["...", "..."], "system": "...", "namespace": "kb1", "cache_salt": "user-1"}
        ->  {"documents": 2, "new": 2, "existing": 0}

Each document goes through SGLang's own generate path as a one-document RAG prompt (chunkcache.prompt.build with the
defaults of /v1/chat/completions, so its chunk key is the one chat requests with the same system message look up),
with one new token and the `none` selector: the blend computes a chunk missing from the store standalone and stores
it, and the request's report says whether it was missing. Every document gets a radix namespace of its own (a fresh
`extra_key`): a prompt the radix tree matches whole is not blended and reports nothing, so a second call still asks
the store, and ingesting the same documents again reports 0 new; and documents ingested together never share their
first tokens through the tree (a hinted prompt learns only the segments its own prefill computed, so a document
whose first words another's prompt put in the tree would lose its first segment, the one a composed prompt's
passage starts with).

Under `report.to_clients: private` the reports say neither whether a document was new nor why one was computed in
full (docs/report-schema.md "Private reports"): the answer is `{"documents": N}`, and a document that could not be
stored (longer than the chunked-prefill size) is not told apart; the server's log says it.

Who may call it: SGLang's admin routes' level (`AuthLevel.ADMIN_OPTIONAL`, /flush_cache's): with `--admin-api-key`
only that key (`Authorization: Bearer KEY`), with only `--api-key` that key, with neither anyone; ingest writes into
any tenant it names and fills the store (docs/security.md "Who may call what").

Bounds, so that one call cannot take the server from other clients: at most `limits.ingest_max_documents` documents
per call (more is a 400), and at most `limits.ingest_in_flight` of them in the scheduler at once (the rest wait here,
so other clients' requests queue behind a few documents, not behind the whole call). A document that another call
is computing right now (same text, system, namespace and salt) is not sent again: this call waits for that
computation and counts the document as existing, so concurrent identical ingests compute each chunk once.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request
from fastapi.responses import ORJSONResponse
from sglang.srt.utils.auth import AuthLevel, auth_level

from chunkcache.documents import INGEST_KEYS, Documents, DocumentsError, parse
from chunkcache.prompt import DEFAULT_SYSTEM

from ..serve.launcher import server_limits
from .prompt_worker import build_prompt

ROUTE = "/chunkcache/ingest"
# (system, namespace, cache_salt, document) -> the future of the report of the call computing it now
_IN_FLIGHT: dict[tuple, asyncio.Future] = {}


@auth_level(AuthLevel.ADMIN_OPTIONAL)  # SGLang's API-key middleware reads it off the route's endpoint
async def ingest(request: Request):
    from sglang.srt.entrypoints.http_server import get_global_state

    limits = server_limits()
    try:
        docs = parse(await request.json(), where="ingest", allowed=INGEST_KEYS,
                     max_documents=limits.ingest_max_documents, limit="limits.ingest_max_documents")
    except ValueError as exc:  # DocumentsError, or a body that is not JSON
        return error_response(str(exc) if isinstance(exc, DocumentsError) else f"the body must be JSON: {exc}", 400)
    manager = get_global_state().tokenizer_manager
    unique = list(dict.fromkeys(docs.documents))  # a repeated document is stored once and counted as existing
    gate = asyncio.Semaphore(limits.ingest_in_flight)
    try:
        # a task group: the first failing document cancels the rest instead of letting them run to no purpose
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_ingest_one(manager, doc, docs, request, gate)) for doc in unique]
    except ExceptionGroup as failed:
        first = failed.exceptions[0]
        if isinstance(first, ValueError):  # SGLang's answer to a bad request, e.g. a document over the context
            return error_response(str(first), 400)
        raise first from failed
    results = [task.result() for task in tasks]
    for doc, (report, _) in zip(unique, results):
        where = f"documents[{docs.documents.index(doc)}]"
        if report is None:
            return error_response(f"{where} was computed without chunk reuse (no chunk report): is the server running "
                                  f"with chunk reuse (not --no-chunk-reuse)? its log says why", 501)
        # e.g. longer than the chunked-prefill size: computed in full, nothing stored. `predicted_slower` comes only
        # when every chunk is stored already (select.full_when_slower): the document is there
        if report.get("fallback", "predicted_slower") != "predicted_slower":
            return error_response(f"{where} was not stored ({report['fallback']}): {report['detail']}", 422)
    if any("private" in report for report, _ in results):
        # report.to_clients: private: whether a document was already stored would say that someone sent it
        return {"documents": len(docs.documents)}
    new = sum(report.get("chunk_misses", 0) for report, computed_here in results if computed_here)
    return {"documents": len(docs.documents), "new": new, "existing": len(docs.documents) - new}


async def _ingest_one(manager, doc: str, docs: Documents, request: Request,
                      gate: asyncio.Semaphore) -> tuple[dict | None, bool]:
    """(the document's chunk report, whether this call computed it) - or another call's report, if that call was
    computing the same chunk."""
    key = (docs.system, docs.namespace, docs.cache_salt, doc)
    while (pending := _IN_FLIGHT.get(key)) is not None:
        try:
            return await asyncio.shield(pending), False
        except asyncio.CancelledError:
            if not pending.cancelled():  # this call itself was cancelled (client gone, a sibling failed)
                raise
            # the computing call went away: compute it here (or wait for whoever took over)
    future = asyncio.get_running_loop().create_future()
    _IN_FLIGHT[key] = future
    try:
        async with gate:
            report = await _store(manager, doc, docs, request)
    except Exception as exc:
        future.set_exception(exc)
        future.exception()  # marks it retrieved: a waiter re-raises it, and with none asyncio must not warn
        raise
    except BaseException:  # cancelled (client gone, a sibling failed): a waiting call computes it instead
        future.cancel()
        raise
    finally:
        del _IN_FLIGHT[key]
    future.set_result(report)
    return report, True


async def _store(manager, doc: str, docs: Documents, request: Request) -> dict | None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    prompt = await build_prompt(manager.tokenizer, [doc], "", docs.system or DEFAULT_SYSTEM)
    obj = GenerateReqInput(input_ids=prompt.input_ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                           kv_hints=prompt.kv_hints(selector="none", namespace=docs.namespace),
                           extra_key=f"chunkcache-ingest:{uuid.uuid4().hex}",
                           cache_salt=docs.cache_salt)
    try:
        out = await manager.generate_request(obj, request).__anext__()
    except ValueError as exc:  # SGLang refused the prompt (e.g. over the context length): say which document
        raise ValueError(f"ingest.documents[{docs.documents.index(doc)}]: {exc}") from None
    return out["meta_info"].get("chunkcache")


def error_response(message: str, status: int) -> ORJSONResponse:
    """chunkcache's routes' error body: OpenAI's shape."""
    return ORJSONResponse({"error": {"message": message}}, status_code=status)
