"""The prefill work this replica has queued on each worker: what the time model reads as the wait ahead.

When a request is committed to a worker, the prefill the time model predicted for it there (calibrated, so in
that worker's own milliseconds) is queued behind what this process already sent there (cortex/inflight.py:
BacklogBoard, shared by the replica's extproc processes); it drains as the clock passes it, and when the
request ends its prefill is settled at once (`settle`): a worker whose prediction ran long does not look busy
after its request is done (an agent's next turn, sent as soon as the last answer arrived, would otherwise see
that phantom queue on the worker holding its conversation). Work other
replicas and clients send shows in the engine's waiting count instead (ttft.queue_ms takes the larger).

Also learned here: the typical prefill of a request (an exponential average over the requests committed), the
price of one queued request the engine reports that this process did not send.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from cortex.inflight import BacklogBoard

MAX_PENDING = 4096
"""Receipts kept per slot: a request that never ends (it cannot: every stream is released) is forgotten past it."""
TYPICAL_WEIGHT = 0.05
"""Weight of each committed request in the typical-prefill average (about the last 20 requests)."""


class Backlog:
    def __init__(self, board: BacklogBoard) -> None:
        self.board = board
        self._pending: dict[int, OrderedDict[int, float]] = {}
        """Per slot, the prefill (ms) of each committed request not settled yet, by receipt, in commit order."""
        self._seq = 0
        self.typical_ms: float | None = None
        """None until a request was committed: the config's queued_request_ms stands in."""

    def commit(self, slot: int, prefill_ms: float) -> int:
        """Queue a request's prefill on `slot`; returns its receipt for `settle`."""
        self.board.push(slot, prefill_ms)
        self._seq += 1
        pending = self._pending.setdefault(slot, OrderedDict())
        pending[self._seq] = prefill_ms
        if len(pending) > MAX_PENDING:
            pending.popitem(last=False)
        t = self.typical_ms
        self.typical_ms = prefill_ms if t is None else t + TYPICAL_WEIGHT * (prefill_ms - t)
        return self._seq

    def settle(self, slot: int, receipt: int) -> None:
        """The request `receipt` queued on `slot` has ended, so its prefill is done, and so is the prefill of every
        request queued there before it (an engine admits prompts in order): what is left is the work queued after
        it, from now on, if that is sooner than the clock's drain says. A request settled by a later one's end
        changes nothing."""
        pending = self._pending.get(slot)
        if not pending or receipt not in pending:
            return
        while pending.popitem(last=False)[0] != receipt:
            pass
        self.board.lower(slot, time.monotonic() + sum(pending.values()) / 1000.0)

    def remaining_ms(self) -> np.ndarray:
        return self.board.backlog_ms()
