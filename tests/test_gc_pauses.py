"""cortex/gc_pauses.py: the pause histogram's vectors, and what settling the heap does to a full collection."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from cortex import gc_pauses
from cortex.gc_pauses import BUCKETS, Pauses, settle


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Each test leaves the worker process's heap as it found it (nothing frozen)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_pauses_fall_into_their_buckets_by_generation() -> None:
    p = Pauses()
    p.add(0, 0.0002)   # first bucket (<= 0.5 ms)
    p.add(0, 0.0005)   # a bound belongs to its own bucket (le)
    p.add(2, 0.148)    # a full collection of an unsettled heap
    p.add(2, 3.0)      # past every bound: +Inf
    assert p.counts[0][0] == 2 and sum(p.counts[0]) == 2
    assert p.counts[2][BUCKETS.index(0.25)] == 1 and p.counts[2][-1] == 1
    assert p.counts[1] == [0] * (len(BUCKETS) + 1)
    assert p.sums[2] == pytest.approx(3.148) and p.longest == [0.0005, 0.0, 3.0]
    cumulative = p.buckets(2)
    assert cumulative[0] == ("0.0005", 0.0) and cumulative[BUCKETS.index(0.25)] == ("0.25", 1.0)
    assert cumulative[-1] == ("+Inf", 2.0)


def test_drain_returns_each_pause_once_and_keeps_only_the_latest() -> None:
    p = Pauses(keep=3)
    for i in range(5):
        p.add(i % 3, i / 1000)
    assert p.drain() == [(2, 0.002), (0, 0.003), (1, 0.004)]
    assert p.drain() == []
    assert sum(map(sum, p.counts)) == 5  # the histogram keeps every pause, drained or not


def test_the_callback_times_a_real_collection() -> None:
    p = Pauses()
    gc.callbacks.append(p.callback)
    try:
        gc.collect(2)
    finally:
        gc.callbacks.remove(p.callback)
    assert sum(p.counts[2]) >= 1 and p.longest[2] > 0
    assert (2, p.longest[2]) in p.drain()


def test_watch_hooks_the_process_counter_once() -> None:
    gc_pauses.watch()
    gc_pauses.watch()
    assert gc.callbacks.count(gc_pauses.PAUSES.callback) == 1
    before = sum(gc_pauses.PAUSES.counts[2])
    gc.collect(2)
    assert sum(gc_pauses.PAUSES.counts[2]) >= before + 1


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """A reference cycle no one else holds: only a collection frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.mark.usefixtures("unfrozen")
def test_settle_keeps_what_is_alive_out_of_later_collections() -> None:
    kept = [Node() for _ in range(1000)]  # start-up's objects, alive for the process's life
    frozen = settle()
    assert frozen == gc.get_freeze_count() >= len(kept)
    # A full collection now walks what came after the settle only, far fewer than what was frozen.
    assert len(gc.get_objects()) < frozen
    assert not any(obj is kept for obj in gc.get_objects())


@pytest.mark.usefixtures("unfrozen")
def test_settle_frees_cycles_it_froze_once_they_are_garbage() -> None:
    """A reload replaces what start-up built; the next settle must free it, not keep it frozen for ever."""
    holder = [Node()]
    holder[0].other = Node()
    holder[0].other.other = holder[0]  # a cycle, alive through `holder` while frozen
    dead = weakref.ref(holder[0])
    settle()
    holder.clear()  # the reload dropped it: garbage, but frozen
    gc.collect()
    assert dead() is not None  # a plain collection does not walk the frozen generation
    settle()
    assert dead() is None


@pytest.mark.usefixtures("unfrozen")
def test_settle_collects_garbage_cycles_first() -> None:
    gone = cycle()
    settle()
    assert gone() is None
