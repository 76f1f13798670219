"""Exact-KV cache-aware scoring: the worker that saves the most time to first token, cache against load.

Scoring (design §2.3), in milliseconds of expected time to first token saved or lost:

    score(w) = alpha * matched_tokens(w) - beta * active(w) - gamma * queue_latency(w)

`matched_tokens` counts blocks proven by the ledger plus blocks the worker was just sent (predicted), since
following a prediction keeps a burst together; only proven blocks are ever claimed (mode `exact_kv_events`,
a hit). `active` is the larger of the engine's running+waiting count and Cortex's own in-flight count;
`queue_latency` is the engine's waiting count times the time one queued request holds the line.

Guards against piling onto one GPU (seed 004 §3.2): a hot worker (over the high watermark, hysteresis down to
the low one) gets no affinity traffic; a holder within `near_min_window` requests of the least loaded
candidate is preferred even if a load term would tip the score elsewhere; the cold-start share of
load_aware.py applies to requests no cool worker holds. With no trusted holder at all this is load_aware.py's
rule, and candidates whose load is unknown go to p2c.py (tiers.py). The remaining candidates follow the chosen
one by score, so Envoy's single retry lands on the next-best worker. O(candidates) per decision.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import extproc.policies.load_aware as load_aware
from cortex.config import SchedulerConfig
from extproc.policies.base import DEFAULT_SCORING, EXACT, LOAD_AWARE, Candidate, Decision, Facts, by_load
from extproc.policies.tiers import tiered


def best_holder(known: Sequence[Candidate], facts: Facts, turn: int, rng: random.Random,
                matched: dict[str, int]) -> Decision:
    """The rule for known-load candidates (tiers.py hands them over)."""
    if not (facts.ledger_usable and any(c.ledger_trusted and c.affinity_blocks > 0 for c in known)):
        return load_aware.least_loaded(known, facts, turn, rng, matched)
    s, bs = facts.scoring, facts.block_size
    ordered = by_load(known, turn)
    cool = load_aware.cool_of(ordered)
    warm = load_aware.cold_start(known, ordered, cool, facts, rng, matched)
    if warm is not None:
        return warm
    # Equal scores: proven blocks beat predicted ones; then max() keeps the first, and `cool` is in rotated
    # load order, so remaining ties take turns.
    best = max(cool, key=lambda c: (c.score(s, bs), c.matched_blocks))
    holder = max(cool, key=lambda c: (c.affinity_blocks, -(c.load or 0.0)))
    floor = min(c.load or 0.0 for c in cool)
    if holder.affinity_blocks > best.affinity_blocks and (holder.load or 0.0) <= floor + s.near_min_window:
        best = holder
    rest = sorted((c for c in known if c is not best), key=lambda c: -c.score(s, bs))
    order = (best, *rest)
    if best.matched_blocks > 0:
        longest = best.matched_blocks >= max(c.matched_blocks for c in known)
        return Decision(order, EXACT, "longest_cached_prefix" if longest else "cache_vs_load",
                        best.matched_blocks * bs, matched)
    if any(c.hot and c.matched_blocks > 0 for c in known):
        return Decision(order, LOAD_AWARE, "holder_over_high_watermark", 0, matched)
    if best.predicted_blocks > 0:
        # Only a prediction: follow it so siblings do not scatter, but claim nothing.
        return Decision(order, LOAD_AWARE, "predicted_prefix", 0, matched)
    if any(c.affinity_blocks > 0 for c in known):  # a holder (proven or predicted) lost on load
        return Decision(order, LOAD_AWARE, "holder_too_loaded", 0, matched)
    return Decision(order, LOAD_AWARE, facts.why_not_exact, 0, matched)


def decide(cands: Sequence[Candidate], *, block_size: int, ledger_usable: bool, why_not_exact: str,
           turn: int, scoring: SchedulerConfig | None = None, rng: random.Random | None = None,
           home: int | None = None) -> Decision:
    """The whole chain as one pure function with an explicit tie rotation (`turn`); tests/test_scheduler.py's
    vectors call it. `home` (the prompt's first block key) breaks ties between equally loaded workers for a
    prompt no one holds (load_aware.py)."""
    facts = Facts(block_size, ledger_usable, why_not_exact, scoring or DEFAULT_SCORING, home)
    return tiered(cands, facts, turn, rng or random.Random(), best_holder)


class CacheAware:
    """Exact-KV cache-aware scoring, falling back to load (no trusted holder) and p2c (no known load)."""

    name = "cache_aware"

    def decide(self, cands: Sequence[Candidate], facts: Facts, rng: random.Random) -> Decision:
        return tiered(cands, facts, rng.getrandbits(32), rng, best_holder)
