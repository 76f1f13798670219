"""CPython's garbage-collector pauses in Cortex's long-lived processes: kept short, and measured.

A full (generation 2) collection walks every container the process holds and stops its event loop meanwhile:
every request extproc is deciding, every event batch ingest is applying, waits. What start-up loads (imported
modules, tokenizers, chat templates, the config, the Kubernetes and gRPC clients) is never garbage, yet each full
collection walked it again: measured in extproc serving 128K-token chats, one full collection stopped it for
148 ms; with the start-up heap settled, 7 ms (docs/performance.md, "Garbage-collector pauses").

`settle()` collects once and moves everything alive into CPython's permanent generation (`gc.freeze`), which the
collector no longer walks. A process calls it when start-up is done and again after a config reload (after
`gc.unfreeze`, so what the reload replaced can be collected first: frozen objects in a reference cycle would
otherwise never be freed). Objects made later are collected as before.

`Pauses` counts each collection's duration by generation (`cortex_{extproc,ingest}_gc_pause_seconds`), fed from a
`gc.callbacks` hook, which runs inside the collection, at any allocation: so it only reads the clock, bisects and
adds. It takes no lock and touches no metrics library (a callback that took prometheus_client's value lock could
deadlock against an increment the collection interrupted); the processes export it from their own loops.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections import deque
from typing import Any

from cortex.shared_metrics import cumulative_buckets

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Upper bounds in seconds (plus +Inf): a young collection takes well under a millisecond, a full one of an
unsettled heap tens to hundreds."""
GENERATIONS = 3


def settle() -> int:
    """Collect, then keep what is alive out of every later collection's walk (module docstring). Returns how many
    objects that is (`gc.get_freeze_count`), which the processes export."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Pauses:
    """Collections by generation: a Prometheus-shaped histogram of their durations, and the ones not yet taken by
    `drain()` (bounded: a process that never drains keeps the latest only)."""

    def __init__(self, keep: int = 1024) -> None:
        self.counts = [[0] * (len(BUCKETS) + 1) for _ in range(GENERATIONS)]
        self.sums = [0.0] * GENERATIONS
        self.longest = [0.0] * GENERATIONS
        self.pending: deque[tuple[int, float]] = deque(maxlen=keep)
        self._started = 0.0

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        """The `gc.callbacks` hook."""
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.add(info["generation"], time.perf_counter() - self._started)

    def add(self, generation: int, seconds: float) -> None:
        self.counts[generation][bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sums[generation] += seconds
        if seconds > self.longest[generation]:
            self.longest[generation] = seconds
        self.pending.append((generation, seconds))

    def drain(self) -> list[tuple[int, float]]:
        """The (generation, seconds) of the collections since the last call, oldest first."""
        out = []
        while self.pending:
            out.append(self.pending.popleft())
        return out

    def buckets(self, generation: int) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs of one generation, as Prometheus histograms take them."""
        return cumulative_buckets(BUCKETS, self.counts[generation])


PAUSES = Pauses()
"""The process's one instance (`watch()` hooks it in)."""


def watch() -> Pauses:
    """Count this process's collections into PAUSES (once, however often called)."""
    if PAUSES.callback not in gc.callbacks:
        gc.callbacks.append(PAUSES.callback)
    return PAUSES
