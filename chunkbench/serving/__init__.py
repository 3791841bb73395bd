"""Speed against stock SGLang prefix caching, on the same model, workload and machine.

`chunkcache bench` (chunkbench.commands): the A/B run against stock (`ab`: sequential and Poisson phases) and the closed
loop (`closed_loop`: N clients at a fixed concurrency), replaying workloads through `load` and `http_client` (one timed,
streamed /generate) against the servers `servers` starts, summarised by `ab_report` and `closed_report` and drawn by
`plots`; `--workload auto` is `auto_bench` (automatic chunk detection against stock). Standalone, each
`python -m chunkbench.serving.NAME`: `ttft_shuffled` (TTFT on shuffled chunks in one in-process engine, beside each
selector's `floor`; `pyspy` profiles its scheduler), `soak` (a bounded soak against a KV pool smaller than the working
set), `remote_get_latency` (a chunk-store get served by the remote tier) and `fetch_or_compute` (store.remote_fetch's
sides timed on a fast and a slow link, made by `slow_link`, a loopback proxy the tests use too) and `sustained` (two
servers and the router over a `valkey_cluster`, a long Zipf-popular run, hit rate and TTFT per window).
"""
