"""Each worker's observed over predicted time to first token: how the time model learns a worker's own speed.

extproc predicts every routed request's TTFT on the worker it chose (extproc/policies/ttft.py) and puts the
figure in the request's facts; `cortex observe` sees the TTFT the client saw and keeps, per worker, decayed
sums of both (`Learner`), and writes their ratio to `<runtime_dir>/calibration.json` about once a second. Every
extproc process reads that file in its upkeep (`Calibration`) and scales its predictions for that worker by
the ratio, so a worker twice as slow as the model (another GPU, a bigger model, a neighbour on the host) is
predicted twice as slow after a few of its requests, and the whole fleet's rate follows a config that was off.

A ratio of sums, not a mean of ratios: a burst of tiny predictions (a hit computes nearly nothing) cannot swing
it. Bounded to [MIN_FACTOR, MAX_FACTOR] so one pathological stretch cannot take a worker out of routing, and
learned from requests whose predicted TTFT is at least MIN_PREDICTED_MS (below it the gateway's own overhead,
not the worker, dominates the observed figure).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.json"
DECAY = 0.95
"""Weight the sums keep per new observation (about the last 20 requests of the worker count)."""
MIN_FACTOR, MAX_FACTOR = 0.25, 10.0
MIN_PREDICTED_MS = 20.0
MIN_SAMPLES = 5
"""Observations of a worker before its ratio is published (until then it is 1)."""


@dataclass(slots=True)
class _Sums:
    observed_ms: float = 0.0
    predicted_ms: float = 0.0
    samples: int = 0


@dataclass(slots=True)
class Learner:
    """The observer's side: decayed sums per worker id."""

    workers: dict[str, _Sums] = field(default_factory=dict)

    def add(self, worker: str, predicted_ms: float, observed_ms: float) -> None:
        if not worker or predicted_ms < MIN_PREDICTED_MS or observed_ms < 0:
            return
        s = self.workers.setdefault(worker, _Sums())
        s.observed_ms = s.observed_ms * DECAY + observed_ms
        s.predicted_ms = s.predicted_ms * DECAY + predicted_ms
        s.samples += 1

    def factors(self) -> dict[str, float]:
        return {w: min(MAX_FACTOR, max(MIN_FACTOR, s.observed_ms / s.predicted_ms))
                for w, s in sorted(self.workers.items()) if s.samples >= MIN_SAMPLES and s.predicted_ms > 0}

    def write(self, path: Path) -> None:
        """Atomically: a reader sees the old file or the new one, never half of one."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"version": 1, "factors": self.factors()}))
        os.replace(tmp, path)


class Calibration:
    """extproc's side: the factors as last written, re-read when the file changes (upkeep, off the request path)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.factors: dict[str, float] = {}
        self._stamp: tuple[int, int] | None = None

    def refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return  # not written yet (no observer, or no streamed request so far): every factor stays 1
        stamp = (st.st_ino, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            doc = json.loads(self.path.read_text())
            factors = doc["factors"]
            self.factors = {str(w): min(MAX_FACTOR, max(MIN_FACTOR, float(f))) for w, f in factors.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("calibration file %s unreadable (%s); keeping the factors read before", self.path, exc)
