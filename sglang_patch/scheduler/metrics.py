"""Prometheus metrics of chunk reuse, written in the scheduler process and served by SGLang's /metrics.

With `--enable-metrics` SGLang sets PROMETHEUS_MULTIPROC_DIR before it spawns the scheduler, and /metrics (main
process) aggregates every process's files with prometheus_client's MultiProcessCollector. So metrics created in the
scheduler need no exporter of their own. `start()` runs once per scheduler (hook on
`Scheduler.init_metrics_collector`) with SGLang's own decision for that rank, so tensor-parallel ranks do not count
the same request twice; until then, and when metrics are off, every function here is a no-op. Every series carries
`model_name` (--served-model-name, by default the model path) as its first label, as SGLang's own series do, so one
dashboard (docs/grafana/chunkcache.json) selects a served model across both.
"""

from __future__ import annotations

import threading

from sglang.srt.plugins.hook_registry import HookType
from sglang.srt.runtime_context import get_serving
from sglang.version import __version__ as sglang_version

from chunkcache import __version__
from chunkcache.blend.round_report import FALLBACKS

TIERS = ("host", "disk")  # the chunk store's tiers, as `tier` label values
# RemoteStats counters as chunkcache_remote_* series: field -> (series, help); the skip reasons share one series
REMOTE_COUNTERS = {
    "hits": ("chunkcache_remote_hits", "Chunk-store gets answered by the remote tier"),
    "misses": ("chunkcache_remote_misses", "Chunk-store gets the remote tier had no entry for"),
    "corrupt": ("chunkcache_remote_corrupt", "Remote entries that failed verification (counted misses, deleted)"),
    "forged": ("chunkcache_remote_forged", "Remote values without a valid authenticator: another secret, altered, "
               "moved or planted (counted misses, deleted)"),
    "already_stored": ("chunkcache_remote_already_stored", "Remote puts of a new entry whose key already held a "
                       "value, left as it was (SET NX)"),
    "errors": ("chunkcache_remote_errors", "Remote store commands that failed (down, timed out, refused)"),
    "outages": ("chunkcache_remote_outages", "Times the remote store went from working to failing"),
    "bytes_written": ("chunkcache_remote_bytes_written", "Bytes of entries stored in the remote tier"),
    "computed_instead": ("chunkcache_remote_computed_instead", "Chunks the local tiers lacked that were computed "
                         "without asking the remote tier: computing them was predicted faster (store.remote_fetch)"),
    "probes": ("chunkcache_remote_probes", "Fetches from a link judged slower than computing, to measure it again"),
}
NODE_COUNTERS = ("hits", "misses", "errors", "outages", "skipped", "writes")  # NodeStats fields, per node
REMOTE_SKIPS = {"skipped": "down", "oversize": "oversize", "full": "full", "dropped": "queue"}  # field -> reason
KL_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# measured minus estimated first-token KL (nats): negative where the estimate held, positive where it promised less
KL_ERROR_BUCKETS = (-1.0, -0.3, -0.1, -0.03, -0.01, -0.003, 0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


class _ModelSeries:
    """A labelled series with its `model_name` already given: `labels` takes the labels after it."""

    def __init__(self, metric, model_name: str):
        self.metric, self.model_name = metric, model_name

    def labels(self, *values: str):
        return self.metric.labels(self.model_name, *values)


class _Metrics:
    def __init__(self, model_name: str, registry=None):
        # Imported here, not at module level: prometheus_client picks single- or multi-process mode when it is
        # first imported, and this module is also imported by the main process before SGLang sets the directory.
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        def series(kind, name: str, doc: str, labels: tuple[str, ...] = (), **options):
            """A series labelled `model_name` first, as SGLang's own are (a dashboard selects one served model across
            both), then `labels`; recorded through the child of this server's name, or `_ModelSeries` with labels."""
            metric = kind(name, doc, ["model_name", *labels], registry=registry or REGISTRY, **options)
            return _ModelSeries(metric, model_name) if labels else metric.labels(model_name)

        # build info: 1, the versions in its labels (livemax: one series per server, whatever its schedulers)
        self.info = series(Gauge, "chunkcache_info", "chunkcache and SGLang versions of this server, as labels; "
                           "value 1", ("version", "sglang_version"), multiprocess_mode="livemax")
        self.info.labels(__version__, sglang_version).set(1)
        self.requests = series(Counter, "chunkcache_requests", "Requests served with chunk reuse, by selector",
                               ("selector",))
        self.chunk_hits = series(Counter, "chunkcache_chunk_hits", "Hinted chunks found in the chunk store")
        self.chunk_misses = series(Counter, "chunkcache_chunk_misses", "Hinted chunks computed and inserted")
        self.reused_tokens = series(Counter, "chunkcache_reused_tokens", "Prompt tokens whose KV was reused")
        self.recomputed_tokens = series(Counter, "chunkcache_recomputed_tokens", "Prompt tokens recomputed by the "
                                        "blend")
        self.select_seconds = series(Histogram, "chunkcache_select_seconds", "Token selection time per request",
                                     buckets=SECONDS_BUCKETS)
        self.blend_seconds = series(Histogram, "chunkcache_blend_seconds", "Blended prefill time per request, "
                                    "selection excluded", buckets=SECONDS_BUCKETS)
        self.estimated_kl = series(Histogram, "chunkcache_estimated_kl", "Fidelity estimate per blended request: the "
                                   "upper quantile of its first-token KL against full recompute, nats "
                                   "(chunkcache/blend/fidelity.py)", buckets=KL_BUCKETS)
        # livesum: with data parallelism each scheduler has its own store, and the total is what is held
        self.store_bytes = series(Gauge, "chunkcache_store_bytes", "Bytes held by the chunk store, by tier", ("tier",),
                                  multiprocess_mode="livesum")
        self.store_capacity = series(Gauge, "chunkcache_store_capacity_bytes", "Byte budget of the chunk store, by "
                                     "tier (0: the tier is off)", ("tier",), multiprocess_mode="livesum")
        self.evictions = series(Counter, "chunkcache_evictions", "Chunk store evictions (all tiers)")
        self.corrupt = series(Counter, "chunkcache_store_corrupt", "Disk entries dropped on read: unreadable, failing "
                              "verification or not fitting the model (each a counted miss)")
        self.disk_full = series(Counter, "chunkcache_store_disk_full", "Disk-tier writes refused because the disk was "
                                "full")
        self.fallbacks = series(Counter, "chunkcache_fallbacks", "Hinted requests computed in full, by reason",
                                ("reason",))
        for reason in FALLBACKS:  # every reason at 0 from the start: a rate over it is defined before the first
            self.fallbacks.labels(reason)
        self.exact = series(Counter, "chunkcache_exact_requests", "Requests with a chunkcache payload computed by the "
                            "model's own prefill at their asking, by reason (exact: `exact: true`; selector_full: "
                            "`selector: full`)", ("reason",))
        self.remote = {field: series(Counter, name, doc) for field, (name, doc) in REMOTE_COUNTERS.items()}
        self.remote_skipped = series(Counter, "chunkcache_remote_skipped", "Remote gets and puts not done, by reason "
                                     "(down: outage in progress; oversize, full: puts the server cannot take; queue: "
                                     "writer behind)", ("reason",))
        self.remote_up = series(Gauge, "chunkcache_remote_up", "1 while the remote store works, 0 during an outage",
                                multiprocess_mode="livemin")
        # cluster mode: one series per primary node (`node`: host:port)
        self.node_up = series(Gauge, "chunkcache_remote_node_up", "1 while a cluster node works, 0 during its outage",
                              ("node",))
        self.node = {field: series(Counter, f"chunkcache_remote_node_{field}", f"Remote store {field} on one cluster "
                                   "node", ("node",)) for field in NODE_COUNTERS}
        # each server's measured gets (the fetch-or-compute rule's inputs); `node`: host:port, or the one endpoint
        self.link_latency = series(Gauge, "chunkcache_remote_fetch_latency_seconds", "A remote get's measured fixed "
                                   "cost (round trip), per server", ("node",), multiprocess_mode="livemax")
        self.link_rate = series(Gauge, "chunkcache_remote_fetch_bytes_per_second", "A remote get's measured "
                                "bandwidth, per server", ("node",), multiprocess_mode="livemin")
        self.decode_cost = series(Gauge, "chunkcache_remote_decode_seconds_per_mb", "Decoding a fetched entry "
                                  "(verify, dequantise) per MB fetched, the third input of the rule",
                                  multiprocess_mode="livemax")
        self.auto_requests = series(Counter, "chunkcache_auto_requests", "Requests without a hint seen by automatic "
                                    "chunk detection, by outcome (blended: stored segments became its chunks; stock: "
                                    "too few, served as stock)", ("outcome",))
        self.auto_hits = series(Counter, "chunkcache_auto_segment_hits", "Prompt segments found in the chunk store by "
                                "automatic detection")
        self.auto_misses = series(Counter, "chunkcache_auto_segment_misses", "Prompt segments looked up and not found")
        self.auto_detect_seconds = series(Histogram, "chunkcache_auto_detect_seconds", "Automatic detection time per "
                                          "request (segmenting, radix match, store lookups)", buckets=SECONDS_BUCKETS)
        self.auto_learned = series(Counter, "chunkcache_auto_learned_segments", "Segments stored from prefilled "
                                   "prompts")
        self.auto_learned_bytes = series(Counter, "chunkcache_auto_learned_bytes", "Bytes of segments stored from "
                                         "prefilled prompts")
        self.auto_learn_seconds = series(Histogram, "chunkcache_auto_learn_seconds", "Storing one prompt's learned "
                                         "segments (the KV read out of the pool, the store's puts), after its output "
                                         "is sent", buckets=SECONDS_BUCKETS)
        # the online audit (sglang_patch/scheduler/audit.py); its gauges are the widest of the schedulers'
        self.audit_requests = series(Counter, "chunkcache_audit_requests", "Blended requests the online audit "
                                     "recomputed in full (audit.rate)")
        self.audit_unsafe = series(Counter, "chunkcache_audit_unsafe", "Audited requests whose measured first-token "
                                   "KL exceeded their bound (max_kl, else their own estimate)")
        self.audit_disagreements = series(Counter, "chunkcache_audit_disagreements", "Audited requests whose greedy "
                                          "first token was not full recompute's")
        self.audit_kl_error = series(Histogram, "chunkcache_audit_kl_error", "Measured minus estimated first-token KL "
                                     "per audited request, nats", buckets=KL_ERROR_BUCKETS)
        self.audit_seconds = series(Counter, "chunkcache_audit_seconds", "Seconds the audit's full recomputes took "
                                    "(run while the scheduler is idle)")
        self.audit_unsafe_share = series(Gauge, "chunkcache_audit_unsafe_share", "Share of the audit window's requests "
                                         "over their bound, at the last audit", multiprocess_mode="livemax")
        self.audit_margin = series(Gauge, "chunkcache_audit_margin", "The safety factor every fidelity estimate is "
                                   "multiplied by (audit.margin, widened by the audit)", multiprocess_mode="livemax")
        # the store counts cumulatively, the counters get the increments: the totals already counted
        self.store_seen: dict[str, int] = {}
        # snapshots come from the scheduler and the forward thread, either one first
        self.store_lock = threading.Lock()
        for tier in TIERS:
            self.store_bytes.labels(tier).set(0)  # series visible from startup, not only after the first chunk
            self.store_capacity.labels(tier).set(0)


_metrics: _Metrics | None = None


def hooks() -> list[tuple[str, object, HookType]]:
    """metrics' entry of plugin.hooks(): recording follows the scheduler's own --enable-metrics."""
    return [("sglang.srt.managers.scheduler.Scheduler.init_metrics_collector", _on_scheduler_init, HookType.AFTER)]


def _on_scheduler_init(result, scheduler, *args, **kwargs) -> None:
    # SGLang's own collectors read the name from the serving config, where it is resolved (the model path when not
    # given); the scheduler's server_args keep the flag as passed, None by default
    start(scheduler.metrics_collector_context.current_scheduler_metrics_enabled,
          model_name=get_serving().served_model_name)


def start(enabled: bool, *, model_name: str = "", registry=None) -> None:
    """Create the metrics (in `registry`, default prometheus_client's), every series labelled `model_name` (the
    server's --served-model-name, SGLang's label), if `enabled`; else turn recording off."""
    global _metrics
    _metrics = _Metrics(model_name, registry) if enabled else None


def record_request(info: dict) -> None:
    """Count one blended request from its round report (the dict that also goes to meta_info)."""
    m = _metrics
    if m is None:
        return
    m.requests.labels(info["selector"]).inc()
    m.chunk_hits.inc(info["chunk_hits"])
    m.chunk_misses.inc(info["chunk_misses"])
    m.reused_tokens.inc(info["reused_tokens"])
    m.recomputed_tokens.inc(info["recomputed_tokens"])
    m.select_seconds.observe(info["select_s"])
    m.blend_seconds.observe(info["blend_s"])
    if "kl" in info.get("fidelity", {}):  # an uncalibrated model's blends report {"fitted_for": None}, no estimate
        m.estimated_kl.observe(info["fidelity"]["kl"])


def record_exact(reason: str) -> None:
    """One request computed by the model's own prefill because it asked for exact KV."""
    if _metrics is not None:
        _metrics.exact.labels(reason).inc()


def record_auto_lookup(hits: int, misses: int, seconds: float) -> None:
    """One request's automatic detection: segments found and not found past its exact prefix."""
    m = _metrics
    if m is None:
        return
    m.auto_requests.labels("blended" if hits else "stock").inc()
    m.auto_hits.inc(hits)
    m.auto_misses.inc(misses)
    m.auto_detect_seconds.observe(seconds)


def record_auto_learned(segments: int, nbytes: int, seconds: float) -> None:
    """One prompt's learned segments stored: how many the store kept, their bytes, the seconds it took."""
    if _metrics is not None:
        _metrics.auto_learned.inc(segments)
        _metrics.auto_learned_bytes.inc(nbytes)
        _metrics.auto_learn_seconds.observe(seconds)


def record_audit(kl_error: float, unsafe: bool, agree: bool, seconds: float, window_share: float) -> None:
    """One audited request: its measured minus estimated KL, whether it was over its bound, whether its greedy first
    token was full recompute's, the full recompute's seconds, and the audit window's share over their bounds."""
    m = _metrics
    if m is None:
        return
    m.audit_requests.inc()
    m.audit_unsafe.inc(int(unsafe))
    m.audit_disagreements.inc(int(not agree))
    m.audit_kl_error.observe(kl_error)
    m.audit_seconds.inc(seconds)
    m.audit_unsafe_share.set(window_share)


def set_audit_margin(factor: float) -> None:
    if _metrics is not None:
        _metrics.audit_margin.set(factor)


def record_fallback(reason: str) -> None:
    """A hinted request served without reuse; `reason` is a short fixed token (a label value, keep the set small)."""
    if _metrics is not None:
        _metrics.fallbacks.labels(reason).inc()


def set_store_bytes(tier: str, n: int) -> None:
    if _metrics is not None:
        _metrics.store_bytes.labels(tier).set(n)


def set_store_capacity(store) -> None:
    """The store's byte budget per tier from its config (a `chunkcache.config.StoreConfig`), which fixes them when
    the store is built: the host tier's host_bytes, the disk tier's disk_bytes when it has a directory, else 0."""
    m = _metrics
    if m is None:
        return
    m.store_capacity.labels("host").set(store.host_bytes)
    m.store_capacity.labels("disk").set(store.disk_bytes if store.disk_dir else 0)


def set_store_stats(stats) -> None:
    """Store gauges, evictions, dropped entries and refused disk writes from a `chunkcache.store.StoreStats`
    snapshot: the store's `on_change` (sglang_patch.scheduler.cache)."""
    m = _metrics
    if m is None:
        return
    with m.store_lock:
        set_store_bytes("host", stats.memory_bytes)
        set_store_bytes("disk", stats.disk_bytes)
        _count_new(m, "evictions", stats.evictions, m.evictions)
        _count_new(m, "corrupt", stats.corrupt, m.corrupt)
        _count_new(m, "disk_full", stats.disk_full, m.disk_full)
        remote = stats.remote
        if remote is None:
            return
        m.remote_up.set(int(remote.up))
        for field in REMOTE_COUNTERS:
            _count_new(m, f"remote.{field}", getattr(remote, field), m.remote[field])
        for field, reason in REMOTE_SKIPS.items():
            _count_new(m, f"remote.{field}", getattr(remote, field), m.remote_skipped.labels(reason))
        _count_nodes(m, remote.nodes)
        if remote.decode_s_per_mb is not None:
            m.decode_cost.set(remote.decode_s_per_mb)
        links = [(remote.server, remote.link)] + [(node.node, node.link) for node in remote.nodes]
        for node, link in links:
            if link is not None:
                m.link_latency.labels(node).set(link.latency_s)
                m.link_rate.labels(node).set(link.bytes_per_s)


def _count_nodes(m: _Metrics, nodes) -> None:
    for node in nodes:
        m.node_up.labels(node.node).set(int(node.up))
        for field in NODE_COUNTERS:
            _count_new(m, f"remote.{node.node}.{field}", getattr(node, field), m.node[field].labels(node.node))


def _count_new(m: _Metrics, name: str, total: int, counter) -> None:
    """Add what `total` has beyond the largest total counted so far: an older snapshot arriving late adds nothing."""
    seen = m.store_seen.get(name, 0)
    if total > seen:
        counter.inc(total - seen)
        m.store_seen[name] = total
