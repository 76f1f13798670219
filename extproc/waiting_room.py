"""The waiting room: requests that wait for a worker with room, bounded, fair and with a time-to-live.

Pure: no I/O, no asyncio, no clock of its own (a call that needs the time is handed `now`), so every order it
produces is a function of the calls made (tests/test_waiting_room.py). extproc/room_glue.py owns one per process,
decides when a request must wait (`full`) and routes what this releases (docs/tenancy/waiting-room.md).

Who goes next, per pool (the model name the client sent: requests for one model never wait behind another's):
  1. the highest priority band with waiters (a tenant's `priority`);
  2. within the band, deficit round robin over the tenants waiting: a tenant's turn adds its quantum (its
     weight over the smallest weight waiting in the band, so every turn serves at least one request) to its
     deficit, each request served costs 1, and the turn passes on once the deficit is below 1 (the rest is kept
     for its next turn; a tenant that stops waiting loses it);
  3. within a tenant, first in, first out.
Bounds, over all pools: at most `max_requests` entries and `max_bytes` of their bodies. An arrival past either
makes way only by displacing a less deserving waiter (`victim`): the newest entry of the lowest band waiting,
from the tenant holding the most entries there, when that band is below the arrival's, or is the arrival's band
and that tenant holds at least two more entries than the arrival's tenant. A flooding tenant therefore cannot
take the whole room from a higher band or from a tenant with few requests; otherwise the arrival is refused,
never queued. Every entry leaves exactly once: released, expired (its deadline passed), cancelled (the client
went away) or displaced, recorded in `Entry.outcome`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

T = TypeVar("T")
Outcome = Literal["released", "expired", "cancelled", "displaced"]


def full(active: float, waiting: float, high_watermark: float, queue_depth: int | None) -> bool:
    """A worker with no room for one more request: at or over the high watermark (the `hot` threshold of
    extproc/policies/base.py, without its hysteresis: a worker one under the watermark takes one more), or its
    engine queue over `queue_depth` (None: the watermark alone)."""
    return active >= high_watermark or (queue_depth is not None and waiting > queue_depth)


@dataclass(eq=False, slots=True)
class Entry(Generic[T]):
    """One waiting request (compared by identity)."""

    seq: int
    """Arrival order in this room."""
    pool: str
    tenant: str
    band: int
    size: int
    """Bytes held for it (the request body)."""
    arrived: float
    deadline: float
    payload: T
    outcome: Outcome | None = None
    """None while it waits."""


@dataclass(slots=True)
class _Tenant(Generic[T]):
    id: str
    weight: float
    queue: deque[Entry[T]] = field(default_factory=deque)
    deficit: float = 0.0


@dataclass(slots=True)
class _Band(Generic[T]):
    tenants: dict[str, _Tenant[T]] = field(default_factory=dict)
    turns: deque[str] = field(default_factory=deque)
    """Tenants waiting, in round-robin order; the first one's turn it is."""
    charged: bool = False
    """The first tenant received its quantum for the current turn."""

    def quantum(self, t: _Tenant[T]) -> float:
        return t.weight / min(x.weight for x in self.tenants.values())

    def next(self) -> _Tenant[T]:
        head = self.tenants[self.turns[0]]
        if not self.charged or head.deficit >= 1 or len(self.turns) == 1:
            return head
        return self.tenants[self.turns[1]]  # its quantum is at least 1: it serves

    def take(self) -> Entry[T]:
        t = self.next()
        if self.turns[0] != t.id or (self.charged and t.deficit < 1):
            self.turns.rotate(-1)  # the turn passes on; the deficit left is kept
            self.charged = False
        if not self.charged:
            t.deficit += self.quantum(t)
            self.charged = True
        t.deficit -= 1
        entry = t.queue.popleft()
        if not t.queue:
            self._drop(entry.tenant)
        return entry

    def remove(self, entry: Entry[T]) -> None:
        t = self.tenants[entry.tenant]
        t.queue.remove(entry)
        if not t.queue:
            self._drop(entry.tenant)

    def _drop(self, tenant: str) -> None:
        if self.turns[0] == tenant:
            self.charged = False
        self.turns.remove(tenant)
        del self.tenants[tenant]


