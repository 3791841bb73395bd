"""POST /chunkcache/purge: one tenant's chunk KV removed from every tier, the shared one included (HTTP server
process).

    {"namespace": "kb1", "cache_salt": "user-1"}
        ->  {"purged": {"memory": 3, "disk": 3, "remote": 3, "idle_jobs": 0}}

The tenant is what a request names (docs/security.md "Tenants"): `namespace` (the server's `store.namespace` when
left out) and SGLang's `cache_salt`; a body must name at least one of them, so that an empty body purges nothing
by accident. `purged` counts, per tier, the entries removed: this server's memory and disk tiers (summed over its
schedulers and tensor-parallel ranks, each rank's shard of a chunk an entry of its own) and the shared tier (every
server's and every model's entries of the tenant: chunkcache/store/remote.py), and `idle_jobs` the jobs dropped that
would have stored the tenant's entries later. A request of the tenant served during or after the purge stores its
chunks again: stop the tenant's traffic at the gateway first. Other servers' local tiers keep their copies until
they are purged too (each server's own purge; one of them reaches the shared tier).

It travels as SGLang's own control requests do: TokenizerManager.dumper_control (a method name and a JSON body, one
reply per data-parallel scheduler) to every scheduler, where sglang_patch.scheduler.server.on_control answers it;
the scheduler serves nothing else meanwhile (the shared tier's search takes a round trip per page of its keys).
Who may call it: SGLang's admin level (`AuthLevel.ADMIN_OPTIONAL`, as /flush_cache): with `--admin-api-key` only that
key, with only `--api-key` that key, with neither anyone.
"""

from __future__ import annotations

from fastapi import Request
from sglang.srt.utils.auth import AuthLevel, auth_level

from chunkcache.hints import HintError, parse_options

from ..scheduler.server import PURGE
from .ingest import error_response

ROUTE = "/chunkcache/purge"
TENANT_KEYS = ("namespace", "cache_salt")


def tenant_of(body) -> dict[str, str | None]:
    """The tenant a purge body names: {"namespace": ..., "cache_salt": ...} (None: not named); ValueError saying what
    is wrong."""
    if not isinstance(body, dict):
        raise ValueError('purge takes an object like {"namespace": "kb1", "cache_salt": "user-1"}')
    unknown = sorted(set(body) - set(TENANT_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} in purge; allowed: 'namespace', 'cache_salt'")
    namespace, salt = body.get("namespace"), body.get("cache_salt")
    if namespace is None and salt is None:
        raise ValueError("purge names its tenant: a namespace, a cache_salt or both (the server's default namespace "
                         "is purged only when named)")
    try:
        parse_options({"namespace": namespace})
    except HintError as exc:
        raise ValueError(f"purge: {str(exc).removeprefix('chunkcache hint: ')}") from None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("purge.cache_salt must be a non-empty string")
    return {"namespace": namespace, "cache_salt": salt}


@auth_level(AuthLevel.ADMIN_OPTIONAL)  # SGLang's API-key middleware reads it off the route's endpoint
async def purge(request: Request):
    from sglang.srt.entrypoints.http_server import get_global_state
    from sglang.srt.managers.io_struct import DumperControlReqInput

    try:
        tenant = tenant_of(await request.json())
    except ValueError as exc:  # a body that is not JSON is a ValueError too
        return error_response(str(exc), 400)
    replies = await get_global_state().tokenizer_manager.dumper_control(DumperControlReqInput(method=PURGE,
                                                                                              body=tenant))
    failed = [reply.error for reply in replies if not reply.success]
    if failed:
        return error_response(f"purge failed (what it removed stays removed; purge again): {'; '.join(failed)}", 500)
    purged: dict[str, int] = {}
    for reply in replies:  # one per data-parallel scheduler
        for part in reply.response:
            for tier, n in part.items():
                purged[tier] = purged.get(tier, 0) + n
    return {"purged": purged}
