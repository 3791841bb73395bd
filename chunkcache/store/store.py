"""ChunkStore: host memory in front of an optional disk tier and an optional remote tier (a Redis-protocol server,
or a cluster of them, shared by every chunkcache server); further local tiers (tier.py's LocalTier), if given, sit
between the disk and the remote tier.

Contract:
- get looks in memory, then disk, then remote, and promotes a hit into the tiers in front; get_many does so for a
  request's keys with one remote round trip (per cluster node) for all the keys the local tiers lack. lookup does
  what get_many does and, given what computing each key's chunk would cost here, asks the remote tier only for the
  keys its fetch rule finds faster to fetch (remote.py: fetch or compute), saying which it fetched and which not.
- put writes through to every tier (to the remote one in the background, and only where it holds no value for the
  key: remote.py) and says whether a local tier kept the entry. False: memory refused it (alone over the host
  budget) and so did the disk (over its budget, full) or there is none; a later get finds it only on the remote
  tier, if at all, and the caller's copy may be the only one.
- Memory holds `host_bytes` at most, every entry charged its `nbytes` as of its last put or add_features. A selector
  keeps per-chunk features by writing into an entry's `features` (Features.chunk_features); the engine then calls
  add_features, which charges them and writes the grown entry through to disk and remote (the one put that replaces
  the remote tier's value). Features written but not yet added are neither charged nor seen by another process.
- A store bound to a model raises FingerprintMismatch for another model's entry, on put and on get.
- `compress` (`store.compress`: none, int8, int4) is how the disk and remote tiers write K and V (codec.py); they
  read any entry, compressed or not, and a hit they serve is promoted decoded: memory holds full-width KV only.
- purge removes one tenant's entries from every tier, the shared one included (POST /chunkcache/purge); clear empties
  the local tiers only (/flush_cache): the shared tier is other servers' store too.
- `on_change`, if given, gets a stats snapshot after every get_many, put, add_features, purge and clear (the operations
  that move bytes, evict, drop corrupt entries or count), from whichever thread made the call; what the remote tier's writer
  thread does in the background shows in the snapshot after the next operation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..config import StoreConfig
from . import codec
from .cluster import ClusterTier, is_cluster_url
from .disk import DiskTier
from .entry import ChunkEntry, EntryLayout
from .memory import MemoryTier
from .remote import RemoteStats, RemoteTier, key_prefix
from .tier import LocalTier


@dataclass(frozen=True)
class Lookup:
    entries: dict[str, ChunkEntry]  # what any tier held, by key
    fetched: frozenset[str]  # of those, the remote tier's
    computed_instead: frozenset[str]  # keys the local tiers lack that the remote tier was not asked for: computing
    # them was predicted faster (it may or may not hold them)


@dataclass(frozen=True)
class StoreStats:
    hits: int  # gets answered by any tier
    misses: int
    memory_hits: int
    disk_hits: int
    remote_hits: int
    evictions: int  # all local tiers
    memory_entries: int
    memory_bytes: int
    disk_entries: int
    disk_bytes: int
    corrupt: int  # disk entries dropped because they failed verification
    disk_full: int  # writes refused because the disk was full
    remote: RemoteStats | None  # the remote tier's own counters; None without one


class ChunkStore:
    def __init__(
        self,
        host_bytes: int = 2 << 30,
        disk_dir: str | None = None,
        disk_bytes: int = 20 << 30,
        model_fingerprint: str | None = None,
        remote: RemoteTier | None = None,
        layout: EntryLayout | None = None,
        on_change: Callable[[StoreStats], None] | None = None,
        pin_memory: bool = False,
        compress: str = "none",
        tiers: Sequence[LocalTier] = (),
    ):
        """`model_fingerprint`, if given, binds the store to one model: entries of any other are refused. `layout`,
        if given, is the model's KV layout: a disk or remote entry that does not fit it is dropped on read.
        `on_change`: see the contract above. `pin_memory`: the memory tier keeps KV page-locked (MemoryTier).
        `compress`: how the disk tier writes KV (a remote tier is given its own). `tiers`: local tiers asked after
        the disk, in this order (their hits count in `hits` only)."""
        self.memory = MemoryTier(host_bytes, pin_memory)
        self.disk = DiskTier(disk_dir, disk_bytes, layout, codec.named(compress)) if disk_dir else None
        self.remote = remote
        # the local tiers in lookup order: a hit is promoted into those in front of its tier, a put written to all
        self.tiers: tuple[LocalTier, ...] = (self.memory, *([self.disk] if self.disk is not None else []), *tiers)
        self.model_fingerprint = model_fingerprint
        self.on_change = on_change
        self._lock = threading.Lock()
        self._hits = self._misses = self._remote_hits = 0
        self._tier_hits = [0] * len(self.tiers)  # per local tier, in `tiers` order

    @classmethod
    def from_config(cls, config: StoreConfig, model_fingerprint: str | None = None, layout: EntryLayout | None = None,
                    on_change: Callable[[StoreStats], None] | None = None) -> "ChunkStore":
        remote = None
        if config.remote_url:
            tier = ClusterTier if is_cluster_url(config.remote_url) else RemoteTier
            remote = tier(config.remote_url, key_prefix(model_fingerprint), config.remote_timeout_s,
                          config.remote_retry_s, config.remote_max_value_bytes, config.remote_write_queue, layout,
                          codec.named(config.compress), config.remote_fetch, config.remote_probe_s,
                          secret=config.remote_secret())  # ConfigError saying what to set when there is none
        pin = torch.cuda.is_available() if config.pin_memory is None else config.pin_memory
        if pin and not torch.cuda.is_available():
            raise ValueError("store.pin_memory: true needs a CUDA device (page-locked memory is CUDA's); "
                             "leave it unset to pin only where one is present")
        return cls(config.host_bytes, config.disk_dir, config.disk_bytes, model_fingerprint, remote, layout, on_change,
                   pin, config.compress)

    def get(self, key: str) -> ChunkEntry | None:
        return self.get_many([key]).get(key)

    def get_many(self, keys: list[str]) -> dict[str, ChunkEntry]:
        """The entries any tier holds for `keys` (each looked up once): memory, then disk, then the remote tier in
        one round trip (per cluster node) for all the keys the local tiers lack."""
        return self.lookup(keys).entries

    def lookup(self, keys: list[str], costs: dict[str, tuple[int, float | None]] | None = None) -> Lookup:
        """get_many's entries, the remote tier asked only for the keys its rule finds worth fetching given `costs`
        (key -> (the chunk's tokens, seconds to compute it here; None: unknown)); without costs, for every key."""
        keys = list(dict.fromkeys(keys))
        found: dict[str, ChunkEntry] = {}
        with self._lock:
            for key in keys:
                for depth, tier in enumerate(self.tiers):
                    if (entry := tier.get(key)) is not None:
                        self._tier_hits[depth] += 1
                        self._promote(entry, self.tiers[:depth])
                        found[key] = entry
                        break
        absent = [key for key in keys if key not in found]
        remote: dict[str, ChunkEntry] = {}
        asked = absent
        if absent and self.remote is not None:
            if costs is not None:
                asked = self.remote.choose({key: costs.get(key, (0, None)) for key in absent})
            # outside the lock: a network round trip (at most the remote timeout)
            remote = self.remote.get_many(asked)
            with self._lock:
                for entry in remote.values():
                    self._remote_hits += 1
                    self._promote(entry, self.tiers)
            found.update(remote)
        with self._lock:
            self._hits += len(found)
            self._misses += len(keys) - len(found)
        self._changed()
        if self.model_fingerprint is not None:
            for entry in found.values():
                entry.check_model(self.model_fingerprint)
        return Lookup(found, frozenset(remote), frozenset(absent) - frozenset(asked))

    def put(self, entry: ChunkEntry) -> bool:
        """Write through to every tier; False if no local tier kept the entry (see the contract above). An entry
        that is not what its key names (ChunkEntry.check_key) is refused: ValueError."""
        if self.model_fingerprint is not None:
            entry.check_model(self.model_fingerprint)
        entry.check_key()
        with self._lock:
            kept = self._put_local(entry)
        if self.remote is not None:
            self.remote.put(entry)
        self._changed()
        return kept

    def add_features(self, key: str, features: dict[str, torch.Tensor]) -> bool:
        """Add `features` (replacing any of the same name) to the entry stored under `key`, the one in memory else
        the disk's, and put the grown entry again: charged to the host budget (evicting older entries, or dropping
        this one if it no longer fits alone), rewritten on disk, re-sent to the remote tier. False if no local tier
        holds `key` any more (the features are lost and recomputed when next asked for) or none kept the grown
        entry."""
        kept = False
        with self._lock:
            entry = next((held for tier in self.tiers if (held := tier.get(key)) is not None), None)
            if entry is not None:
                entry.features.update(features)
                kept = self._put_local(entry)
        if entry is not None and self.remote is not None:
            self.remote.put(entry, replace_value=True)  # the one put that replaces the shared tier's value
        self._changed()  # a miss too: the disk drops a corrupt entry while looking
        return kept

    def _put_local(self, entry: ChunkEntry) -> bool:
        """Write through to every local tier; True if any kept it."""
        kept = [tier.put(entry) for tier in self.tiers]  # each one written, whatever those before answered
        return any(kept)

    @staticmethod
    def _promote(entry: ChunkEntry, tiers: Iterable[LocalTier]) -> None:
        """Copy a hit into the tiers in front of the one that served it; one refusing it (over budget) is no error."""
        for tier in tiers:
            tier.put(entry)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.stats())

    def purge(self, tenant: str, remote: bool = True) -> dict[str, int]:
        """Remove every entry of `tenant` (hashing.tenant_key of a namespace and salt) from each local tier and, with
        `remote`, from the shared one (every server's and model's entries of it there: remote.py); per tier
        (`memory`, `disk`, `tier<i>` for a further local tier at `tiers[i]`, `remote`), the entries removed. The local tiers go
        first: a shared tier that cannot be searched raises (redis.RedisError) with them already purged."""
        if not tenant:
            raise ValueError("purge needs a tenant digest (hashing.tenant_key); entries without one have no tenant")
        with self._lock:
            removed = {name: tier.purge(tenant) for name, tier in zip(self._tier_names(), self.tiers)}
        self._changed()
        if remote and self.remote is not None:
            removed["remote"] = self.remote.purge(tenant)
        return removed

    def clear(self) -> dict[str, int]:
        """Empty every local tier (/flush_cache); the shared tier holds other servers' entries too and keeps them.
        Per local tier, the entries removed."""
        with self._lock:
            removed = {name: tier.clear() for name, tier in zip(self._tier_names(), self.tiers)}
        self._changed()
        return removed

    def _tier_names(self) -> list[str]:
        """The local tiers' names in `tiers` order: further tiers by their place in it."""
        names = ["memory", "disk"] if self.disk is not None else ["memory"]
        return names + [f"tier{i}" for i in range(len(names), len(self.tiers))]

    def room(self) -> int:
        """Bytes the host-memory tier takes before it evicts."""
        with self._lock:
            return self.memory.budget_bytes - self.memory.bytes

    def __contains__(self, key: str) -> bool:
        """Local tiers only: admission asks this for every chunk of every waiting request, too often for a network
        round trip each; a chunk only the remote tier holds is charged as compute there, and found by get."""
        with self._lock:
            return any(key in tier for tier in self.tiers)

    def stats(self) -> StoreStats:
        with self._lock:
            disk = self.disk
            on_disk = disk is not None
            return StoreStats(
                hits=self._hits,
                misses=self._misses,
                memory_hits=self._tier_hits[0],  # memory is always the first tier, the disk (if any) the second
                disk_hits=self._tier_hits[1] if on_disk else 0,
                remote_hits=self._remote_hits,
                evictions=sum(tier.evictions for tier in self.tiers),
                memory_entries=len(self.memory),
                memory_bytes=self.memory.bytes,
                disk_entries=len(disk) if on_disk else 0,
                disk_bytes=disk.bytes if on_disk else 0,
                corrupt=disk.corrupt if on_disk else 0,
                disk_full=disk.disk_full if on_disk else 0,
                remote=self.remote.stats() if self.remote is not None else None,
            )
