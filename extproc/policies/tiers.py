"""The tiers every load-reading policy shares (one bad worker never takes the fleet down a step of the chain).

  1. standing: a worker in good standing (its last health probe passed, `suspect` false) goes before any worker
     that failed its latest probe or was never probed yet, while one in good standing exists;
  2. load: inside that tier, candidates whose engine load is known go to the policy's own rule (the decision's
     mode and reason come from them alone); candidates whose load is unknown follow them, fewest Cortex
     in-flight requests first. Only when no candidate of the tier has a known load does power of two choices
     decide (p2c.py, reason `load_unknown`);
  3. the other tier follows, known load before unknown, least active first, as retry targets only.
Then session affinity (session.py), when the request names a session: its worker first unless a proven larger
hit elsewhere decides. Last, a hit on a worker whose KV pool is nearly full is not claimed (claims.py).
So an unknown or failing worker can be a retry target but never takes a first attempt, nor a hit, from a worker
that is known to be up.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace

import extproc.policies.claims as claims
import extproc.policies.p2c as p2c
import extproc.policies.session as session
from extproc.policies.base import Candidate, Decision, Facts, by_activity, matched_of

Lead = Callable[[Sequence[Candidate], Facts, int, random.Random, dict[str, int]], Decision]
"""A policy's rule for the known-load candidates of the leading tier: (known, facts, turn, rng, matched)."""


def tiered(cands: Sequence[Candidate], facts: Facts, turn: int, rng: random.Random, lead: Lead) -> Decision:
    if not cands:
        raise ValueError("no candidates")
    matched = matched_of(cands, facts.block_size)
    good = [c for c in cands if not c.suspect]
    tier = good or list(cands)  # nobody in good standing: they all compete alike
    known = [c for c in tier if c.load is not None]
    first = lead(known, facts, turn, rng, matched) if known else p2c.pick(tier, rng, matched)
    ranked = {id(c) for c in first.order}
    rest = by_activity(c for c in cands if id(c) not in ranked)
    if rest:
        first = replace(first, order=(*first.order, *rest), matched_tokens=matched)
    return claims.withheld(session.stick(first, cands, facts), facts)

