"""What each of ingest's loops costs in CPU, as `cortex_ingest_loop_cpu_seconds_total{loop=...}` (issue 14).

Every long-lived task of the ingest process runs its coroutine through `timed(loop, coro)`, which adds the
thread CPU time of each of the task's steps (from one `await` that suspends to the next) to its loop's
counter. That counts the loop's own code and whatever runs inside its steps (the event decoder, the ledger,
the view writes; the HTTP client's request and response handling; the load parser); it does not count what
the event loop runs outside any task (socket readiness callbacks, aiohttp's transport reading a response,
the admin API's handlers), which is `other`: the process's CPU minus the loops' (docs/performance.md, "Ingest's CPU").

The label set is fixed (LOOPS + `other`), so the series stay bounded whatever the fleet. The cost is two
`time.thread_time()` calls per task step: well under a microsecond each here, against the tens to hundreds
of microseconds a step does.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

LOOPS = ("events", "load", "health", "heartbeat", "parity", "config", "peers")
"""events: the KV-event sources (receive, decode, ledger, view; replays and tail checks). load: the load polls
(request, parse, apply, cadence). health: the health probes. heartbeat: the view stamp and the target list's
publication. parity: tokenizer parity checks. config: the config file watch, the Kubernetes pod watches
(ingest/k8s_discovery.py) and the workers' hostnames resolved again."""

SECONDS: dict[str, float] = dict.fromkeys(LOOPS, 0.0)
"""CPU seconds per loop since the process started (one ingest per process: a module-level counter)."""

T = TypeVar("T")


class _Timed(Coroutine[Any, Any, T]):
    """A coroutine that charges the thread CPU of each step of the wrapped one to a loop."""

    __slots__ = ("_coro", "_loop")

    def __init__(self, loop: str, coro: Coroutine[Any, Any, T]) -> None:
        self._loop = loop
        self._coro = coro

    def send(self, value: Any) -> Any:
        t0 = time.thread_time()
        try:
            return self._coro.send(value)
        finally:
            SECONDS[self._loop] += time.thread_time() - t0

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        t0 = time.thread_time()
        try:
            if val is None and tb is None:
                return self._coro.throw(typ)
            return self._coro.throw(typ, val, tb)
        finally:
            SECONDS[self._loop] += time.thread_time() - t0

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, T]:
        return self._coro.__await__()  # awaited directly, it is not timed (tasks call send/throw)


def timed(loop: str, coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
    """`coro`, with the CPU of each of its steps charged to `loop` (one of LOOPS) when run as a task."""
    if loop not in SECONDS:
        coro.close()  # never to run: closed, so it is not reported as never awaited
        raise ValueError(f"unknown loop {loop!r}")
    return _Timed(loop, coro)


def snapshot() -> dict[str, float]:
    """CPU seconds per loop, plus `other`: the rest of the process's CPU (never negative)."""
    out = dict(SECONDS)
    out["other"] = max(0.0, time.process_time() - sum(out.values()))
    return out
