"""Transparent: another scheduler owns this model's placement (`models[].scheduling: transparent`, docs/pd.md).

Cortex forwards by load alone: it makes no KV or PD decision and never claims a hit, but still observes
(ledger, metrics, headers). extproc/prepare.py therefore only counts such a prompt's tokens (no keys, no
lookup, no PD pools), and the reason is always `transparent_proxy`. No session affinity either: placement is the
other scheduler's.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from extproc.policies.base import Candidate, Decision, Facts
from extproc.policies.load_aware import least_loaded
from extproc.policies.tiers import tiered

REASON = "transparent_proxy"


class Transparent:
    name = "transparent"

    def decide(self, cands: Sequence[Candidate], facts: Facts, rng: random.Random) -> Decision:
        plain = replace(facts, ledger_usable=False, why_not_exact=REASON, home=None,
                        session=None)
        return tiered(cands, plain, rng.getrandbits(32), rng, least_loaded)
