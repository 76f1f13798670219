"""What decided each candidate's place, for route explain (pure; computed only when a decision is explained).

Each step of the chain weighs different facts, and route explain shows, per candidate, the ones its step weighed
(`score`, with `by` naming the rule):

  ttft          the time model's estimate (ttft.Estimate): uncached tokens, queue, prefill, calibration,
                predicted TTFT, score (lowest first)
  cache_aware   the score's terms in ms of TTFT (cache_aware.py): + cache (alpha x tokens held or about to be)
                - load (beta x active requests) - queue (gamma x waiting x a queued request's time) = score
                (highest first)
  load_aware    active requests: the larger of the engine's and Cortex's in-flight count (least first)
  p2c           Cortex's in-flight count (the engine load is unknown): two candidates drawn, fewer first
  round_robin   the position in this turn of the rotation

Guards that override a score (hot, cold start, the session's worker, a withheld claim) show in the candidate's
own fields and in the decision's reason.
"""

from __future__ import annotations

from typing import Any

from cortex.config import SchedulerConfig
from extproc.policies.base import P2C, ROUND_ROBIN, Candidate, Decision


def cache_terms(c: Candidate, s: SchedulerConfig, block_size: int) -> dict[str, float]:
    """Candidate.score's terms (its sum is the score)."""
    active = c.load if c.load is not None else float(c.inflight)
    cache = s.alpha_ms_per_token * c.affinity_blocks * block_size
    load = s.beta_ms_per_active * active
    queue = s.gamma * c.engine_waiting * s.queued_request_ms
    return {"cache_ms": round(cache, 3), "load_ms": round(-load, 3), "queue_ms": round(-queue, 3),
            "score": round(cache - load - queue, 3)}


def parts(d: Decision, rule: str, s: SchedulerConfig, block_size: int) -> dict[str, dict[str, Any]]:
    """Per candidate id, the rule that placed it and what that rule weighed. `rule` is scheduler.rule."""
    out: dict[str, dict[str, Any]] = {}
    for i, c in enumerate(d.order):
        est = d.estimates.get(c.id)
        if d.mode == ROUND_ROBIN:
            out[c.id] = {"by": "round_robin", "position": i}
        elif est is not None:
            out[c.id] = {"by": "ttft", **est.to_json()}
        elif d.mode == P2C or c.load is None:
            out[c.id] = {"by": "p2c", "inflight": c.inflight}
        elif rule == "cache_aware" and any(x.ledger_trusted and x.affinity_blocks > 0 for x in d.order):
            out[c.id] = {"by": "cache_aware", **cache_terms(c, s, block_size)}
        else:
            out[c.id] = {"by": "load_aware", "active": c.load}
    return out
