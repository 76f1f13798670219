"""ingest.loop_cpu: each task step's thread CPU is charged to its loop, and only to its loop (issue 14).

CPU is compared with CPU measured inside the same steps, never with wall-clock time."""

from __future__ import annotations

import asyncio
import time

import pytest

from ingest import loop_cpu
from ingest.loop_cpu import LOOPS, SECONDS, snapshot, timed


def burn(seconds: float) -> float:
    """Spin for `seconds` of this thread's CPU; returns the CPU spent, as measured here."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass
    return time.thread_time() - t0


def test_a_step_is_charged_to_its_loop_and_a_waiting_loop_is_not() -> None:
    burned: list[float] = []

    async def worker() -> str:
        for _ in range(3):
            burned.append(burn(0.01))
            await asyncio.sleep(0)  # each burn is its own step
        return "done"

    async def waiter(started: asyncio.Event, stop: asyncio.Event) -> None:
        started.set()
        await stop.wait()  # suspended while the worker burns

    async def scenario() -> tuple[dict[str, float], dict[str, float], str]:
        started, stop = asyncio.Event(), asyncio.Event()
        waiting = asyncio.create_task(timed("config", waiter(started, stop)))
        await started.wait()
        before = dict(SECONDS)
        result = await asyncio.create_task(timed("parity", worker()))
        stop.set()
        await waiting
        return before, dict(SECONDS), result

    before, after, result = asyncio.run(scenario())
    assert result == "done"  # the value comes through
    assert after["parity"] - before["parity"] >= sum(burned)  # every burned step, at least
    assert after["config"] - before["config"] < sum(burned) / 2  # the waiter's own steps only


def test_cancellation_and_exceptions_pass_through() -> None:
    async def forever() -> None:
        await asyncio.sleep(3600)

    async def failing() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("boom")

    async def scenario() -> None:
        task = asyncio.create_task(timed("health", forever()))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(RuntimeError, match="boom"):
            await asyncio.create_task(timed("health", failing()))

    asyncio.run(scenario())


def test_the_label_set_is_fixed() -> None:
    with pytest.raises(ValueError, match="unknown loop"):
        _ = timed("per-worker-name", asyncio.sleep(0))
    snap = snapshot()
    assert set(snap) == {*LOOPS, "other"}
    assert all(v >= 0 for v in snap.values())
    assert loop_cpu.SECONDS is SECONDS
