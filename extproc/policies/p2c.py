"""Power of two choices on Cortex's own in-flight counts: for candidates whose engine load is unknown.

Two candidates drawn at random, the one with fewer requests in flight goes first; the rest follow, least
active first. The in-flight count is Cortex's own (all extproc processes), so it is known even when no engine
load is (a dead or unreachable metrics endpoint, ingest restarting).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import extproc.policies.claims as claims
import extproc.policies.session as session
from extproc.policies.base import P2C, Candidate, Decision, Facts, by_activity, matched_of


def pick(tier: Sequence[Candidate], rng: random.Random, matched: dict[str, int]) -> Decision:
    if len(tier) == 1:
        return Decision(tuple(tier), P2C, "load_unknown_single_candidate", 0, matched)
    a, b = rng.sample(list(tier), 2)
    first = a if a.inflight <= b.inflight else b
    return Decision((first, *by_activity(c for c in tier if c is not first)), P2C, "load_unknown", 0, matched)


class PowerOfTwo:
    """Ignores engine load and the cache: good standing first, then p2c on in-flight counts."""

    name = "p2c"

    def decide(self, cands: Sequence[Candidate], facts: Facts, rng: random.Random) -> Decision:
        if not cands:
            raise ValueError("no candidates")
        matched = matched_of(cands, facts.block_size)
        tier = [c for c in cands if not c.suspect] or list(cands)
        lead = pick(tier, rng, matched)
        ranked = {id(c) for c in lead.order}
        rest = by_activity(c for c in cands if id(c) not in ranked)
        d = lead if not rest else Decision((*lead.order, *rest), lead.mode, lead.reason, 0, matched)
        return claims.withheld(session.stick(d, cands, facts), facts)
