"""Routing policies: each one file behind one interface (base.Policy), chosen per request by `select`.

The fallback chain is fixed and always named in the decision's mode (design §2.3):
  exact_kv_events       ttft.py (scheduler.rule: ttft, the default) or cache_aware.py (rule: cache_aware): the
                        chosen worker's ledger is trusted and proves a cached prefix
  load_aware            load_aware.py: the chosen worker's load is known; no proven hit on it (reason says why)
  fallback_p2c          p2c.py: no candidate's load is known: power of two choices on Cortex's in-flight counts
  fallback_round_robin  round_robin.py: only liveness is known
plus transparent.py, for a model another scheduler places. The shared standing/known-load tiers are tiers.py.
Every policy passes tests/test_policy_conformance.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.policies.base import Candidate, Decision, Facts, Policy
from extproc.policies.cache_aware import CacheAware
from extproc.policies.load_aware import LoadAware
from extproc.policies.p2c import PowerOfTwo
from extproc.policies.round_robin import RoundRobin
from extproc.policies.transparent import Transparent
from extproc.policies.ttft import Ttft

__all__ = ["CacheAware", "Candidate", "Decision", "Facts", "LoadAware", "Policies", "Policy", "PowerOfTwo",
           "RoundRobin", "Transparent", "Ttft"]


@dataclass(slots=True)
class Policies:
    """One instance of each policy for one router (round robin keeps its turn between requests)."""

    cache_aware: CacheAware = field(default_factory=CacheAware)
    load_aware: LoadAware = field(default_factory=LoadAware)
    p2c: PowerOfTwo = field(default_factory=PowerOfTwo)
    round_robin: RoundRobin = field(default_factory=RoundRobin)
    transparent: Transparent = field(default_factory=Transparent)
    ttft: Ttft = field(default_factory=Ttft)

    def select(self, cands: list[Candidate], *, transparent: bool, alive: bool, ledger_usable: bool,
               rule: str = "ttft") -> Policy:
        """The policy for one decision: what is known about the workers picks the step of the chain."""
        if not alive and not any(c.inflight for c in cands):
            # No engine load and no in-flight signal tells the workers apart: only liveness is known.
            return self.round_robin
        if transparent:
            return self.transparent
        # Candidates whose load is unknown are p2c's inside either (tiers.py). The time model decides without a
        # ledger too: then every candidate computes the whole prompt and the queues decide.
        if rule == "ttft":
            return self.ttft
        return self.cache_aware if ledger_usable else self.load_aware
