"""Load-aware: the least active worker, for a prompt no trusted ledger entry ties to a worker.

`active` is the larger of the engine's running+waiting count and Cortex's own in-flight count (the engine's
figure lags a poll; Cortex's misses other clients). Two guards:
  * high watermark with hysteresis: a worker that is "hot" (candidates.py keeps the flag per worker) is passed
    over while a cool one exists;
  * cold start: a worker younger than `cold_start_s` gets `cold_start_share` of the requests that no one can
    serve from cache, so a new, empty GPU warms up instead of starving.

Several replicas: a prompt no worker holds yet goes, among the least loaded workers, to its "home": the one
with the highest rendezvous weight for the prompt's first block key. Independent gateway replicas know
nothing of each other's requests until the engines' events arrive, so without a shared rule identical
prompts arriving at different replicas at once (a client sampling n answers through an L4 balancer) would be
scattered; the home is the same on every replica, uniform over prompts, and never outweighs load. Other ties
are broken at random (the rotation `turn` is drawn from the decision's rng): a counter aliases with arrival
patterns (groups of n requests on n workers advance it by n, so every group's first request saw the same
rotation and bursts piled onto one worker; docs/benchmarks.md).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

from extproc.policies.base import LOAD_AWARE, Candidate, Decision, Facts, by_load
from extproc.policies.tiers import tiered


def rendezvous(home: int, worker: str) -> int:
    """The weight of `worker` for the prompt whose first block key is `home` (highest random weight hashing):
    every replica computes the same weights from the same worker ids, and a worker leaving moves only the
    prompts it was home to."""
    return ((home ^ zlib.crc32(worker.encode())) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF


def cool_of(ordered: list[Candidate]) -> list[Candidate]:
    return [c for c in ordered if not c.hot] or ordered[:1]  # all hot: the least loaded still has to serve


def cold_start(known: Sequence[Candidate], ordered: list[Candidate], cool: list[Candidate], facts: Facts,
               rng: random.Random, matched: dict[str, int]) -> Decision | None:
    """A new, empty worker's share of the requests nothing here serves from cache (None: not this one)."""
    new = [c for c in cool if c.new]
    # Only while older workers exist (a fleet starting up is all cold alike), and never for a request some
    # worker holds or is about to hold.
    if (new and len(new) < len(known) and not any(c.affinity_blocks > 0 for c in cool)
            and rng.random() < facts.scoring.cold_start_share):
        first = new[0]
        return Decision((first, *(c for c in ordered if c is not first)), LOAD_AWARE, "cold_start_share", 0,
                        matched)
    return None


def least_loaded(known: Sequence[Candidate], facts: Facts, turn: int, rng: random.Random,
                 matched: dict[str, int]) -> Decision:
    """The rule for known-load candidates (tiers.py hands them over)."""
    ordered = by_load(known, turn)
    cool = cool_of(ordered)
    warm = cold_start(known, ordered, cool, facts, rng, matched)
    if warm is not None:
        return warm
    first = cool[0]
    if facts.home is not None:
        tied = [c for c in cool if c.load == first.load]
        first = max(tied, key=lambda c: rendezvous(facts.home or 0, f"{c.id}/{c.rank}"))
    return Decision((first, *(c for c in ordered if c is not first)), LOAD_AWARE, facts.why_not_exact, 0, matched)


class LoadAware:
    """By load alone: no cached prefix is used (the ledger did not answer, or the policy ignores it)."""

    name = "load_aware"

    def decide(self, cands: Sequence[Candidate], facts: Facts, rng: random.Random) -> Decision:
        return tiered(cands, facts, rng.getrandbits(32), rng, least_loaded)
