"""Predicted blocks: what a worker is about to cache because Cortex just sent it a prompt.

Between routing a request and the worker's BlockStored events reaching the ledger there are a few to a
few hundred milliseconds (prefill time). A burst of identical or sibling prompts arriving in that window
would otherwise see no holder and scatter across the fleet, each worker prefilling the same prefix. So
the blocks a routed prompt will create count as held by its target for a short TTL, for *choosing* a
worker only: they never count as a confirmed hit in headers or metrics, and confirmed events replace
them. Kept per extproc process (a sibling routed by another process does not see them).

Every record is also a touch on the replica's `TouchBoard` (cortex/inflight.py), shared by its processes: when
the worker last received each block from this replica, which the claim rule reads as the youngest the engine's
own use of that prefix can be (extproc/policies/claims.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from cortex.inflight import Touch, TouchBoard


class Predictions:
    def __init__(self, ttl_s: float = 2.0, max_keys: int = 200_000,
                 clock: Callable[[], float] = time.monotonic, touches: TouchBoard | None = None) -> None:
        self.ttl_s = ttl_s
        self.touches = touches
        self.max_keys = max_keys
        self.clock = clock
        # key -> {slot: expiry}; insertion order approximates age, so the oldest go first when full.
        self._held: OrderedDict[int, dict[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def record(self, slot: int, keys: Sequence[int], confirmed: int = 0, array: np.ndarray | None = None) -> None:
        """`keys` were just sent to `slot`: it holds them soon (a prediction), and used them now (a touch).

        The first `confirmed` of them the ledger already shows held there: they are touched but not predicted,
        since `extend` starts past a slot's confirmed run (a long conversation's earlier turns would otherwise
        cost a dictionary write per block per turn: ~2 ms at 128K tokens). `array`: the keys as uint64, if at hand."""
        if self.touches is not None and keys:
            self.touches.touch(slot, array if array is not None else np.asarray(keys, dtype=np.uint64), self.clock())
        if self.ttl_s <= 0:
            return
        expiry = self.clock() + self.ttl_s
        held = self._held
        for key in keys[confirmed:] if confirmed > 0 else keys:
            slots = held.get(key)
            if slots is None:
                held[key] = {slot: expiry}
            else:
                slots[slot] = expiry
                held.move_to_end(key)
        while len(held) > self.max_keys:
            held.popitem(last=False)

    def last_sent(self, slot: int, key: int) -> Touch | None:
        """When this replica last sent `key` to `slot`, and the evictions there since (None: not known)."""
        return None if self.touches is None else self.touches.last(slot, key, self.clock())

    def extend(self, keys: Sequence[int], slot: int, start: int) -> int:
        """How far the leading run of keys held by `slot` reaches, given `start` confirmed ones."""
        now = self.clock()
        held = self._held
        i = start
        n = len(keys)
        while i < n:
            slots = held.get(keys[i])
            if slots is None or slots.get(slot, 0.0) <= now:
                break
            i += 1
        return i

    def expire(self) -> None:
        """Drop expired entries (background upkeep, off the request path).

        Every record gives its keys the same TTL and moves them to the end, so the entries are in order of
        their latest expiry and the expired ones are a run at the front: the cost is what expired, not what
        is held (a full scan every 100 ms cost ~0.5 ms per 1,500 keys). After a TTL change the order can be
        off for one TTL; an expired entry left behind meanwhile is never used (`extend` checks the expiry).
        """
        now = self.clock()
        held = self._held
        while held:
            key, slots = next(iter(held.items()))
            if any(exp > now for exp in slots.values()):
                break
            del held[key]
