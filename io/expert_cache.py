"""The expert cache's policy: which VRAM slot holds which (layer, expert), least-recently-used.

Pure Python bookkeeping, separate from the device slab so CI tests it without a GPU. The GPU
sources own one `ExpertCachePolicy` and one device arena of `n_slots` slots; for every selection
they ask `assign(layer, experts)` which slot each expert is in and which slots must be filled.

Rules:
- a hit refreshes the entry; a miss takes a free slot, else evicts the least recently used entry;
- an entry of the current selection is never evicted (so the returned slots are all valid at once);
- a selection with more distinct experts than slots is an error (the cache is too small to run).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Assignment:
    slots: list[int]                                  # slot of each requested expert, in request order
    fills: list[tuple[int, int]] = field(default_factory=list)   # (expert, slot) to load now
    evicted: list[tuple[int, int]] = field(default_factory=list)  # (layer, expert) entries dropped


class ExpertCachePolicy:
    def __init__(self, n_slots: int):
        if n_slots < 1:
            raise ValueError("an expert cache needs at least one slot")
        self.n_slots = n_slots
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()   # oldest first
        self._free = list(range(n_slots - 1, -1, -1))                  # pop() hands out slot 0 first
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._lru

    def slot_of(self, layer: int, expert: int) -> int | None:
        return self._lru.get((layer, expert))

    def assign(self, layer: int, experts) -> Assignment:
        keys = [(layer, int(e)) for e in experts]
        wanted = set(keys)
        if len(wanted) > self.n_slots:
            raise ValueError(f"selection of {len(wanted)} experts does not fit an expert cache of {self.n_slots} slots")
        out = Assignment(slots=[])
        given: dict[tuple[int, int], int] = {}
        for key in keys:
            if key in given:                      # the same expert twice in one selection
                out.slots.append(given[key])
                continue
            slot = self._lru.get(key)
            if slot is not None:
                self.hits += 1
                self._lru.move_to_end(key)
            else:
                self.misses += 1
                slot = self._take_slot(wanted, out)
                self._lru[key] = slot
                out.fills.append((key[1], slot))
            given[key] = slot
            out.slots.append(slot)
        return out

    def _take_slot(self, protected: set, out: Assignment) -> int:
        if self._free:
            return self._free.pop()
        for victim in self._lru:                  # oldest first
            if victim not in protected:
                slot = self._lru.pop(victim)
                self.evictions += 1
                out.evicted.append(victim)
                return slot
        raise AssertionError("unreachable: the selection fits, so an unprotected entry exists")

    def forget(self, layer: int, expert: int) -> None:
        """Drop an entry whose slot could not be filled (e.g. a failed read)."""
        slot = self._lru.pop((layer, expert), None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        self._lru.clear()
        self._free = list(range(self.n_slots - 1, -1, -1))
