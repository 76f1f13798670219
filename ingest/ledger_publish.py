"""How a ledger publishes to the shared view: one view slot's key set, and its net change within a write section
(pure; the view's writer is the KeySink).

Each slot is one bitset column of the view (cortex.ledger_view). A slot publishes the keys of one lane (the common
case: one full-attention group on the GPU), the intersection of several lanes (`every`: the groups of one
KV-cache spec, as vLLM's hit needs all of them) or their union (the copies of one tier). Changes are collected
as a net delta and flushed at the end of the ledger's write section (Ledger.deferred), removals before
additions, so a reader between two writes sees a subset of the worker's cache, never more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class KeySink(Protocol):
    """Where per-slot key membership is published (the shared view's writer)."""

    def add(self, worker: int, keys: list[int]) -> None: ...
    def remove(self, worker: int, keys: list[int]) -> None: ...
    def clear_worker(self, worker: int) -> None: ...


SlotAllocator = Callable[[], int | None]
"""Gives the ledger a free view slot for another KV-cache spec or tier of its target (None: none left)."""


class Member(Protocol):
    """A lane as the slot it publishes to sees it (ingest/ledger_lanes.py): its keys, and where it reports each
    key it starts (`gain`) or stops (`lose`) holding."""

    key_refs: dict[int, int]

    def hook(self, gain: Callable[[int], None], lose: Callable[[int], None]) -> None: ...


class Delta:
    """The net change of one slot's key set within a deferred section."""

    __slots__ = ("added", "cleared", "removed")

    def __init__(self) -> None:
        self.cleared = False
        self.added: dict[int, None] = {}
        self.removed: dict[int, None] = {}

    def add(self, key: int) -> None:
        if key in self.removed:  # removed then stored again within the batch: present before and after
            del self.removed[key]
        else:
            self.added[key] = None

    def remove(self, key: int) -> None:
        if key in self.added:  # stored then removed within the batch: absent before and after
            del self.added[key]
        else:
            self.removed[key] = None

    def clear(self) -> None:
        self.cleared = True
        self.added.clear()
        self.removed.clear()

    def flush(self, slot: int, sink: KeySink) -> None:
        if self.cleared:
            sink.clear_worker(slot)
        if self.removed:
            sink.remove(slot, list(self.removed))
        if self.added:
            sink.add(slot, list(self.added))
        self.cleared = False
        self.added = {}
        self.removed = {}


class PublishedSlot:
    """One slot's key set: its one lane's, or the intersection (`every`: the groups of one spec) or union (the
    copies of one tier) of several lanes'."""

    __slots__ = ("counts", "delta", "every", "lanes", "slot")

    def __init__(self, slot: int, every: bool) -> None:
        self.slot = slot
        self.every = every
        self.lanes: list[Member] = []
        self.delta = Delta()
        self.counts: dict[int, int] = {}
        """With more than one lane: per key, how many of them hold it."""

    def join(self, lane: Member) -> None:
        """A new lane (empty) joins. Into an intersection it removes every key (the new group holds none yet)."""
        if len(self.lanes) == 1:
            self.counts = dict.fromkeys(self.lanes[0].key_refs, 1)
        if self.every:
            for key in self.keys():
                self.delta.remove(key)
        self.lanes.append(lane)
        lane.hook(*((self.delta.add, self.delta.remove) if len(self.lanes) == 1 else (self._gain, self._lose)))
        if len(self.lanes) == 2:
            self.lanes[0].hook(self._gain, self._lose)

    def _gain(self, key: int) -> None:
        n = self.counts.get(key, 0) + 1
        self.counts[key] = n
        if n == (len(self.lanes) if self.every else 1):
            self.delta.add(key)

    def _lose(self, key: int) -> None:
        n = self.counts[key]
        if n == (len(self.lanes) if self.every else 1):
            self.delta.remove(key)
        if n == 1:
            del self.counts[key]
        else:
            self.counts[key] = n - 1

    def size(self) -> int:
        if len(self.lanes) == 1:
            return len(self.lanes[0].key_refs)
        need = len(self.lanes) if self.every else 1
        return sum(1 for n in self.counts.values() if n >= need)

    def keys(self) -> list[int]:
        if len(self.lanes) == 1:
            return list(self.lanes[0].key_refs)
        need = len(self.lanes) if self.every else 1
        return [k for k, n in self.counts.items() if n >= need]

    def forget(self) -> None:
        self.counts.clear()
        self.delta.clear()
