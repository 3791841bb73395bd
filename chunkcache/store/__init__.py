"""Content-addressed store of per-chunk KV: host-memory LRU tier in front of a checksummed disk tier."""

from .entry import ChunkEntry, EntryLayout, FingerprintMismatch
from .store import ChunkStore, Lookup, StoreStats

__all__ = ["ChunkEntry", "ChunkStore", "EntryLayout", "FingerprintMismatch", "Lookup", "StoreStats"]
