"""The circuit breaker's state machine (extproc/breaker.py), driven by (worker, outcome, now) vectors."""

from __future__ import annotations

import itertools

import pytest

from cortex.config import BreakerConfig
from extproc.breaker import Breakers, State

CFG = BreakerConfig(failure_threshold=3, open_s=10.0, half_open_trials=2, success_threshold=2)
A, B = "10.0.0.1:8000", "10.0.0.2:8000"

# Each vector: a list of (time, event, expected state of A after it). Events: "ok"/"fail" (an answer from A),
# "admit" (expected value of admits(A) given as the state slot), "dispatch", "release".
VECTORS: dict[str, list[tuple[float, str, str]]] = {
    "opens after threshold consecutive failures": [
        (0, "fail", "closed"), (1, "fail", "closed"), (2, "fail", "open")],
    "a success resets the count": [
        (0, "fail", "closed"), (1, "fail", "closed"), (2, "ok", "closed"), (3, "fail", "closed"),
        (4, "fail", "closed"), (5, "fail", "open")],
    "open until open_s, then half-open": [
        (0, "fail", "closed"), (0, "fail", "closed"), (0, "fail", "open"), (9.9, "state", "open"),
        (10, "state", "half_open")],
    "answers while open change nothing": [
        (0, "fail", "closed"), (0, "fail", "closed"), (0, "fail", "open"), (1, "ok", "open"), (2, "ok", "open"),
        (3, "ok", "open"), (5, "fail", "open"), (10, "state", "half_open")],
    "half-open closes after success_threshold successes": [
        (0, "fail", "closed"), (0, "fail", "closed"), (0, "fail", "open"), (10, "ok", "half_open"),
        (11, "ok", "closed")],
    "half-open reopens on any failure, for a new open_s": [
        (0, "fail", "closed"), (0, "fail", "closed"), (0, "fail", "open"), (10, "ok", "half_open"),
        (11, "fail", "open"), (20.9, "state", "open"), (21, "state", "half_open")],
    "closed again needs the full threshold to reopen": [
        (0, "fail", "closed"), (0, "fail", "closed"), (0, "fail", "open"), (10, "ok", "half_open"),
        (10, "ok", "closed"), (11, "fail", "closed"), (12, "fail", "closed"), (13, "fail", "open")],
}


@pytest.mark.parametrize("name", VECTORS)
def test_vectors(name: str) -> None:
    seen: list[tuple[str, State, State]] = []
    br = Breakers(CFG, lambda a, old, new: seen.append((a, old, new)))
    for now, event, want in VECTORS[name]:
        got = br.state(A, now) if event == "state" else br.record(A, event == "ok", now)
        assert got.value == want, (name, now, event)
    # Every transition was heard, each from the state the previous one went to.
    for (_, _, to), (_, frm, _) in itertools.pairwise(seen):
        assert to is frm


def test_open_worker_is_skipped_and_half_open_admits_a_bounded_number_of_trials() -> None:
    br = Breakers(CFG)
    for t in range(3):
        br.record(A, False, float(t))
    assert br.skipped([A, B], 5.0) == {A}
    assert br.dispatched(A, 5.0) is None  # a last-resort attempt while open takes no trial slot
    # Half-open: two trials at once, the third request goes elsewhere until one of them ends.
    assert br.admits(A, 12.0)
    t1 = br.dispatched(A, 12.0)
    t2 = br.dispatched(A, 12.0)
    assert t1 is not None and t2 is not None
    assert not br.admits(A, 12.0) and br.skipped([A, B], 12.0) == {A}
    br.release(t1)
    assert br.admits(A, 12.0)
    br.release(t1)  # released twice: the slot is not freed twice
    t3 = br.dispatched(A, 12.0)
    assert not br.admits(A, 12.0)
    # A failure reopens it; a trial of the old spell freed later releases nothing in the new one.
    assert br.record(A, False, 13.0) is State.OPEN
    br.release(t2)
    br.release(t3)
    assert br.state(A, 23.0) is State.HALF_OPEN and br.admits(A, 23.0)
    t4 = br.dispatched(A, 23.0)
    t5 = br.dispatched(A, 23.0)
    assert t4 is not None and t5 is not None and not br.admits(A, 23.0)


def test_disabled_breaker_never_skips() -> None:
    br = Breakers(BreakerConfig(enabled=False, failure_threshold=1))
    for t in range(5):
        br.record(A, False, float(t))
    assert br.admits(A, 5.0) and br.skipped([A], 5.0) == frozenset() and br.dispatched(A, 5.0) is None


def test_snapshot_lists_only_workers_with_something_to_say() -> None:
    br = Breakers(CFG)
    br.record(B, True, 0.0)
    br.record(A, False, 0.0)
    assert br.snapshot(0.0) == {A: {"state": "closed", "failures": 1, "successes": 0, "trials": 0}}
    br.record(A, False, 1.0)
    br.record(A, False, 2.0)
    assert br.snapshot(4.0)[A] == {"state": "open", "failures": 0, "successes": 0, "trials": 0,
                                   "half_open_in_s": 8.0}
    br.forget([B])
    assert br.snapshot(4.0) == {} and br.state(A, 4.0) is State.CLOSED
