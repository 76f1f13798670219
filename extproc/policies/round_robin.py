"""Round robin: when only liveness is known (no engine load, no in-flight count tells the workers apart).

Each decision takes the next worker in turn, among the workers in good standing while one exists (the others
follow as retry targets, as in every policy: tiers.py), unless the request names a session (session.py). The
rotation starts at a random point drawn from the rng the policy is first handed, so independent processes (and
restarts) do not all begin on the first worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import extproc.policies.session as session
from extproc.policies.base import ROUND_ROBIN, Candidate, Decision, Facts


def round_robin(cands: Sequence[Candidate], turn: int, reason: str) -> Decision:
    k = turn % len(cands)
    return Decision(tuple(list(cands[k:]) + list(cands[:k])), ROUND_ROBIN, reason)


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn: int | None = None

    def decide(self, cands: Sequence[Candidate], facts: Facts, rng: random.Random) -> Decision:
        if not cands:
            raise ValueError("no candidates")
        if self._turn is None:
            self._turn = rng.getrandbits(32)
        turn, self._turn = self._turn, self._turn + 1
        good = [c for c in cands if not c.suspect]
        if not good or len(good) == len(cands):
            return session.stick(round_robin(cands, turn, facts.why_not_exact), cands, facts)
        lead = round_robin(good, turn, facts.why_not_exact)
        return session.stick(Decision((*lead.order, *(c for c in cands if c.suspect)), lead.mode, lead.reason),
                             cands, facts)
