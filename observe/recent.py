"""What the status page shows of the recent past: the last decisions, each worker's TTFT over the last minute,
and the hit ratio in 10-second steps over the last hour. In memory, bounded, rebuilt from nothing when the
observer restarts (Prometheus keeps the long history). Pure: every method takes the time it acts at."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from observe.entry import Observation

STEP_S = 10
HISTORY_S = 3600
TTFT_WINDOW_S = 60.0


@dataclass
class _Bucket:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    claimed: int = 0


@dataclass
class Recent:
    max_decisions: int = 200
    decisions: deque[dict[str, Any]] = field(init=False)
    _ttft: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    _buckets: dict[int, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.decisions = deque(maxlen=self.max_decisions)

    def add(self, o: Observation, now: float) -> None:
        if not o.routed:
            return
        self.decisions.appendleft({
            "request_id": o.request_id, "time": round(o.start_s, 3), "model": o.model, "worker": o.worker,
            "mode": o.mode, "reason": o.reason, "claimed_hit_tokens": o.claimed,
            "engine_cached_tokens": o.cached_tokens, "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.completion_tokens, "stream": o.stream,
            "ttft_ms": None if o.ttft_s is None else round(o.ttft_s * 1000, 1),
            "e2e_ms": None if o.e2e_s is None else round(o.e2e_s * 1000, 1),
            "status": o.status, "cause": o.cause})
        if o.worker and o.ttft_s is not None:
            self._ttft.setdefault(o.worker, deque()).append((now, o.ttft_s))
        if o.prompt_tokens is not None:
            b = self._buckets.setdefault(int(now // STEP_S) * STEP_S, _Bucket())
            b.prompt_tokens += o.prompt_tokens
            b.cached_tokens += o.cached_tokens or 0
            b.claimed += o.claimed or 0
        self._trim(now)

    def _trim(self, now: float) -> None:
        for samples in self._ttft.values():
            while samples and samples[0][0] < now - TTFT_WINDOW_S:
                samples.popleft()
        oldest = now - HISTORY_S
        for t in [t for t in self._buckets if t < oldest]:
            del self._buckets[t]

    def workers(self, now: float) -> dict[str, dict[str, Any]]:
        """Each worker's mean TTFT over the last minute (None when it finished no streamed request in it)."""
        self._trim(now)
        out: dict[str, dict[str, Any]] = {}
        for worker, samples in sorted(self._ttft.items()):
            n = len(samples)
            out[worker] = {"ttft_avg_60s_ms": round(sum(s for _, s in samples) / n * 1000, 1) if n else None,
                           "requests_60s": n}
        return out

    def hit_ratio(self, now: float, window_s: float) -> dict[str, Any]:
        self._trim(now)
        start = now - min(window_s, HISTORY_S)
        points = [{"t": t, "prompt_tokens": b.prompt_tokens, "engine_cached_tokens": b.cached_tokens,
                   "claimed_hit_tokens": b.claimed}
                  for t, b in sorted(self._buckets.items()) if t + STEP_S > start]
        return {"step_s": STEP_S, "points": points}

    def last(self, limit: int) -> list[dict[str, Any]]:
        """Newest first by arrival at Envoy (each Envoy worker thread has its own access-log stream, so
        entries reach the observer slightly out of order)."""
        ordered = sorted(self.decisions, key=lambda d: d["time"], reverse=True)
        return ordered[:max(0, min(limit, self.max_decisions))]
