"""Pick a worker order for one request from what is known about the candidates (pure, no I/O).

The fallback chain is fixed and always named in the decision (design §2.3):
  exact_kv_events       ledger trusted for the holder and it holds a prefix of this prompt
  load_aware            every candidate's load is known; no proven hit (reason says why)
  fallback_p2c          load partly unknown: power of two choices on Cortex's own in-flight counts
  fallback_round_robin  only liveness is known
First rule for exact-KV (refined by the scoring issue): the longest prefix wins, counting blocks a worker
was just sent (predicted) as well as proven ones; ties go to the lighter worker. Only proven blocks are
claimed. The remaining candidates follow, lightest first, so Envoy's single retry lands on the next-best
worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

EXACT = "exact_kv_events"
LOAD_AWARE = "load_aware"
P2C = "fallback_p2c"
ROUND_ROBIN = "fallback_round_robin"
MODES = (EXACT, LOAD_AWARE, P2C, ROUND_ROBIN)


@dataclass(frozen=True, slots=True)
class Candidate:
    id: str
    slot: int
    address: str
    matched_blocks: int = 0
    """Leading prompt blocks the ledger proves this worker holds (0 when the ledger is not trusted for it)."""
    ledger_trusted: bool = False
    engine_load: float | None = None
    """running + waiting as the engine last reported it; None when unknown or too old."""
    inflight: int = 0
    """Requests Cortex routed to it that have not ended (all extproc processes)."""
    predicted_blocks: int = 0
    """Leading blocks it holds or is about to hold (a request Cortex just sent it): used to choose, never claimed."""
    rank: int | None = None
    """Data-parallel rank to pin on the worker, or None."""
    engine: str = "vllm"

    @property
    def affinity_blocks(self) -> int:
        return max(self.matched_blocks, self.predicted_blocks)

    @property
    def load(self) -> float | None:
        # The engine's figure lags by a poll interval; Cortex's own count is current but misses other
        # clients' traffic. The larger of the two is the safer estimate.
        return None if self.engine_load is None else max(self.engine_load, float(self.inflight))


@dataclass(frozen=True, slots=True)
class Decision:
    order: tuple[Candidate, ...]
    mode: str
    reason: str
    hit_tokens: int = 0
    matched_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def chosen(self) -> Candidate:
        return self.order[0]


def _by_load(cands: Sequence[Candidate], start: int) -> list[Candidate]:
    # Rotate before the stable sort so equal loads take turns instead of always hitting the first worker.
    k = start % len(cands)
    rotated = list(cands[k:]) + list(cands[:k])
    return sorted(rotated, key=lambda c: c.load if c.load is not None else float(c.inflight))


def decide(cands: Sequence[Candidate], *, block_size: int, ledger_usable: bool, why_not_exact: str,
           turn: int, rng: random.Random | None = None) -> Decision:
    """`why_not_exact` names the reason used when no proven hit decides; `turn` rotates ties."""
    if not cands:
        raise ValueError("no candidates")
    matched = {c.id: c.matched_blocks * block_size for c in cands if c.ledger_trusted}
    if ledger_usable:
        holders = [c for c in cands if c.ledger_trusted and c.affinity_blocks > 0]
        if holders:
            best = max(holders, key=lambda c: (c.affinity_blocks, c.matched_blocks, -(c.load or 0.0), -c.inflight))
            rest = [c for c in _by_load(cands, turn) if c is not best]
            if best.matched_blocks == 0:
                # Only a prediction: follow it so siblings do not scatter, but claim nothing.
                return Decision((best, *rest), LOAD_AWARE, "predicted_prefix", 0, matched)
            return Decision((best, *rest), EXACT, "longest_cached_prefix",
                            best.matched_blocks * block_size, matched)
    if all(c.load is not None for c in cands):
        return Decision(tuple(_by_load(cands, turn)), LOAD_AWARE, why_not_exact, 0, matched)
    if len(cands) == 1:
        return Decision(tuple(cands), P2C, "load_unknown_single_candidate", 0, matched)
    r = rng or random
    a, b = r.sample(list(cands), 2)
    first = a if a.inflight <= b.inflight else b
    rest = sorted((c for c in cands if c is not first), key=lambda c: c.inflight)
    return Decision((first, *rest), P2C, "load_unknown", 0, matched)


def round_robin(cands: Sequence[Candidate], turn: int, reason: str) -> Decision:
    k = turn % len(cands)
    return Decision(tuple(list(cands[k:]) + list(cands[:k])), ROUND_ROBIN, reason)
