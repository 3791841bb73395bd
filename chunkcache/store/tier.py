"""What ChunkStore asks of a tier: the memory, disk and remote tiers satisfy these protocols, and so can another.

`Tier` is what every tier does, a shared one too: a get by key, a put. `LocalTier` is a tier this process holds
(memory, disk, or one passed as ChunkStore's `tiers`): ChunkStore asks its local tiers in order, key by key, under its
lock, promotes a hit into the tiers in front of the one that held it, writes every put through to all of them and
answers `key in store` from them alone. The remote tier (remote.py) is asked after them, outside the lock, with one
round trip for all the keys they lack; it is no LocalTier. A tier is not locked itself: ChunkStore serialises its
calls to local tiers.

Every tier purges a tenant (POST /chunkcache/purge: ChunkStore.purge); a local tier also empties (/flush_cache:
ChunkStore.clear), which the shared tier, other servers' too, never does.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .entry import ChunkEntry


@runtime_checkable
class Tier(Protocol):
    def get(self, key: str) -> ChunkEntry | None:
        """The entry under `key`, or None for a miss; never raises: an entry it cannot read or verify is dropped,
        counted, and a miss."""

    def put(self, entry: ChunkEntry) -> bool:
        """Store `entry` under its key (a local tier replaces what it held; the shared one keeps the first writer's
        value: remote.py); True once held or queued, False if refused (over the budget, the disk or queue full, an
        outage)."""

    def purge(self, tenant: str) -> int:
        """Remove every entry whose tenant digest (ChunkEntry.tenant, hashing.tenant_key of a namespace and salt) is
        `tenant`, and say how many; entries made outside a server's store carry none and are never purged. An entry
        it cannot read is left to the get that drops it; the shared tier raises when a server cannot be searched
        (remote.py)."""


@runtime_checkable
class LocalTier(Tier, Protocol):
    evictions: int  # entries dropped to keep within its budget (StoreStats.evictions sums them)

    def __contains__(self, key: str) -> bool:
        """Whether `key` is held, without reading the entry (admission asks for every chunk of every waiting
        request); a get may still miss (the entry turns out corrupt, another process removed it)."""

    def clear(self) -> int:
        """Remove every entry, and say how many (what it holds is this server's to drop: /flush_cache)."""
