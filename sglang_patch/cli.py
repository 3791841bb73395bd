"""`chunkcache` console script: `model`, `serve`, `bench` and `eval` subcommands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from chunkcache.config import Config
from chunkcache.models import DEFAULT_MODEL, ModelError, resolve_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("model", help="print the local path of a ready-to-load HF model directory (builds it if needed)")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL)

    p = sub.add_parser("serve", help="start SGLang's HTTP server with chunk reuse (CPU when no GPU is present)")
    p.add_argument("--config", help="YAML config (see configs/default.yaml)")
    p.add_argument("--model", help=f"model name or HF directory (default: from config, else {DEFAULT_MODEL})")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--no-chunk-reuse", action="store_true", help="stock SGLang prefix caching (A/B baseline)")
    p.add_argument("--remote-url", help="shared chunk store, redis://[:password@]host:port/db or rediss:// (overrides "
                   "store.remote_url; $CHUNKCACHE_REMOTE_URL keeps a password out of the process list)")
    p.add_argument("--auto-chunks", action="store_true", help="find reusable chunks in prompts without a chunk hint "
                   "(config auto.enabled; unmarked requests become approximate)")

    for name, summary in (("bench", "A/B benchmark against stock prefix caching: TTFT, throughput, goodput, quality"),
                          ("eval", "quality sweep of selectors x rho, plus the SpecCache analyses")):
        sub.add_parser(name, help=summary, add_help=False)  # arguments: chunkbench/cli.py

    p = sub.add_parser("ingest", help="precompute and store the chunk KV of documents on a running server")
    p.add_argument("file", help='JSON Lines: one document per line, a JSON string or {"text": ...}')
    p.add_argument("--url", default="http://127.0.0.1:30000", help="server (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="documents per request (default: %(default)s)")
    p.add_argument("--system", help="system message the documents will be asked with (default: the chat default)")
    p.add_argument("--namespace", help="chunk store namespace (default: the server's)")

    args, extra = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if extra and args.command not in ("serve", "bench", "eval"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "model":
            print(resolve_model(args.name))
            return 0
        if args.command == "ingest":
            return ingest(args)
        if args.command in ("bench", "eval"):
            from chunkbench import cli as bench_cli

            return (bench_cli.bench if args.command == "bench" else bench_cli.evaluate)(extra)
        return serve(args, extra)
    except (ModelError, ValueError, OSError) as exc:
        print(f"chunkcache: error: {exc}", file=sys.stderr)
        return 2


def serve(args: argparse.Namespace, extra: list[str]) -> int:
    from .launcher import AUTO_CHUNKS_ENV, REMOTE_URL_ENV, prepare_environment, server_settings, to_argv
    from .server_process import ServerProcess, wait_healthy

    config = Config.load(args.config)
    for key in ("model", "host", "port"):
        if getattr(args, key) is not None:
            setattr(config.serve, key, getattr(args, key))
    model_dir = resolve_model(config.serve.model)
    if not args.no_chunk_reuse:
        from transformers import AutoConfig

        from chunkcache.architectures import UnsupportedModel, check

        try:
            check(AutoConfig.from_pretrained(model_dir))
        except UnsupportedModel as exc:
            print(f"chunkcache: error: {model_dir} cannot be served with chunk reuse: {exc}. "
                  f"Serve it without chunk reuse (--no-chunk-reuse) or pick a model from README 'Models'.",
                  file=sys.stderr)
            return 2
    settings = server_settings(model_dir, config, chunk_reuse=not args.no_chunk_reuse)
    prepare_environment(args.config)
    if args.remote_url:
        os.environ[REMOTE_URL_ENV] = args.remote_url
    if args.auto_chunks:
        os.environ[AUTO_CHUNKS_ENV] = "1"
    argv = [sys.executable, "-m", "sglang.launch_server", *to_argv(settings), *config.serve.sglang_args, *extra]
    print("starting:", " ".join(argv), flush=True)
    base = f"http://{config.serve.host}:{config.serve.port}"
    # in this process's group: whoever stops `chunkcache serve` as a group stops SGLang with it
    server = ServerProcess(argv, url=base, own_session=False)
    signal.signal(signal.SIGTERM, lambda *_: server.terminate())
    try:
        try:
            wait_healthy(base, server.alive, timeout=900, interval=2)
            print(_usage(base), flush=True)
        except (RuntimeError, TimeoutError):
            pass  # exited (its status below), or slow to start and left running: its own output says why
        return server.wait()
    except KeyboardInterrupt:
        server.terminate()
        return server.wait()


def ingest(args: argparse.Namespace) -> int:
    from chunkcache.client import ingest as send, read_documents

    result = send(args.url, read_documents(args.file), batch_size=args.batch_size, system=args.system,
                  namespace=args.namespace)
    print(f"{result.documents} documents: {result.new} new, {result.existing} already stored")
    return 0


def _usage(base: str) -> str:
    body = json.dumps({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    return f"\nchunkcache server ready at {base}\ntry:\n  curl -s {base}/generate -H 'Content-Type: application/json' -d '{body}'\n"


if __name__ == "__main__":
    sys.exit(main())
