"""Run-time fault injection for the simulated engines (``GET|POST /sim/faults`` and the ``--fault-*`` flags).

One ``Faults`` object per server is shared by the HTTP handlers (asyncio thread) and the KV-event publisher
threads, so every field is read under a lock and the one-shot actions (``seq_gap``, ``restart_publisher``)
are handed out exactly once. The wire contract, which other components' tests rely on:

* ``POST /sim/faults`` takes a JSON object with any subset of the keys below and answers the full state;
  ``GET /sim/faults`` answers the state. Unknown keys or bad values are a 400 and change nothing.
* ``drop_events`` / ``duplicate_events`` / ``reorder_events``: probabilities 0..1 applied per published batch.
* ``seq_gap``: skip that many sequence numbers once, at each publisher's next publish (reads back as the
  amount still pending).
* ``restart_publisher``: an action, performed when posted as true; always reads back false.
* ``stall_stream_ms``, ``crash_mid_stream``, ``http_5xx_rate``, ``overload_503``, ``reset_requests``,
  ``slow_health_ms``, ``slow_first_token_ms``: the HTTP faults, applied by the API layer.
* ``load_endpoint_down``: the engine's load endpoint (vLLM ``/metrics``, SGLang ``/v1/loads`` and ``/metrics``)
  answers 503, as a worker whose metrics exporter broke.
* ``pd_stall_bootstrap``: an SGLang PD decode never reaches its prefill's bootstrap server and waits out its
  waiting timeout (the "bootstrap never arrives" failure a PD gateway must cut short).
* ``pd_transfer_fail``: a vLLM PD prefill refuses every KV read (its NIXL side channel fails), so a decoder
  with ``--kv-load-failure-policy fail`` rejects the transfer params with a 500.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

_PROBABILITIES = ("drop_events", "duplicate_events", "reorder_events", "http_5xx_rate")
_MILLIS = ("stall_stream_ms", "slow_health_ms", "slow_first_token_ms")
_FLAGS = ("crash_mid_stream", "overload_503", "reset_requests", "load_endpoint_down", "pd_stall_bootstrap",
          "pd_transfer_fail")


class FaultError(ValueError):
    """A fault update that is not valid; nothing was changed."""


@dataclass
class FaultState:
    drop_events: float = 0.0
    duplicate_events: float = 0.0
    reorder_events: float = 0.0
    seq_gap: int = 0
    restart_publisher: bool = False
    stall_stream_ms: float = 0.0
    crash_mid_stream: bool = False
    http_5xx_rate: float = 0.0
    overload_503: bool = False
    reset_requests: bool = False
    slow_health_ms: float = 0.0
    slow_first_token_ms: float = 0.0
    load_endpoint_down: bool = False
    pd_stall_bootstrap: bool = False
    pd_transfer_fail: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_KEYS = frozenset(f.name for f in fields(FaultState))


def _validate(update: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(update) - _KEYS)
    if unknown:
        raise FaultError(f"unknown fault keys: {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
    clean: dict[str, Any] = {}
    for key, value in update.items():
        if key in _PROBABILITIES or key in _MILLIS:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise FaultError(f"{key} must be a number, got {value!r}")
            if key in _PROBABILITIES and not 0.0 <= value <= 1.0:
                raise FaultError(f"{key} is a probability and must be within 0..1, got {value}")
            if key in _MILLIS and value < 0:
                raise FaultError(f"{key} must not be negative, got {value}")
            clean[key] = float(value)
        elif key == "seq_gap":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise FaultError(f"seq_gap must be a non-negative integer, got {value!r}")
            clean[key] = value
        else:  # the booleans
            if not isinstance(value, bool):
                raise FaultError(f"{key} must be true or false, got {value!r}")
            clean[key] = value
    return clean


@dataclass
class Faults:
    """The live fault state plus the RNG the probabilistic faults draw from (seedable for reproducibility)."""

    state: FaultState = field(default_factory=FaultState)
    seed: int | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(self.seed)
        # Publishers register here so a seq_gap reaches every DP rank once; an int per publisher id.
        self._pending_gaps: dict[int, int] = {}

    # --- control plane ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out = self.state.as_dict()
            out["seq_gap"] = max(self._pending_gaps.values(), default=self.state.seq_gap)
            out["restart_publisher"] = False
            return out

    def update(self, update: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Apply a validated update; returns the new state and whether a publisher restart was asked for."""
        clean = _validate(update)
        restart = bool(clean.pop("restart_publisher", False))
        with self._lock:
            for key, value in clean.items():
                setattr(self.state, key, value)
            if "seq_gap" in clean:
                for pub_id in self._pending_gaps:
                    self._pending_gaps[pub_id] = clean["seq_gap"]
        return self.snapshot(), restart

    # --- publisher side --------------------------------------------------------------------------

    def register_publisher(self, pub_id: int) -> None:
        with self._lock:
            self._pending_gaps[pub_id] = self.state.seq_gap

    def take_seq_gap(self, pub_id: int) -> int:
        with self._lock:
            gap = self._pending_gaps.get(pub_id, 0)
            if gap:
                self._pending_gaps[pub_id] = 0
                # Once every publisher has consumed it, the state reads 0 again.
                if not any(self._pending_gaps.values()):
                    self.state.seq_gap = 0
            return gap

    def roll(self, key: str) -> bool:
        """True with the probability currently configured for `key` (one of the probability faults)."""
        with self._lock:
            p = getattr(self.state, key)
            return p > 0.0 and (p >= 1.0 or self._rng.random() < p)

    def get(self, key: str) -> Any:
        with self._lock:
            return getattr(self.state, key)


def faults_from_flags(values: Mapping[str, Any], seed: int | None = None) -> Faults:
    """Initial state from CLI flags (same names and rules as the endpoint)."""
    clean = _validate({k: v for k, v in values.items() if v is not None and k != "restart_publisher"})
    return Faults(FaultState(**clean), seed=seed)
