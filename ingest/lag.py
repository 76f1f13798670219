"""How far behind the engines this ingest's view is, for the whole process (one ingest per replica).

Every applied batch's lag (the engine's timestamp to the moment ingest applies it to the ledger and view: publish
queueing, the network, ZMQ's queue while ingest is busy elsewhere, any replay) goes into one histogram and a
windowed maximum. Per process and not per target: a 256-worker fleet would otherwise add 256 series per replica,
and the question an operator asks, "is this replica keeping up with the engines?", is about the process (the
per-target `cortex_ingest_lag_seconds` stays for the one worker that is behind). docs/observability.md.

The clocks are the engines' and ingest's wall clocks: on different hosts their skew adds to (or hides) lag;
NTP-synced hosts keep that within a few milliseconds.
"""

from __future__ import annotations

import bisect
import time

from cortex.shared_metrics import cumulative_buckets

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds in seconds (plus +Inf): an idle loop applies a batch within a millisecond, a falling-behind one
drifts into seconds."""
WINDOW_S = 10.0
"""The maximum covers the batches applied in the last 10 to 20 seconds (two alternating windows)."""


class ViewLag:
    """Histogram + recent maximum of batch lag; observe() is on ingest's hot path, so it only bisects and adds."""

    def __init__(self, start: float | None = None) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self._window_start = time.monotonic() if start is None else start
        self._max = 0.0
        self._prev_max = 0.0

    def observe(self, lag_s: float, now: float | None = None) -> None:
        self.counts[bisect.bisect_left(BUCKETS, lag_s)] += 1
        self.sum += lag_s
        self._roll(time.monotonic() if now is None else now)
        if lag_s > self._max:
            self._max = lag_s

    def _roll(self, now: float) -> None:
        if now - self._window_start >= WINDOW_S:
            # A whole window with nothing applied means nothing recent to report from the older one either.
            self._prev_max = self._max if now - self._window_start < 2 * WINDOW_S else 0.0
            self._max = 0.0
            self._window_start = now

    def recent_max(self, now: float | None = None) -> float:
        """The largest lag among batches applied in the last WINDOW_S..2*WINDOW_S seconds (0 if none)."""
        self._roll(time.monotonic() if now is None else now)
        return max(self._max, self._prev_max)

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs as Prometheus histograms take them."""
        return cumulative_buckets(BUCKETS, self.counts)


VIEW_LAG = ViewLag()
"""The process's one instance: every source of this ingest process observes into it."""
