"""chunkcache's own routes on SGLang's HTTP app (POST /chunkcache/ingest, POST /chunkcache/purge), added before
SGLang launches its HTTP server (plugin.hooks), each once."""

from __future__ import annotations

from . import admin, ingest

ROUTES = {ingest.ROUTE: ingest.ingest, admin.ROUTE: admin.purge}


def add_routes(*args, **kwargs) -> None:
    from sglang.srt.entrypoints.http_server import app

    present = {getattr(route, "path", None) for route in app.routes}
    for path, endpoint in ROUTES.items():
        if path not in present:
            app.add_api_route(path, endpoint, methods=["POST"])
