"""N chunkcache servers behind SGLang's router, sharing one chunk store (docs/shared-store.md).

    .venv/bin/python examples/cluster.py --remote-url redis://store-host:6379/0 --workers 2 --port 30000

starts `chunkcache serve` on ports PORT+1 .. PORT+N (each with the shared store as its remote tier), then SGLang's
router (`sglang_router.launch_router`, PyPI `sglang-router`, the project's `router` extra) on PORT over them, and
runs until Ctrl-C or SIGTERM, which stops all of them. Clients talk to the router exactly as to one server. The URL
goes to the servers through $CHUNKCACHE_REMOTE_URL, not their command lines, so a password stays out of `ps`.

The router's default `cache_aware` policy matches request text prefixes; RAG prompts whose documents come in varying
orders share little more than the system prompt, so it mostly balances load, which is what a shared store needs:
whichever server gets a request finds the chunks another server computed. On other machines, run `chunkcache serve
--remote-url URL` on each and `python -m sglang_router.launch_router --worker-urls http://m1:30000 ...` anywhere.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from sglang_patch.serve.launcher import REMOTE_URL_ENV
from sglang_patch.serve.server_process import ServerProcess


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--remote-url", default=os.environ.get(REMOTE_URL_ENV),
                   help=f"the shared store, redis://[:password@]host:port/db or rediss:// (default: ${REMOTE_URL_ENV})")
    p.add_argument("--workers", type=int, default=2, help="chunkcache servers (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address of the router and the servers (default: %(default)s)")
    p.add_argument("--port", type=int, default=30000,
                   help="router port; servers take the next ones (default: %(default)s)")
    p.add_argument("--policy", default="cache_aware",
                   help="router policy: cache_aware (default), round_robin, power_of_two, random")
    p.add_argument("--config", help="chunkcache YAML config for every server")
    p.add_argument("--log-dir", default="cluster-logs",
                   help="one log per server and the router's (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for each process")
    args, serve_args = p.parse_known_args(argv)  # the rest goes to every `chunkcache serve`
    if not args.remote_url:
        p.error(f"--remote-url or ${REMOTE_URL_ENV} is required: the servers share chunks through it")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[ServerProcess] = []  # each in a session of its own: its stop reaches SGLang's children too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # through the finally below
    try:
        for i in range(args.workers):
            port = args.port + 1 + i
            cmd = [sys.executable, "-m", "sglang_patch.serve.cli", "serve", "--host", args.host, "--port", str(port),
                   *(["--chunkcache-config", args.config] if args.config else []), *serve_args]
            procs.append(ServerProcess(cmd, url=f"http://{args.host}:{port}", log_path=log_dir / f"server-{i}.log",
                                       env={REMOTE_URL_ENV: args.remote_url}))
        for proc in procs:
            _wait(proc, args.startup_timeout)
        urls = [proc.url for proc in procs]
        router = f"http://{args.host}:{args.port}"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(args.port),
               "--worker-urls", *urls, "--policy", args.policy, "--log-dir", str(log_dir)]
        procs.append(ServerProcess(cmd, url=router, log_path=log_dir / "router.log"))
        # the router answers /health before it has registered its workers: wait until it lists all of them healthy
        _wait(procs[-1], args.startup_timeout, path="/workers",
              ready=lambda r: sum(w["is_healthy"] for w in r.json()["workers"]) == args.workers)
        print(f"router {router} ({args.policy}) over {' '.join(urls)}, store {args.remote_url.split('@')[-1]}; "
              f"logs in {log_dir}/", flush=True)
        while all(proc.alive() for proc in procs):
            time.sleep(1)
        print("a process exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in reversed(procs):  # the router first: no request goes to a server being stopped
            proc.stop(grace=30)


def _wait(proc: ServerProcess, timeout: float, **kwargs) -> None:
    try:
        proc.wait_healthy(timeout, **kwargs)
    except (RuntimeError, TimeoutError) as exc:
        raise SystemExit(f"{' '.join(proc.argv[:5])} ...: {exc}")


if __name__ == "__main__":
    sys.exit(main())
