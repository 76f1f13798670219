"""The rules of a tenant's limits, as pure functions of counters and a clock (docs/tenancy.md, "Limits").

- Requests per second: GCRA (the generic cell rate algorithm), a token bucket kept as one number per tenant, the
  theoretical arrival time of the next request; `burst` requests may arrive at once.
- Tokens per minute and the token quota: charges in fixed windows aligned to the Unix epoch, so every process and
  replica agrees on where a window starts. What is admitted must fit beside what is charged in the window and
  what other requests hold reserved.
- A request reserves what it may cost (the uncached and cached prompt tokens Cortex knows from its ledger, and
  max_tokens); it is settled with the engine's usage when it ends (the observer), and its reservation released.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cortex.config import ChargeWeights


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    retry_after_s: float = 0.0
    """When a refused request could next pass (0 when allowed)."""


def gcra(tat: float, now: float, rate: float, burst: int) -> tuple[Verdict, float]:
    """One request against a bucket of `rate` per second and depth `burst`: the verdict and the new theoretical
    arrival time (unchanged when refused)."""
    interval = 1.0 / rate
    tolerance = (burst - 1) * interval
    start = max(tat, now)
    if start - now > tolerance:
        return Verdict(False, start - tolerance - now), tat
    return Verdict(True), start + interval


def burst_of(rate: float, burst: int | None) -> int:
    return burst if burst is not None else max(1, math.ceil(rate))


def window(now: float, period_s: float) -> int:
    """The fixed window `now` falls in (windows start at multiples of the period since the epoch)."""
    return int(now // period_s)


def window_left_s(now: float, period_s: float) -> float:
    return period_s - now % period_s


def cost(w: ChargeWeights, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
    """What a request is charged: uncached prompt tokens, cached ones and generated ones, each at its weight."""
    cached = min(max(cached_tokens, 0), max(prompt_tokens, 0))
    return (w.uncached_prompt * (max(prompt_tokens, 0) - cached) + w.cached_prompt * cached
            + w.completion * max(completion_tokens, 0))


def settled(w: ChargeWeights, *, prompt_tokens: int | None, cached_tokens: int | None,
            completion_tokens: int | None, reached_worker: bool, routed_prompt_tokens: int | None,
            claimed_hit_tokens: int | None, chunks: int) -> float:
    """What an ended request is charged. The engine's usage when it sent one; else, when a worker took the request,
    what Cortex saw of it (its prompt count, the hit it proved, one token per streamed chunk); else nothing."""
    if prompt_tokens is not None:
        return cost(w, prompt_tokens, cached_tokens or 0, completion_tokens or 0)
    if not reached_worker:
        return 0.0
    return cost(w, routed_prompt_tokens or 0, claimed_hit_tokens or 0,
                completion_tokens if completion_tokens is not None else chunks)


def fits(limit: float | None, charged: float, reserved: float, amount: float) -> bool:
    """Whether `amount` more fits under `limit` beside what the window charged and others hold reserved."""
    return limit is None or charged + reserved + amount <= limit
