"""`chunkcache bench --mode closed`: throughput and TTFT of stock SGLang (prefix caching) vs chunkcache at a fixed
concurrency: N clients, each sending its next request as soon as its previous one finished (load.closed).

Both servers run for the whole run, and the sides alternate in short blocks (per client count: stock, chunkcache,
stock, chunkcache, ...; `blocks` pairs, pooled per side), so a drift of the host (thermal, a neighbour's load) lands
on both sides instead of on whichever ran second. Each pair of blocks sends both servers the same prompts, and no
prompt is sent to a server twice (workloads.fresh): stock's radix tree gets the prefix hits a new request would
get, no more. Warm-up as in ab.run, once before the first block: chunkcache stores every document's chunk, stock
gets `[system][document]` for every document that opens a measured prompt. With deployed servers (`endpoints`) the
bench starts none, and prints no floor: its rates would be timed on this host, not the servers'.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..workloads import WorkloadConfig, chunk_warmup, fresh, items, prefix_warmup, to_request
from . import closed_report, floor
from .ab import Arm, warm
from .http_client import drain
from .load import closed
from .servers import side_server, up_line

SIDES = ("stock", "chunkcache")


@dataclass
class ClosedConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    arm: Arm = Arm("prophet", 0.15)  # the chunkcache side's configuration
    clients: tuple[int, ...] = (1, 4, 8, 16)  # concurrencies, one after the other
    requests: int = 32  # per block: a block's wall time is its throughput's denominator
    blocks: int = 2  # (stock, chunkcache) block pairs per client count
    max_new_tokens: int = 16  # every request decodes exactly this many (ignore_eos)
    model: str = "smollm2-135m-instruct"
    server_config: str | None = None  # YAML for both servers (chunkcache serve --chunkcache-config)
    out: Path = Path("results/closed")
    endpoints: dict[str, str] | None = None  # side -> URL of a deployed server; None: the bench starts both


CONFIG, RECORDS, HOST = "closed_loop.json", "closed_loop.jsonl", "closed_loop_host.json"


def run(config: ClosedConfig) -> Path:
    from transformers import AutoTokenizer

    from chunkcache.models import resolve_model

    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(asdict(config), indent=1, default=str))
    tok = AutoTokenizer.from_pretrained(resolve_model(config.model))
    pool = items(config.workload)
    n = config.requests
    measured = fresh(config.workload, pool, len(config.clients) * config.blocks * n)
    schedule = [to_request(tok, it) for it in measured]
    host = None
    if config.endpoints is None:
        host = host_rates(config, int(statistics.median(len(r.prompt.input_ids) for r in schedule)))
        (out / HOST).write_text(json.dumps(host, indent=1))
    warmups = {"stock": prefix_warmup(measured), "chunkcache": chunk_warmup(pool, config.workload.docs)}
    arms = {"stock": Arm(), "chunkcache": config.arm}

    jsonl = out / RECORDS
    jsonl.write_text("")
    records: list[dict] = []
    with ExitStack() as stack:
        servers = {}
        for side in SIDES:
            t = time.perf_counter()
            servers[side] = stack.enter_context(side_server(
                out / f"closed_loop_server_{side}.log", url=(config.endpoints or {}).get(side),
                chunk_reuse=side == "chunkcache", config=config.server_config, model=config.model))
            print(f"{up_line(side, servers[side], time.perf_counter() - t)}; {len(warmups[side])} warm-up requests",
                  flush=True)
            warm(servers[side].url, [to_request(tok, it) for it in warmups[side]], side == "chunkcache")
            if side == "chunkcache":  # what the warm-up estimated, measured before any side is timed
                drain(servers[side].url)
        for c, clients in enumerate(config.clients):
            for b in range(config.blocks):
                start = (c * config.blocks + b) * n
                for side in SIDES:
                    arm = arms[side]
                    rows = closed(servers[side].url, schedule[start:start + n], arm.hints, config.max_new_tokens,
                                  clients, desc=f"{side} {clients} clients, block {b + 1}/{config.blocks}")
                    for r in rows:
                        r.update(workload=config.workload.spec, side=side, endpoint=servers[side].url, arm=arm.label,
                                 clients=clients, block=b)
                    records += rows
                    with jsonl.open("a") as f:
                        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(closed_report.write(config, records, host))
    return out


def host_rates(config: ClosedConfig, tokens: int) -> dict:
    """The floor's rates on this host (closed_report.floor_lines), timed before any server starts: the model's
    causal attention at the median prompt length per (query, key) pair, and a memory copy of that prompt's KV."""
    from chunkcache.config import Config
    from chunkcache.models import resolve_model
    from sglang_patch.serve.launcher import server_settings

    path = resolve_model(config.model)
    dtype = server_settings(path, Config.load(config.server_config)).get("dtype", "bfloat16")
    shape = floor.Shape.of_model(path, dtype)
    return dict(shape={**asdict(shape), "dtype": str(shape.dtype).removeprefix("torch.")},
                pair_s=floor.causal_attention_s(shape, tokens) / floor.causal_pairs(tokens),
                copy_bytes_s=floor.copy_bandwidth(tokens * shape.kv_bytes_per_token))


def load_run(out: Path) -> tuple[ClosedConfig, list[dict], dict | None]:
    """The config, records and floor rates (None for a run from before they were measured) of an earlier closed-loop
    run's results directory."""
    raw = json.loads((out / CONFIG).read_text())
    config = ClosedConfig(**{**raw, "workload": WorkloadConfig(**raw["workload"]), "arm": Arm(**raw["arm"]),
                             "clients": tuple(raw["clients"]), "out": out})
    host = json.loads((out / HOST).read_text()) if (out / HOST).exists() else None
    return config, [json.loads(line) for line in (out / RECORDS).read_text().splitlines()], host
