"""The server of an A/B side: `chunkcache serve` (sglang_patch.serve.server_process) on a free port, its output in a
log, or a deployed server the bench only sends requests to (`--base-url`, `--stock-url`)."""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from pathlib import Path

import requests

from chunkcache.config import config_file
from sglang_patch.serve.server_process import ServerProcess, chunkcache_serve


def start_server(log_path: Path, *, chunk_reuse: bool, config: str | None = None, model: str | None = None,
                 startup_timeout: float = 900, auto_chunks: bool = False, extra: tuple[str, ...] = ()) -> ServerProcess:
    """`chunkcache serve` (stock SGLang prefix caching when chunk_reuse is False; `auto_chunks`: --auto-chunks),
    healthy; a context manager that stops it. `extra`: more flags for SGLang."""
    args = ["--enable-metrics"] + ([] if chunk_reuse else ["--no-chunk-reuse"])
    args += (["--auto-chunks"] if auto_chunks else []) + list(extra)
    # paths made absolute: the server runs in the log's directory
    if config:
        args += ["--chunkcache-config", str(config_file(config).resolve())]
    if model:
        args += ["--model", str(Path(model).resolve()) if Path(model).exists() else model]
    # cwd: not the repository root, whose package directories would shadow the installed ones
    return chunkcache_serve(*args, log_path=log_path, timeout=startup_timeout, cwd=log_path.parent)


@dataclass(frozen=True)
class Endpoint:
    """A deployed server: the bench sends it requests and neither starts nor stops it."""
    url: str
    model_path: str  # what its /model_info says it serves (the bench tokenizes with --model: they must agree)


def side_server(log_path: Path, *, url: str | None, chunk_reuse: bool, **start):
    """The side's server as a context manager: the deployed one at `url` (checked by `deployed`), else one
    start_server starts (and stops on exit) with `start`'s settings."""
    if url is None:
        return start_server(log_path, chunk_reuse=chunk_reuse, **start)
    return contextlib.nullcontext(deployed(url, chunk_reuse))


def deployed(url: str, chunk_reuse: bool) -> Endpoint:
    """The server at `url`, checked healthy and, for the chunkcache side (`chunk_reuse`), serving chunk reuse: its
    /server_info names chunkcache's backend (a server started with `--no-chunk-reuse` names none, stock SGLang
    without the plugin has no such state). The stock side may be any server, a chunkcache one included: a request
    without hints or documents is served as stock SGLang serves it, unless automatic detection is on there."""
    url = url.rstrip("/")
    try:
        requests.get(url + "/health", timeout=60).raise_for_status()
        states = requests.get(url + "/server_info", timeout=60).json().get("internal_states") or [{}]
        model_path = requests.get(url + "/model_info", timeout=60).json().get("model_path", "?")
    except (requests.RequestException, ValueError) as e:
        raise ValueError(f"{url}: no healthy SGLang server answers there ({e})") from e
    if chunk_reuse and not (states[0].get("chunkcache") or {}).get("backend"):
        raise ValueError(f"{url} serves no chunk reuse (its /server_info names no chunkcache backend): the chunkcache "
                         "side needs a server started by `chunkcache serve` or with `--radix-cache-backend chunkcache`")
    return Endpoint(url, model_path)


def endpoint_args(ap: argparse.ArgumentParser) -> None:
    """The options that point the bench at deployed servers instead of starting its own."""
    ap.add_argument("--base-url", metavar="URL", help="measure a deployed chunkcache server at URL instead of "
                    "starting one (with --stock-url; docs/ab-benchmark.md)")
    ap.add_argument("--stock-url", metavar="URL", help="with --base-url: the deployed server the stock side's "
                    "requests go to, which may be the same URL (requests without hints are served as stock SGLang "
                    "serves them, unless automatic detection is on there)")


def endpoints(args: argparse.Namespace, ap: argparse.ArgumentParser) -> dict[str, str] | None:
    """side -> URL of the deployed servers the options name; None: the bench starts its own."""
    if (args.base_url is None) != (args.stock_url is None):
        ap.error("--base-url and --stock-url go together: the deployed chunkcache server and the one the stock "
                 "side's requests go to (the same URL serves both sides when automatic detection is off there)")
    return {"stock": args.stock_url, "chunkcache": args.base_url} if args.base_url else None


def up_line(side: str, server, seconds: float) -> str:
    """What the run prints once a side's server is there: which endpoint, and whether the bench started it."""
    if isinstance(server, Endpoint):
        return f"{side}: deployed server {server.url} (serving {server.model_path}; not started by the bench)"
    return f"{side}: server up in {seconds:.0f} s at {server.url}"
