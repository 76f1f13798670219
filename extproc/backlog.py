"""The prefill work this replica has queued on each worker: what the time model reads as the wait ahead.

When a request is committed to a worker, the prefill the time model predicted for it there (calibrated, so in
that worker's own milliseconds) is queued behind what this process already sent there (cortex/inflight.py:
BacklogBoard, shared by the replica's extproc processes); it drains as the clock passes it, so no end signal
is needed and a request that ends early or is retried elsewhere costs at most its predicted time. Work other
replicas and clients send shows in the engine's waiting count instead (ttft.queue_ms takes the larger).

Also learned here: the typical prefill of a request (an exponential average over the requests committed), the
price of one queued request the engine reports that this process did not send.
"""

from __future__ import annotations

import numpy as np

from cortex.inflight import BacklogBoard

TYPICAL_WEIGHT = 0.05
"""Weight of each committed request in the typical-prefill average (about the last 20 requests)."""


class Backlog:
    def __init__(self, board: BacklogBoard) -> None:
        self.board = board
        self.typical_ms: float | None = None
        """None until a request was committed: the config's queued_request_ms stands in."""

    def commit(self, slot: int, prefill_ms: float) -> None:
        self.board.push(slot, prefill_ms)
        t = self.typical_ms
        self.typical_ms = prefill_ms if t is None else t + TYPICAL_WEIGHT * (prefill_ms - t)

    def remaining_ms(self) -> np.ndarray:
        return self.board.backlog_ms()
