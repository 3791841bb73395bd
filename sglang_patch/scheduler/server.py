"""The scheduler side of chunk reuse: one `ChunkServer` per scheduler, the one owner of what changes while serving.

Built once with the scheduler's tree cache (sglang_patch.scheduler.cache), it holds the `ChunkReuse`
(chunkcache.blend.reuse: config, store, selectors, models, rates; fixed once built) and the runtime state:
  * `prefill_budget`: the scheduler's chunked-prefill size, set once when the scheduler resolves it (`start`);
  * `last_forward`: when the last extend forward ended (the idle gate's clock);
  * `audit`: the online audit (sglang_patch.scheduler.audit), when audit.rate > 0; `estimator` is what the blends
    read: the fitted fidelity estimator with the audit's margin applied;
  * `idle`: the one queue of idle work (chunkcache.blend.idle): deviations blends estimated, paragraphs prompts
    taught, blended requests sampled for the audit.
Requests reach it through `server_of(tree_cache)`; the hooks that run idle work are here (`on_idle`, `after_batch`), and
those of the admin routes (`after_flush`: /flush_cache under store.clear_on_flush; `on_control`: /chunkcache/purge).

Under tensor parallelism every rank holds its own replica, and every decision that fixes what a forward computes is
agreed (chunkcache.ranks). `start` refuses ranks whose config, fidelity estimator or host rates differ: the blends
read them on every rank and must read the same.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Sequence

from sglang.version import __version__ as sglang_version

from chunkcache import __version__
from chunkcache.blend import fidelity
from chunkcache.blend.auto import Encode
from chunkcache.blend.cost import rates_fingerprint
from chunkcache.blend.features import DeviationJob
from chunkcache.blend.idle import IdleWork, timed
from chunkcache.blend.pipeline import store_encode
from chunkcache.blend.reuse import ChunkReuse
from chunkcache.hashing import tenant_key

from . import metrics
from ..forward.forward_pass import Aside
from ..serve.launcher import BACKEND_NAME

log = logging.getLogger(__name__)
PURGE = "chunkcache.purge"  # the control request of POST /chunkcache/purge (sglang_patch.http.admin; `on_control`)
STORING = ("deviation", "encode")  # the idle jobs that store entries, which a flush or a purge drops


class ChunkServer:
    def __init__(self, reuse: ChunkReuse):
        self.reuse = reuse
        self.prefill_budget: int | None = None  # tokens one fill forward may compute; None: unbounded
        self.last_forward = 0.0  # time.monotonic() at the end of the last extend forward
        self.audit = None  # sglang_patch.scheduler.audit.Audit, when audit.rate > 0 (`start`)
        config = reuse.config
        self.idle = IdleWork(reuse.ranks, {"deviation": config.idle.deviations, "encode": config.auto.encode_queue,
                                           "audit": config.audit.keep})
        metrics.set_store_capacity(config.store)  # the store's tiers were built to these budgets (from_config)

    def start(self, chunked_prefill_size: int | None, audit=None) -> None:
        """Once, when the scheduler has resolved its chunked-prefill size: the budget, the audit, and the ranks'
        agreement on what every blend reads (a rank that differs stops every rank's start with the reason)."""
        self.prefill_budget = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        self.audit = audit
        self.reuse.ranks.check_alike(self.facts())

    def facts(self) -> dict[str, str]:
        """What every rank's blends read and must read alike, as fingerprints."""
        return {"config": self.reuse.config.fingerprint(),
                "fidelity estimator": fidelity.estimator_fingerprint(self.reuse.fidelity),
                "host rates": rates_fingerprint(self.reuse.rates)}

    @property
    def estimator(self) -> fidelity.Model | None:
        """The fidelity estimator the blends read: the fitted one, with the audit's margin when it audits."""
        return self.reuse.fidelity if self.audit is None else self.audit.served

    def defer(self, jobs: Sequence[DeviationJob]) -> None:
        """Deviations a blend estimated, measured when idle (every rank's blend agreed them)."""
        for job in jobs:  # a request's entries are one tenant's
            self.idle.put("deviation", functools.partial(self._measure, job),
                          tenant=job.entries[0].tenant if job.entries else "")

    def teach(self, encodes: Sequence[Encode], model_runner, forward_batch) -> None:
        """Paragraphs a batch's prompts taught (agreed over the ranks), each computed when idle or starved by an
        Aside of that batch; a paragraph already waiting is not queued twice."""
        exact_kv = self.aside(model_runner, forward_batch).kv
        for encode in encodes:
            self.idle.put("encode", functools.partial(self._encode, encode, exact_kv), key=encode.keys,
                          tenant=encode.tenant)

    def flush(self) -> dict[str, int]:
        """/flush_cache under store.clear_on_flush, once SGLang's own flush succeeded (every rank flushes alike): this
        rank's local tiers emptied, the idle jobs that would store entries dropped, automatic detection's sightings
        forgotten. The shared tier keeps its entries: other servers read and write them too. Per local tier and for
        the jobs, how many."""
        dropped = self.idle.drop(STORING)
        if self.reuse.auto is not None:
            self.reuse.auto.forget()
        return {**self.reuse.store.clear(), "idle_jobs": dropped}

    def purge(self, namespace: str | None, cache_salt: str | None) -> dict[str, int]:
        """POST /chunkcache/purge, on every rank: the tenant's idle jobs dropped and the sightings forgotten (alike on
        every rank), then its entries removed from every rank's local tiers, and from the shared tier by rank 0
        (every rank's shard is keyed there, and every model's: remote.py). Per tier, the entries removed over all
        ranks (a rank's shard of a chunk is an entry of its own); `idle_jobs`, the jobs dropped. A rank's failure
        raises RanksFailed on every rank, with what it removed removed."""
        tenant = tenant_key(namespace or self.reuse.config.store.namespace, cache_salt)
        dropped = self.idle.drop(STORING, tenant)
        if self.reuse.auto is not None:
            self.reuse.auto.forget()
        ranks = self.reuse.ranks
        parts = ranks.agree(lambda: self.reuse.store.purge(tenant, remote=ranks.rank == 0), list)
        removed = {tier: sum(part.get(tier, 0) for part in parts) for part in parts for tier in part}
        return {**removed, "idle_jobs": dropped}

    def run_idle(self) -> None:
        """One step of an idle job (the caller's gate is agreed over the ranks)."""
        self.idle.run_one()

    def aside(self, model_runner, forward_batch) -> Aside:
        """What an idle job keeps of the batch that queued it: its forwards, a slice of idle.slice_tokens at most."""
        return Aside(model_runner, forward_batch, self.reuse.config.idle.slice_tokens)

    def _measure(self, job: DeviationJob):
        """A deferred deviation measured (a forward of every rank per step) and written through every tier; a store
        write involves no other rank, so its failure is this rank's alone: logged, the chunk estimated again next
        use."""
        gained = yield from job.run()
        for key, feats in gained.items():
            try:
                self.reuse.store.add_features(key, feats)
            except Exception:  # noqa: BLE001 - an optimisation of later selections
                log.exception("chunkcache: storing chunk %s's measured deviation failed", key)

    def _encode(self, encode: Encode, exact_kv):
        """A taught paragraph encoded (a slice per step) and stored, unless every rank's store holds all its segments
        by now (another prompt's encode stored them)."""
        if all(self.reuse.held(list(encode.keys))):
            return
        kv, seconds = yield from timed(exact_kv(encode.token_ids))
        learned = store_encode(self.reuse.store, encode, kv, self.reuse.fingerprint, seconds)
        metrics.record_auto_learned(learned["segments"], learned["bytes"], learned["seconds"])

    def state(self, tree_cache) -> dict:
        """What /server_info reports under internal_states[i]['chunkcache'] (under `report.to_clients: private`, the
        backend alone: `private_state`)."""
        reuse = self.reuse
        if reuse.config.report.to_clients == "private":
            return private_state(type(tree_cache).__name__)
        return {"backend": BACKEND_NAME, "tree_cache": type(tree_cache).__name__, "scheduler_pid": os.getpid(),
                "version": __version__, "sglang_version": sglang_version,
                "config": reuse.config.effective(),  # what this scheduler runs on, secrets masked
                # what a max_kl bounds: the estimator the blends read (fitted_for null: none, max_kl computes in
                # full), the answer tokens it covers, the rho it chooses from and whether a first-token bound
                # (kl_over: first_token) has an estimator; the audit's margin multiplies every answer estimate
                "fidelity": {"fitted_for": None if self.estimator is None else self.estimator.name,
                             "covers": None if self.estimator is None else self.estimator.covers,
                             "ratios": None if self.estimator is None else list(self.estimator.ratios),
                             "first_token": self.estimator is not None and self.estimator.first_token is not None,
                             "margin": 1.0 if self.audit is None else self.audit.margin.factor},
                "store": dataclasses.asdict(reuse.store.stats()),
                "deferred_deviations": self.idle.waiting("deviation"),  # estimated, to be measured when idle
                "encodes_waiting": self.idle.waiting("encode"),  # paragraphs prompts taught, encoded when idle
                "audits_waiting": self.idle.waiting("audit"),  # blended requests sampled, recomputed when idle
                # the blend-or-full choice's fit to this server's forwards: a fixed time per forward, a scale per side
                "calibration": reuse.calibration.state(),
                # a chunk's measured compute cost, priced against a remote fetch (store.remote_fetch)
                "compute_s_per_token": reuse.compute.per_token_s,
                "kv_pool": {"available": int(tree_cache.token_to_kv_pool_allocator.available_size()),
                            "evictable": int(tree_cache.evictable_size()),
                            "protected": int(tree_cache.protected_size())}}


def private_state(tree_cache: str) -> dict:
    """/server_info's chunkcache state for clients that must not learn each other's traffic: which backend
    serves, nothing that moves with what requests sent. Dropped: the store's counters (entries, bytes, hits,
    misses, remote fetches and writes), the idle work waiting (queued by blends and by the prompts that teach), the
    blend-or-full calibration and the measured compute cost (refitted by each blend, each chunk computed) and the KV
    pool's evictable and protected tokens (the radix tree's contents). /metrics keeps the store's and the blends'
    counters (chunkcache_store_*, chunkcache_remote_*, chunkcache_chunk_*, ...); the rest is /server_info's alone, so
    a private server does not show it."""
    return {"backend": BACKEND_NAME, "tree_cache": tree_cache, "scheduler_pid": os.getpid(), "private": True}


def server_of(tree_cache) -> ChunkServer | None:
    """The scheduler's chunk server, None when its tree cache is not chunkcache's (a stock server)."""
    return getattr(tree_cache, "chunk_server", None)


def reuse_of(tree_cache) -> ChunkReuse | None:
    """The scheduler's chunk reuse, None on a stock server."""
    server = server_of(tree_cache)
    return None if server is None else server.reuse


def on_idle(scheduler, *args, **kwargs) -> None:
    """BEFORE hook on Scheduler.on_idle: one step of an idle job once the scheduler has been fully idle idle.after_s
    since its last forward. The queue and the scheduler's idleness are the same on every rank (replicas of one state
    machine, chunkcache.ranks); the idle time is rank 0's, so that every rank enters the step's forward."""
    server = server_of(scheduler.tree_cache)
    if server is None or not server.idle.waiting() or not scheduler.is_fully_idle():
        return
    after = server.reuse.config.idle.after_s
    if server.reuse.ranks.agree(lambda: time.monotonic() - server.last_forward >= after):
        server.run_idle()


def after_batch(_, scheduler, batch, result, *args, **kwargs) -> None:
    """AFTER hook on Scheduler.process_batch_result(batch, result): the audit keeps what its sampled requests' answers
    were served from (audit.Audit.after_batch); and a server that is never idle takes one step of encoding a waiting
    paragraph once the oldest has waited auto.encode_starved_s (by rank 0's clock), now that the batch's outputs are
    sent: the next batch waits one slice's forward."""
    server = server_of(scheduler.tree_cache)
    if server is not None and server.audit is not None:
        server.audit.after_batch(batch, result)
    if server is None or not server.idle.waiting("encode"):
        return
    limit = server.reuse.config.auto.encode_starved_s
    if limit and server.reuse.ranks.agree(lambda: server.idle.waited("encode") >= limit):
        server.idle.run_one(("encode",))


def after_flush(flushed, scheduler, *args, **kwargs) -> bool | None:
    """AFTER hook on Scheduler.flush_cache (True when it flushed; a flush with requests in flight does nothing): with
    store.clear_on_flush, the chunk server's local tiers and learned state follow SGLang's caches (ChunkServer.flush).
    A failure makes the flush answer as failed."""
    server = server_of(scheduler.tree_cache)
    if not flushed or server is None or not server.reuse.config.store.clear_on_flush:
        return None
    try:
        removed = server.flush()
    except Exception:  # noqa: BLE001 - the scheduler must outlive it; the client is told the flush failed
        log.exception("chunkcache: emptying the chunk store on /flush_cache failed")
        return False
    log.info("chunkcache: /flush_cache emptied the chunk store's local tiers (the shared tier keeps its entries): %s",
             removed)
    return None


def on_control(original, scheduler, recv_req, *args, **kwargs):
    """AROUND hook on Scheduler.handle_dumper_control: SGLang's dumper control request (a method name and a JSON
    body, fanned out to every data-parallel scheduler by TokenizerManager.dumper_control, received by every
    tensor-parallel rank, the reply sent by rank 0) carries POST /chunkcache/purge (method PURGE), answered here
    with the entries removed per tier; any other method is SGLang's."""
    if recv_req.method != PURGE:
        return original(scheduler, recv_req, *args, **kwargs)
    from sglang.srt.managers.io_struct import DumperControlReqOutput

    server = server_of(scheduler.tree_cache)
    if server is None:
        return DumperControlReqOutput(success=False, response=[], error="this server serves without chunk reuse: "
                                      "it has no chunk store to purge")
    body = recv_req.body
    try:
        removed = server.purge(body.get("namespace"), body.get("cache_salt"))
    except Exception as exc:  # noqa: BLE001 - the scheduler must outlive it; the client gets the reason
        log.exception("chunkcache: purging a tenant failed")
        return DumperControlReqOutput(success=False, response=[], error=f"{type(exc).__name__}: {exc}")
    log.info("chunkcache: purged tenant (namespace %r, %s): %s", body.get("namespace"),
             "salted" if body.get("cache_salt") else "no salt", removed)
    return DumperControlReqOutput(success=True, response=[removed])


def report_state(result, controller, *args, **kwargs):
    """AFTER hook on /server_info's internal state: which backend really serves, and its state."""
    tree_cache = controller.scheduler.tree_cache
    server = server_of(tree_cache)
    result.internal_state["chunkcache"] = server.state(tree_cache) if server is not None else {
        "backend": None, "tree_cache": type(tree_cache).__name__}
    return result