class WaitingRoom(Generic[T]):
    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        """Bounds checked at each arrival (a reload may change them; entries already in stay)."""
        self.count = 0
        self.bytes = 0
        self._seq = 0
        self._pools: dict[str, dict[int, _Band[T]]] = {}
        self._entries: dict[int, Entry[T]] = {}
        """Every waiting entry by seq (arrival order)."""

    def __len__(self) -> int:
        return self.count

    def offer(self, pool: str, tenant: str, band: int, weight: float, size: int, now: float, ttl_s: float,
              payload: T, displaced: list[Entry[T]] | None = None) -> Entry[T] | None:
        """Queue a request; None when it does not fit (count or bytes) and no waiter can make way: it is refused at
        once. Entries displaced to make way are appended to `displaced` (their requests are refused too)."""
        while self.count + 1 > self.max_requests or self.bytes + size > self.max_bytes:
            v = self.victim(tenant, band) if size <= self.max_bytes else None
            if v is None:
                return None
            self._bands_of(v).remove(v)
            self._leave(v, "displaced")
            if displaced is not None:
                displaced.append(v)
        self._seq += 1
        entry = Entry(self._seq, pool, tenant, band, size, now, now + ttl_s, payload)
        b = self._pools.setdefault(pool, {}).setdefault(band, _Band())
        t = b.tenants.get(tenant)
        if t is None:
            t = b.tenants[tenant] = _Tenant(tenant, weight)
            b.turns.append(tenant)
        t.weight = weight  # the latest arrival's (a reload may change it)
        t.queue.append(entry)
        self._entries[entry.seq] = entry
        self.count += 1
        self.bytes += size
        return entry

    def victim(self, tenant: str, band: int) -> Entry[T] | None:
        """Who makes way for an arrival of `tenant` in `band` when the room is full (module docstring), or None."""
        held: dict[tuple[int, str], list[Entry[T]]] = {}
        for e in self._entries.values():
            held.setdefault((e.band, e.tenant), []).append(e)
        if not held:
            return None
        lowest = min(b for b, _ in held)
        if lowest > band:
            return None
        most = max((k for k in held if k[0] == lowest), key=lambda k: (len(held[k]), -held[k][0].seq))
        if lowest == band and len(held[most]) < len(held.get((band, tenant), [])) + 2:
            return None
        return held[most][-1]

    def _bands_of(self, entry: Entry[T]) -> _Band[T]:
        return self._pools[entry.pool][entry.band]

    def pools(self) -> list[str]:
        """Pools with waiters, in the order they first had one."""
        return list(self._pools)

    def waiting(self, pool: str) -> bool:
        return pool in self._pools

    def peek(self, pool: str) -> Entry[T] | None:
        """Who goes next in `pool` (None: nobody waits there). Changes nothing."""
        bands = self._pools.get(pool)
        if not bands:
            return None
        return bands[max(bands)].next().queue[0]

    def release(self, entry: Entry[T]) -> None:
        """`entry` (what peek just returned) leaves, released."""
        if entry is not self.peek(entry.pool):
            raise ValueError("only the entry peek() returns can be released")
        bands = self._pools[entry.pool]
        taken = bands[entry.band].take()
        assert taken is entry
        self._leave(entry, "released")

    def cancel(self, entry: Entry[T]) -> bool:
        """`entry` leaves because its client did; False when it had already left."""
        if entry.outcome is not None:
            return False
        self._pools[entry.pool][entry.band].remove(entry)
        self._leave(entry, "cancelled")
        return True

    def expire(self, now: float) -> list[Entry[T]]:
        """The entries whose deadline is past (at or before `now`) leave, in arrival order."""
        out = [e for e in self._entries.values() if e.deadline <= now]
        for e in out:
            self._pools[e.pool][e.band].remove(e)
            self._leave(e, "expired")
        return out

    def depth(self) -> dict[int, int]:
        """Waiting entries per band, over all pools."""
        out: dict[int, int] = {}
        for e in self._entries.values():
            out[e.band] = out.get(e.band, 0) + 1
        return out

    def entries(self) -> list[Entry[T]]:
        """The waiting entries in arrival order."""
        return list(self._entries.values())

    def _leave(self, entry: Entry[T], outcome: Outcome) -> None:
        entry.outcome = outcome
        del self._entries[entry.seq]
        self.count -= 1
        self.bytes -= entry.size
        bands = self._pools[entry.pool]
        if not bands[entry.band].tenants:
            del bands[entry.band]
            if not bands:
                del self._pools[entry.pool]
