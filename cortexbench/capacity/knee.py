"""The knee of a concurrency sweep, and seed 004 §4.4's rule: set the gateway's max_concurrent to 80 % of it.

The knee is the concurrency after which throughput stops growing with concurrency while latency climbs: the
last step before the first step that is past it. A step is past the knee when, against the step before it,

* doubling concurrency (or whatever the ratio) bought less than `min_gain` of the ideal throughput gain
  (gain = (tput_now / tput_before - 1) / (conc_now / conc_before - 1); 1 is linear scaling), or
* its p90 time to first token is more than `ttft_jump` times the step before's, by at least `ttft_jump_min_s`
  (the floor keeps a 4 ms -> 9 ms wobble at low load from counting), or

on its own when requests failed (more than `max_error_ratio` of them) or its p90 TTFT breaks the optional SLO.
The 20 % left below the knee absorbs bursts and slow requests piling up (seed 004 §4.4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

KNEE_FRACTION = 0.8


def recommend(knee: int, fraction: float = KNEE_FRACTION) -> int:
    """`fraction` of the knee, rounded down, at least 1 when the knee is; 0 when nothing fits."""
    if not 0 < fraction <= 1:
        raise ValueError(f"knee fraction must be in (0, 1], got {fraction}")
    if knee < 1:
        return 0
    return max(1, math.floor(Fraction(str(fraction)) * knee))


@dataclass(frozen=True, slots=True)
class Step:
    """What one concurrency level measured."""

    concurrency: int
    completed: int
    errors: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    output_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class KneeRule:
    min_gain: float = 0.2
    ttft_jump: float = 2.0
    ttft_jump_min_s: float = 0.05
    ttft_slo_s: float | None = None
    max_error_ratio: float = 0.0


@dataclass(frozen=True, slots=True)
class Knee:
    concurrency: int
    """The knee (0 when even the first step was past it); without `found`, the highest concurrency measured."""
    found: bool
    """A step past the knee was measured; otherwise the knee is at least `concurrency`."""
    reason: str
    recommended_max_concurrent: int


def _alone(step: Step, rule: KneeRule) -> str | None:
    """Why this step is past the knee whatever came before it."""
    total = step.completed + step.errors
    if step.completed == 0:
        return "no request completed"
    if step.errors and step.errors / total > rule.max_error_ratio:
        return f"{step.errors} of {total} requests failed"
    if rule.ttft_slo_s is not None and step.ttft_p90_s is not None and step.ttft_p90_s > rule.ttft_slo_s:
        return f"TTFT p90 {step.ttft_p90_s * 1000:.0f} ms is above the SLO of {rule.ttft_slo_s * 1000:.0f} ms"
    return None


def _against(before: Step, step: Step, rule: KneeRule) -> str | None:
    """Why this step is past the knee compared with the one before it."""
    if step.concurrency > before.concurrency and before.output_tokens_per_s > 0:
        gain = (step.output_tokens_per_s / before.output_tokens_per_s - 1) / (step.concurrency / before.concurrency - 1)
        if gain < rule.min_gain:
            return (f"throughput {before.output_tokens_per_s:.0f} -> {step.output_tokens_per_s:.0f} tokens/s for "
                    f"{step.concurrency / before.concurrency:g}x the concurrency ({gain:.0%} of linear scaling, "
                    f"below {rule.min_gain:.0%})")
    if step.ttft_p90_s is not None and before.ttft_p90_s is not None and (
            step.ttft_p90_s > rule.ttft_jump * before.ttft_p90_s
            and step.ttft_p90_s - before.ttft_p90_s >= rule.ttft_jump_min_s):
        return (f"TTFT p90 {before.ttft_p90_s * 1000:.0f} -> {step.ttft_p90_s * 1000:.0f} ms "
                f"(more than {rule.ttft_jump:g}x)")
    return None


def find_knee(steps: Sequence[Step], rule: KneeRule | None = None, fraction: float = KNEE_FRACTION) -> Knee:
    """The knee of steps measured at increasing concurrency."""
    if not steps:
        raise ValueError("no steps measured")
    rule = rule or KneeRule()
    for i, step in enumerate(steps):
        reason = _alone(step, rule) or (_against(steps[i - 1], step, rule) if i else None)
        if reason is None:
            continue
        if i == 0:
            return Knee(0, True, f"already past the knee at concurrency {step.concurrency}: {reason}", 0)
        knee = steps[i - 1].concurrency
        return Knee(knee, True, f"at concurrency {step.concurrency}: {reason}", recommend(knee, fraction))
    last = steps[-1].concurrency
    return Knee(last, False, f"no knee up to concurrency {last}: the worker kept scaling; the knee is higher "
                             "(raise --max-concurrency to find it)", recommend(last, fraction))
