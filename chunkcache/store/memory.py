"""Host-memory tier: least-recently-used entries are evicted to keep the total under a byte budget.

With `pin`, a kept entry's K and V are moved to page-locked memory, so that the blend's copy into a GPU's pool runs
asynchronously at the link's speed instead of through a pageable staging buffer. Not locked itself: `ChunkStore`
serialises access.
"""

from __future__ import annotations

from collections import OrderedDict

from .entry import ChunkEntry


class MemoryTier:
    def __init__(self, budget_bytes: int, pin: bool = False):
        self.budget_bytes = budget_bytes
        self.pin = pin
        self.entries: OrderedDict[str, ChunkEntry] = OrderedDict()  # oldest use first
        # bytes charged at the last put: features written into an entry since then are not counted until it is put again
        self.sizes: dict[str, int] = {}
        self.bytes = 0
        self.evictions = 0

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> ChunkEntry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, entry: ChunkEntry) -> bool:
        """Insert (or refresh) an entry; False if it alone exceeds the budget and was not kept."""
        self.pop(entry.key)
        size = entry.nbytes
        if size > self.budget_bytes:
            return False
        while self.bytes + size > self.budget_bytes:
            old, _ = self.entries.popitem(last=False)
            self.bytes -= self.sizes.pop(old)
            self.evictions += 1
        if self.pin and not entry.k.is_pinned():
            entry.k, entry.v = entry.k.pin_memory(), entry.v.pin_memory()
        self.entries[entry.key] = entry
        self.sizes[entry.key] = size
        self.bytes += size
        return True

    def purge(self, tenant: str) -> int:
        doomed = [key for key, entry in self.entries.items() if entry.tenant == tenant]
        for key in doomed:
            self.pop(key)
        return len(doomed)

    def clear(self) -> int:
        n = len(self.entries)
        self.entries.clear()
        self.sizes.clear()
        self.bytes = 0
        return n

    def pop(self, key: str) -> ChunkEntry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= self.sizes.pop(key)
        return entry
