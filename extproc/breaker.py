"""Per-worker circuit breakers: a worker whose answers fail while its health probe passes loses first choice.

Sans-IO: every method takes `now` (monotonic seconds) and returns what changed; nothing here reads a clock,
writes a metric or a file. The server feeds it (extproc/responses.py: the answer's `:status` in the response-headers
phase, and whether Envoy retried past the first choice), the plan reads it (extproc/plan.py), and a listener
given at construction hears every transition (metrics, the status file).

    CLOSED --failure_threshold consecutive failures--> OPEN --open_s later--> HALF_OPEN
    HALF_OPEN --success_threshold successes in a row--> CLOSED;  HALF_OPEN --any failure--> OPEN

A worker is keyed by its address (what Envoy reports as `upstream.address`). An OPEN worker is no first choice
while any other candidate is; a HALF_OPEN one is, for at most `half_open_trials` trial requests in flight at once.
Outcomes of requests that were no trial count too (a retry landing there, a request sent before it opened).
The state is this process's own (docs/reliability.md, "A worker that answers 5xx").
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cortex.config import BreakerConfig


class State(enum.Enum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"


LEVEL = {State.CLOSED: 0, State.HALF_OPEN: 1, State.OPEN: 2}
"""The gauge's value: ordered by severity, so the max over extproc processes is the worst."""

Listener = Callable[[str, State, State], None]
"""(address, from, to), called on every transition."""


@dataclass(slots=True)
class Breaker:
    state: State = State.CLOSED
    failures: int = 0
    """Consecutive failures while CLOSED."""
    successes: int = 0
    """Consecutive successes while HALF_OPEN."""
    opened_at: float = 0.0
    trials: int = 0
    """Trial requests in flight while HALF_OPEN."""
    epoch: int = 0
    """Bumped on every transition: a trial taken in an earlier HALF_OPEN spell releases nothing in this one."""


@dataclass(slots=True)
class Trial:
    """A request sent as a HALF_OPEN worker's trial: given back once, with its outcome or when it ends without one."""

    address: str
    epoch: int
    released: bool = False


class Breakers:
    def __init__(self, cfg: BreakerConfig, listener: Listener | None = None) -> None:
        self.cfg = cfg
        self.listener = listener
        self._by: dict[str, Breaker] = {}
        self._tripped: set[str] = set()
        """Addresses whose breaker is OPEN or HALF_OPEN: while it is empty (nearly always) no decision looks further."""

    def _move(self, address: str, b: Breaker, to: State, now: float) -> None:
        old = b.state
        b.state, b.failures, b.successes, b.trials = to, 0, 0, 0
        b.epoch += 1
        if to is State.CLOSED:
            self._tripped.discard(address)
        else:
            self._tripped.add(address)
        if to is State.OPEN:
            b.opened_at = now
        if self.listener is not None:
            self.listener(address, old, to)

    def state(self, address: str, now: float) -> State:
        """Its state at `now` (an OPEN breaker whose time is up becomes HALF_OPEN here)."""
        b = self._by.get(address)
        if b is None:
            return State.CLOSED
        if b.state is State.OPEN and now - b.opened_at >= self.cfg.open_s:
            self._move(address, b, State.HALF_OPEN, now)
        return b.state

    def admits(self, address: str, now: float) -> bool:
        """It may be a first choice: CLOSED, or HALF_OPEN with a trial slot free (always, when disabled)."""
        if not self.cfg.enabled:
            return True
        st = self.state(address, now)
        if st is State.HALF_OPEN:
            return self._by[address].trials < self.cfg.half_open_trials
        return st is State.CLOSED

    def skipped(self, addresses: Iterable[str], now: float) -> frozenset[str]:
        """Of `addresses`, those that may not be a first choice now."""
        if not self._tripped or not self.cfg.enabled:
            return frozenset()
        return frozenset(a for a in self._tripped.intersection(addresses) if not self.admits(a, now))

    def dispatched(self, address: str, now: float) -> Trial | None:
        """A first attempt goes to `address`: a HALF_OPEN worker's trial slot is taken (the Trial to give back)."""
        if not self.cfg.enabled or self.state(address, now) is not State.HALF_OPEN:
            return None
        b = self._by[address]
        b.trials += 1
        return Trial(address, b.epoch)

    def release(self, trial: Trial | None) -> None:
        """A trial ended (with or without an outcome): its slot is free again, if its HALF_OPEN spell goes on."""
        if trial is None or trial.released:
            return
        trial.released = True
        b = self._by.get(trial.address)
        if b is not None and b.epoch == trial.epoch and b.trials > 0:
            b.trials -= 1

    def record(self, address: str, ok: bool, now: float) -> State:
        """An answer from `address`: `ok` False for a failure. Returns its state after it."""
        if not self.cfg.enabled:
            return State.CLOSED
        b = self._by.get(address)
        if b is None:
            if ok:
                return State.CLOSED  # nothing to remember about a worker that never failed
            b = self._by[address] = Breaker()
        st = self.state(address, now)
        if st is State.CLOSED:
            if ok:
                b.failures = 0
            else:
                b.failures += 1
                if b.failures >= self.cfg.failure_threshold:
                    self._move(address, b, State.OPEN, now)
        elif st is State.HALF_OPEN:
            if not ok:
                self._move(address, b, State.OPEN, now)
            else:
                b.successes += 1
                if b.successes >= self.cfg.success_threshold:
                    self._move(address, b, State.CLOSED, now)
        # OPEN: an answer that was on its way when it opened (or a last-resort attempt) changes nothing: only its
        # trials, once half-open, decide whether it is back.
        return b.state

    def tick(self, now: float) -> None:
        """Move every OPEN breaker whose time is up to HALF_OPEN now (else that waits for a decision to ask), so the
        metrics and the status file say half-open on time."""
        for address in list(self._tripped):
            self.state(address, now)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the breakers of workers no longer in the fleet (a closed one carries only a failure count)."""
        kept = set(keep)
        for address in [a for a in self._by if a not in kept]:
            del self._by[address]
            self._tripped.discard(address)

    def snapshot(self, now: float) -> dict[str, dict[str, object]]:
        """Every breaker that is not plain CLOSED-without-failures: for the status file and route explain."""
        out: dict[str, dict[str, object]] = {}
        for address in list(self._by):
            st = self.state(address, now)
            b = self._by[address]
            if st is State.CLOSED and not b.failures:
                continue
            doc: dict[str, object] = {"state": st.value, "failures": b.failures, "successes": b.successes,
                                      "trials": b.trials}
            if st is State.OPEN:
                doc["half_open_in_s"] = round(max(0.0, b.opened_at + self.cfg.open_s - now), 3)
            out[address] = doc
        return out
