"""Decide by time: the candidate with the smallest predicted time to first token, work included.

For each candidate the model predicts, in milliseconds, from facts Cortex holds exactly (docs/scheduling.md):

    uncached  = prompt tokens - the leading tokens the worker holds (ledger) or is about to hold (prediction)
    queue     = prefill work queued ahead there: the larger of Cortex's own (every request this replica sent
                there whose predicted prefill is not done yet, extproc/backlog.py) and the engine's waiting
                count times the typical prefill of a request here (the other replicas' and clients' share)
    prefill   = steps x (step_ms + running_ms_per_request x running)      one engine step per step_tokens
                + alpha_ms_per_token x uncached                           the weight-bound part
                + attention_ms_per_token2 x uncached x (cached + uncached / 2)   attention over the context
    ttft      = calibration x (queue + prefill)      calibration: the worker's observed / predicted TTFT ratio
    eviction  = regret share x calibration x prefill  what its new blocks evict there and will be needed again
    score     = ttft + work_weight x calibration x prefill + eviction_weight x eviction

and picks the smallest score among the cool candidates. The work term is the price of fleet capacity: between
two equal TTFTs (a copy of a burst queued behind its twin's prefill, or an idle worker that computes it all
again) the one that spends less GPU time wins, so bursts and conversations stay together while it costs them
nothing, and leave as soon as the wait outweighs the recompute.

Guards, as in cache_aware.py: a hot worker (over the request-count watermark, or its predicted queue over
`high_queue_ms`, both with hysteresis; candidates.py keeps the flags) gets no traffic while a cool one exists,
and the cold-start share applies to requests no cool worker holds. Only proven blocks are ever claimed (mode
`exact_kv_events`); predictions count for choosing only. With no holder at all the prompt goes by predicted
queue, ties to its rendezvous home (load_aware.py), so replicas agree. With several replicas
(`scheduler.replicas`), a prompt goes to its home among the near-best candidates instead (`near_home`: replicas
deciding at once from one view would otherwise all pick the same worker; reason `replica_spread`). Candidates
whose load is unknown go to p2c.py (tiers.py). O(candidates) per decision.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import extproc.policies.load_aware as load_aware
from cortex.config import SchedulerConfig
from extproc.policies.base import EXACT, LOAD_AWARE, Candidate, Decision, Facts, by_load, queue_ms
from extproc.policies.tiers import tiered

TIE_MS = 0.5
"""Scores this close are a tie (broken by proven blocks, then load, then the prompt's home, then at random)."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """One candidate's predicted time to first token and its parts, in milliseconds (route explain shows it)."""

    uncached_tokens: int
    queue_ms: float
    prefill_ms: float
    calibration: float
    ttft_ms: float
    score: float
    eviction_ms: float = 0.0

    def to_json(self) -> dict[str, float | int]:
        return {"uncached_tokens": self.uncached_tokens, "queue_ms": round(self.queue_ms, 2),
                "prefill_ms": round(self.prefill_ms, 2), "calibration": round(self.calibration, 3),
                "predicted_ttft_ms": round(self.ttft_ms, 2), "eviction_ms": round(self.eviction_ms, 2),
                "score": round(self.score, 2)}


def prefill_ms(uncached: int, cached: int, running: float, s: SchedulerConfig) -> float:
    """The modelled time to compute `uncached` prompt tokens after `cached` ones beside `running` requests."""
    if uncached <= 0:
        return s.step_ms + s.running_ms_per_request * running  # the step that samples the first token
    steps = math.ceil(uncached / s.step_tokens)
    return (steps * (s.step_ms + s.running_ms_per_request * running) + s.alpha_ms_per_token * uncached
            + s.attention_ms_per_token2 * uncached * (cached + uncached / 2))


def running_of(c: Candidate) -> float:
    if c.engine_load is None:
        return float(c.inflight)
    return max(c.engine_load - c.engine_waiting, 0.0)


def estimate(c: Candidate, facts: Facts) -> Estimate:
    s = facts.scoring
    cached = min(round(c.affinity_blocks * facts.block_size), facts.prompt_tokens)
    uncached = facts.prompt_tokens - cached
    typical = facts.typical_prefill_ms if facts.typical_prefill_ms is not None else s.queued_request_ms
    q = queue_ms(c, typical)
    p = prefill_ms(uncached, cached, running_of(c), s)
    ttft = c.calibration * (q + p)
    # The uncached tokens evict as many there; the share of those that comes back is prefilled again later.
    evict = c.regret_share * c.calibration * p if uncached > 0 else 0.0
    return Estimate(uncached, q, p, c.calibration, ttft,
                    ttft + s.work_weight * c.calibration * p + s.eviction_weight * evict, evict)


def fastest(known: Sequence[Candidate], facts: Facts, turn: int, rng: random.Random,
            matched: dict[str, int]) -> Decision:
    """The rule for known-load candidates (tiers.py hands them over)."""
    ordered = by_load(known, turn)
    cool = load_aware.cool_of(ordered)
    warm = load_aware.cold_start(known, ordered, cool, facts, rng, matched)
    if warm is not None:
        return warm
    s = facts.scoring
    est = {c.id: estimate(c, facts) for c in known}
    low = min(est[c.id].score for c in cool)
    tied = [c for c in cool if est[c.id].score - low <= TIE_MS]  # in rotated load order: ties take turns
    home = facts.home

    def rank(c: Candidate) -> tuple[int, float, int]:
        # Proven blocks first, then the less active (decodes slow every step a little, and ITL with them), then
        # the prompt's home, so replicas agree on where a prompt no one holds goes.
        home_weight = load_aware.rendezvous(home, f"{c.id}/{c.rank}") if home is not None else 0
        return c.matched_blocks, -(c.load or 0.0), home_weight

    fastest_one = max(tied, key=rank)
    best = near_home(fastest_one, cool, est, facts, home) if s.replicas > 1 and home is not None else fastest_one
    rest = sorted((c for c in known if c is not best), key=lambda c: est[c.id].score)
    order = (best, *rest)
    bs = facts.block_size
    if best is not fastest_one:
        return Decision(order, EXACT if best.matched_blocks > 0 else LOAD_AWARE, "replica_spread",
                        best.matched_blocks * bs, matched, est)
    if best.matched_blocks > 0:
        longest = best.matched_blocks >= max(c.matched_blocks for c in known)
        return Decision(order, EXACT, "longest_cached_prefix" if longest else "lowest_predicted_ttft",
                        best.matched_blocks * bs, matched, est)
    if any(c.hot and c.matched_blocks > 0 for c in known):
        return Decision(order, LOAD_AWARE, "holder_over_high_watermark", 0, matched, est)
    if best.predicted_blocks > 0:
        return Decision(order, LOAD_AWARE, "predicted_prefix", 0, matched, est)
    if any(c.affinity_blocks > 0 for c in known):  # a holder (proven or predicted) would have been slower
        return Decision(order, LOAD_AWARE, "holder_slower", 0, matched, est)
    return Decision(order, LOAD_AWARE, facts.why_not_exact, 0, matched, est)


def near_home(best: Candidate, cool: Sequence[Candidate], est: dict[str, Estimate], facts: Facts,
              home: int) -> Candidate:
    """Several replicas: `best`, or the prompt's home among the `replicas` candidates that hold as much of the
    prompt as `best` and score within the band.

    Replicas that decide at the same instant share one view (the engines' events and load readings; none has
    seen the others' picks yet), so a burst spread over them by an L4 balancer would land whole on the fastest
    worker and queue there. Within the band a collision costs more than the worse score, so each prompt takes
    its rendezvous home among the near-best: different prompts scatter, identical ones (a client sampling n
    answers) still meet, and every replica computes the same choice for the same prompt."""
    s = facts.scoring
    typical = facts.typical_prefill_ms if facts.typical_prefill_ms is not None else s.queued_request_ms
    limit = est[best.id].score + s.replica_band * typical
    # Only among candidates holding as much of the prompt as the best: spreading never gives up a cached block
    # (a repeat's holder would otherwise lose it to a short prompt's band).
    near = sorted((c for c in cool if c is not best and c.affinity_blocks >= best.affinity_blocks
                   and est[c.id].score <= limit), key=lambda c: est[c.id].score)
    band = [best, *near[:s.replicas - 1]]
    return max(band, key=lambda c: load_aware.rendezvous(home, f"{c.id}/{c.rank}"))


class Ttft:
    """The time model, falling back to load (no trusted holder: the queue decides) and p2c (no known load)."""

    name = "ttft"

    def decide(self, cands: Sequence[Candidate], facts: Facts, rng: random.Random) -> Decision:
        return tiered(cands, facts, rng.getrandbits(32), rng, fastest)
