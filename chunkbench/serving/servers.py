"""A server of an A/B side: `chunkcache serve` (sglang_patch.serve.server_process) on a free port, its output in a
log."""

from __future__ import annotations

from pathlib import Path

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
