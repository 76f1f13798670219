"""The waiting room as a pure structure (extproc/waiting_room.py): vectors for the exact order, and properties
over random interleavings of arrivals, releases, cancellations and the clock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.waiting_room import Entry, WaitingRoom, full


def names(entries: list[Entry[str]]) -> list[str]:
    return [e.payload for e in entries]


def drain(room: WaitingRoom[str], pool: str = "m") -> list[str]:
    out = []
    while (e := room.peek(pool)) is not None:
        room.release(e)
        out.append(e.payload)
    return out


def test_full_is_the_watermark_or_the_engine_queue() -> None:
    assert not full(3, 0, 4, None)
    assert full(4, 0, 4, None)  # at the watermark: no room for one more
    assert full(9, 100, 4, None)
    assert not full(2, 5, 4, 5)
    assert full(2, 6, 4, 5)  # engine queue over the depth
    assert full(2, 1, 4, 0)


def test_a_full_room_makes_way_for_a_higher_band_or_a_smaller_tenant() -> None:
    room: WaitingRoom[str] = WaitingRoom(3, 1 << 20)
    a = [room.offer("m", "a", 0, 1.0, 10, 0.0, 30, f"a{i}") for i in range(1, 4)]
    gone: list[Entry[str]] = []
    # A higher band displaces the lowest band's newest entry of the tenant holding the most.
    assert room.offer("m", "vip", 5, 1.0, 10, 0.0, 30, "v1", gone) is not None
    assert names(gone) == ["a3"] and a[2] is not None and a[2].outcome == "displaced"
    # In the same band, a tenant holding none displaces one holding at least two more than it.
    gone.clear()
    assert room.offer("m", "b", 0, 1.0, 10, 0.0, 30, "b1", gone) is not None
    assert names(gone) == ["a2"]
    # a holds 1, b holds 1: nobody holds two more, and a flooding tenant cannot push out a smaller one.
    assert room.offer("m", "a", 0, 1.0, 10, 0.0, 30, "a4", gone) is None
    assert room.offer("m", "b", 0, 1.0, 10, 0.0, 30, "b2", gone) is None
    # Nobody in a lower band makes way for a lower band's arrival, nor for its own band's equal share.
    assert room.offer("m", "low", -1, 1.0, 10, 0.0, 30, "l1", gone) is None
    assert drain(room) == ["v1", "a1", "b1"]
    assert (room.count, room.bytes) == (0, 0)


def test_bytes_make_way_too_but_never_for_an_arrival_larger_than_the_room() -> None:
    room: WaitingRoom[str] = WaitingRoom(100, 100)
    room.offer("m", "a", 0, 1.0, 40, 0.0, 30, "a1")
    room.offer("m", "a", 0, 1.0, 40, 0.0, 30, "a2")
    gone: list[Entry[str]] = []
    assert room.offer("m", "vip", 1, 1.0, 70, 0.0, 30, "v1", gone) is not None
    assert names(gone) == ["a2", "a1"] and room.bytes == 70
    assert room.offer("m", "vip2", 9, 1.0, 101, 0.0, 30, "huge", gone) is None


def test_priority_band_first_then_weighted_turns_then_fifo() -> None:
    room: WaitingRoom[str] = WaitingRoom(100, 1 << 20)
    for i in range(1, 5):
        room.offer("m", "a", 0, 2.0, 10, 0.0, 30, f"a{i}")
    for i in range(1, 3):
        room.offer("m", "b", 0, 1.0, 10, 0.0, 30, f"b{i}")
    room.offer("m", "vip", 5, 1.0, 10, 0.0, 30, "vip1")
    # vip's band first; then a (weight 2) serves two per turn, b one.
    assert drain(room) == ["vip1", "a1", "a2", "b1", "a3", "a4", "b2"]
    assert len(room) == 0 and room.bytes == 0 and room.pools() == []


def test_equal_weights_alternate_and_fractional_weights_accumulate() -> None:
    room: WaitingRoom[str] = WaitingRoom(100, 1 << 20)
    for i in range(3):
        room.offer("m", "a", 0, 1.0, 1, 0.0, 30, f"a{i}")
        room.offer("m", "b", 0, 1.0, 1, 0.0, 30, f"b{i}")
    assert drain(room) == ["a0", "b0", "a1", "b1", "a2", "b2"]
    for i in range(5):
        room.offer("m", "x", 0, 1.5, 1, 0.0, 30, f"x{i}")
        room.offer("m", "y", 0, 1.0, 1, 0.0, 30, f"y{i}")
    # x's quantum is 1.5: one, then two (1.5 - 1 + 1.5), then one ... as y serves one per turn.
    assert drain(room)[:7] == ["x0", "y0", "x1", "x2", "y1", "x3", "y2"]


def test_pools_do_not_wait_behind_each_other() -> None:
    room: WaitingRoom[str] = WaitingRoom(100, 1 << 20)
    room.offer("m1", "a", 0, 1.0, 1, 0.0, 30, "m1-a")
    room.offer("m2", "a", 0, 1.0, 1, 0.0, 30, "m2-a")
    assert room.pools() == ["m1", "m2"]
    assert names([e for p in room.pools() if (e := room.peek(p)) is not None]) == ["m1-a", "m2-a"]
    assert drain(room, "m2") == ["m2-a"] and room.waiting("m1") and not room.waiting("m2")


def test_bounds_refuse_at_once() -> None:
    room: WaitingRoom[str] = WaitingRoom(3, 100)
    assert room.offer("m", "a", 0, 1.0, 60, 0.0, 30, "big") is not None
    assert room.offer("m", "a", 0, 1.0, 41, 0.0, 30, "too-many-bytes") is None
    assert room.offer("m", "a", 0, 1.0, 20, 0.0, 30, "x") is not None
    assert room.offer("m", "b", 0, 1.0, 20, 0.0, 30, "y") is not None
    assert room.offer("m", "b", 0, 1.0, 0, 0.0, 30, "too-many") is None
    assert (len(room), room.bytes) == (3, 100)


def test_ttl_and_cancel_leave_once() -> None:
    room: WaitingRoom[str] = WaitingRoom(10, 1000)
    a = room.offer("m", "a", 0, 1.0, 5, 0.0, 2.0, "a")
    b = room.offer("m", "b", 0, 1.0, 5, 1.0, 2.0, "b")
    assert a is not None and b is not None
    assert room.expire(1.99) == []
    assert room.expire(2.0) == [a] and a.outcome == "expired"
    assert room.cancel(a) is False  # already gone
    assert room.cancel(b) is True and b.outcome == "cancelled" and room.cancel(b) is False
    assert len(room) == 0 and room.bytes == 0 and room.pools() == []


def test_only_the_next_entry_is_released() -> None:
    room: WaitingRoom[str] = WaitingRoom(10, 1000)
    room.offer("m", "a", 0, 1.0, 1, 0.0, 30, "a0")
    second = room.offer("m", "a", 0, 1.0, 1, 0.0, 30, "a1")
    assert second is not None
    with pytest.raises(ValueError):
        room.release(second)


# -- properties ------------------------------------------------------------------------------------------------

POOLS = ("m1", "m2")
TENANTS = {"a": (0, 1.0), "b": (0, 2.0), "c": (0, 0.5), "vip": (3, 1.0)}

arrive = st.tuples(st.just("arrive"), st.sampled_from(POOLS), st.sampled_from(sorted(TENANTS)),
                   st.integers(0, 400), st.floats(0.5, 5.0))
release = st.tuples(st.just("release"), st.sampled_from(POOLS))
cancel = st.tuples(st.just("cancel"), st.integers(0, 1000))
tick = st.tuples(st.just("tick"), st.floats(0.0, 3.0))
ops = st.lists(st.one_of(arrive, arrive, release, release, cancel, tick), max_size=150)


@dataclass
class Log:
    accepted: list[Entry[int]]
    left: list[tuple[Entry[int], str]]
    released: list[Entry[int]]


def run(seq: list[tuple[Any, ...]], max_requests: int = 12, max_bytes: int = 2000) -> Log:
    room: WaitingRoom[int] = WaitingRoom(max_requests, max_bytes)
    now = 0.0
    log = Log([], [], [])
    for op in seq:
        kind = op[0]
        if kind == "arrive":
            _, pool, tenant, size, ttl = op
            band, weight = TENANTS[tenant]
            fits = room.count < max_requests and room.bytes + size <= max_bytes
            e = room.offer(pool, tenant, band, weight, size, now, ttl, len(log.accepted))
            assert (e is not None) == fits
            if e is not None:
                log.accepted.append(e)
        elif kind == "release":
            pool = op[1]
            e = room.peek(pool)
            waiting = [x for x in room.entries() if x.pool == pool]
            assert (e is None) == (not waiting)
            if e is not None:
                # The highest band first; within the tenant, the oldest.
                assert e.band == max(x.band for x in waiting)
                assert e.seq == min(x.seq for x in waiting if x.tenant == e.tenant and x.band == e.band)
                room.release(e)
                log.released.append(e)
                log.left.append((e, "released"))
        elif kind == "cancel":
            if log.accepted:
                e = log.accepted[op[1] % len(log.accepted)]
                was = e.outcome is None
                assert room.cancel(e) == was
                if was:
                    log.left.append((e, "cancelled"))
        else:
            now += op[1]
            gone = room.expire(now)
            assert all(e.deadline <= now for e in gone)
            log.left += [(e, "expired") for e in gone]
        # Bounds and bookkeeping hold after every step; nothing waiting is past its deadline after a tick.
        waiting = room.entries()
        assert room.count == len(waiting) <= max_requests
        assert room.bytes == sum(e.size for e in waiting) <= max_bytes
        assert all(e.outcome is None for e in waiting)
        if kind == "tick":
            assert all(e.deadline > now for e in waiting)
    # Everyone still waiting leaves by expiry at the end.
    log.left += [(e, "expired") for e in room.expire(now + 1e9)]
    assert len(room) == 0 and room.bytes == 0 and room.pools() == []
    return log


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_entry_leaves_exactly_once_within_bounds(seq: list[tuple[Any, ...]]) -> None:
    log = run(seq)
    ids = [e.seq for e, _ in log.left]
    assert sorted(ids) == sorted(e.seq for e in log.accepted)  # each accepted entry left, once
    assert all(e.outcome == how for e, how in log.left)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_fifo_within_a_tenant(seq: list[tuple[Any, ...]]) -> None:
    log = run(seq)
    for pool in POOLS:
        for tenant in TENANTS:
            seqs = [e.seq for e in log.released if e.pool == pool and e.tenant == tenant]
            assert seqs == sorted(seqs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.1, 8.0), min_size=2, max_size=5), st.integers(1, 120))
def test_backlogged_tenants_share_by_weight(weights: list[float], n: int) -> None:
    """While every tenant has requests waiting, each one's service over its quantum stays within a small constant
    of every other's, at every point (deficit round robin's bound: a turn at most, plus one request)."""
    room: WaitingRoom[int] = WaitingRoom(10_000, 1 << 30)
    for i in range(200):
        for k, w in enumerate(weights):
            room.offer("m", f"t{k}", 0, w, 1, 0.0, 30, i)
    quanta = [w / min(weights) for w in weights]
    served = [0] * len(weights)
    for _ in range(n):
        e = room.peek("m")
        assert e is not None
        room.release(e)
        served[int(e.tenant[1:])] += 1
        shares = [s / q for s, q in zip(served, quanta, strict=True)]
        assert max(shares) - min(shares) <= 3.0, (weights, served)
