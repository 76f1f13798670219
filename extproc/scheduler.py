"""Pick a worker order for one request from what is known about the candidates (pure, no I/O).

The fallback chain is fixed and always named in the decision (design §2.3):
  exact_kv_events       the chosen worker's ledger is trusted and proves a cached prefix of this prompt
  load_aware            the chosen worker's load is known; no proven hit on it (reason says why)
  fallback_p2c          no candidate's load is known: power of two choices on Cortex's own in-flight counts
  fallback_round_robin  only liveness is known

One bad worker never takes the rest of the fleet down a step of the chain. The candidates are ranked in
tiers, and only the first non-empty tier competes for the first attempt:
  1. standing: a worker in good standing (its last health probe passed, `suspect` false) goes before any
     worker that failed its latest probe or was never probed yet, while one in good standing exists;
  2. load: inside that tier, candidates whose engine load is known are scored as below (the decision's
     mode and reason come from them alone); candidates whose load is unknown (a dead or unreachable
     worker, a broken metrics endpoint, a reading older than LOAD_MAX_AGE_S) follow them, fewest Cortex
     in-flight requests first. Only when no candidate of the tier has a known load is it `fallback_p2c`
     (reason `load_unknown`);
  3. the other tier follows, known load before unknown, least active first, as retry targets only.
So an unknown or failing worker can be a retry target but never takes a first attempt, nor a hit, from a
worker that is known to be up.

Scoring (design §2.3), in milliseconds of expected time to first token saved or lost:

    score(w) = alpha * matched_tokens(w) - beta * active(w) - gamma * queue_latency(w)

`matched_tokens` counts blocks proven by the ledger plus blocks the worker was just sent (predicted),
since following a prediction keeps a burst together; only proven blocks are ever claimed. `active` is
the larger of the engine's running+waiting count and Cortex's own in-flight count (the engine's figure
lags a poll; Cortex's misses other clients). `queue_latency` is the engine's waiting count times the
time one queued request holds the line.

Guards against piling onto one GPU (seed 004 §3.2):
  * high watermark with hysteresis: a worker whose `active` reaches `high_watermark` is "hot" and gets no
    affinity traffic until it drops to `low_watermark`, so it does not flip between modes per request;
  * near-minimum-load window: when the longest holder is within `near_min_window` requests of the least
    loaded candidate, it is preferred even if a load term would tip the score elsewhere;
  * cold start: a worker younger than `cold_start_s` gets `cold_start_share` of the requests that no one
    can serve from cache, so a new, empty GPU warms up instead of starving.

Several replicas: a prompt no worker holds yet goes, among the least loaded workers, to its "home": the one
with the highest rendezvous weight for the prompt's first block key. Independent gateway replicas know
nothing of each other's requests until the engines' events arrive, so without a shared rule identical
prompts arriving at different replicas at once (a client sampling n answers through an L4 balancer) would be
scattered; the home is the same on every replica, uniform over prompts, and never outweighs load.

Complexity: O(candidates) per decision. The remaining candidates follow the chosen one by score, so
Envoy's single retry lands on the next-best worker.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

EXACT = "exact_kv_events"
LOAD_AWARE = "load_aware"
P2C = "fallback_p2c"
ROUND_ROBIN = "fallback_round_robin"
MODES = (EXACT, LOAD_AWARE, P2C, ROUND_ROBIN)


@dataclass(frozen=True, slots=True)
class Scoring:
    alpha_ms_per_token: float = 0.05
    beta_ms_per_active: float = 5.0
    gamma: float = 1.0
    queued_request_ms: float = 100.0
    high_watermark: float = 48.0
    low_watermark: float = 32.0
    near_min_window: float = 2.0
    cold_start_share: float = 0.1
    prompt_home: bool = True


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
    engine_waiting: float = 0.0
    """The queued part of engine_load."""
    hot: bool = False
    """Over the high watermark and not yet back under the low one."""
    new: bool = False
    """Inside its cold-start window."""
    rank: int | None = None
    """Data-parallel rank to pin on the worker, or None."""
    engine: str = "vllm"
    suspect: bool = False
    """Not in good standing: its latest health probe failed, or it was never probed yet (ingest's view)."""

    @property
    def affinity_blocks(self) -> int:
        return max(self.matched_blocks, self.predicted_blocks)

    @property
    def load(self) -> float | None:
        return None if self.engine_load is None else max(self.engine_load, float(self.inflight))

    def score(self, s: Scoring, block_size: int) -> float:
        active = self.load if self.load is not None else float(self.inflight)
        return (s.alpha_ms_per_token * self.affinity_blocks * block_size
                - s.beta_ms_per_active * active
                - s.gamma * self.engine_waiting * s.queued_request_ms)


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


def still_hot(was_hot: bool, active: float, s: Scoring) -> bool:
    """Hysteresis: hot from the high watermark on, until the low watermark is reached again."""
    return active > s.low_watermark if was_hot else active >= s.high_watermark


def _by_load(cands: Sequence[Candidate], start: int) -> list[Candidate]:
    # Rotate before the stable sort so equal loads take turns instead of always hitting the first worker.
    k = start % len(cands)
    rotated = list(cands[k:]) + list(cands[:k])
    return sorted(rotated, key=lambda c: c.load if c.load is not None else float(c.inflight))


def rendezvous(home: int, worker: str) -> int:
    """The weight of `worker` for the prompt whose first block key is `home` (highest random weight hashing):
    every replica computes the same weights from the same worker ids, and a worker leaving moves only the
    prompts it was home to."""
    return ((home ^ zlib.crc32(worker.encode())) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF


def decide(cands: Sequence[Candidate], *, block_size: int, ledger_usable: bool, why_not_exact: str,
           turn: int, scoring: Scoring | None = None, rng: random.Random | None = None,
           home: int | None = None) -> Decision:
    """`why_not_exact` names the reason used when no proven hit decides; `turn` rotates ties; `home` (the
    prompt's first block key) breaks ties between equally loaded workers for a prompt no one holds, so that
    independent replicas send the same new prompt to the same worker (module docstring).

    Tiers (module docstring): workers in good standing first, known load before unknown inside a tier.
    """
    if not cands:
        raise ValueError("no candidates")
    s = scoring or Scoring()
    r = rng or random
    matched = {c.id: c.matched_blocks * block_size for c in cands if c.ledger_trusted}
    good = [c for c in cands if not c.suspect]
    tier = good or list(cands)  # nobody in good standing: they all compete alike
    known = [c for c in tier if c.load is not None]
    if known:
        lead = _scored(known, s, block_size, ledger_usable, why_not_exact, turn, r, matched, home)
    elif len(tier) == 1:
        lead = Decision(tuple(tier), P2C, "load_unknown_single_candidate", 0, matched)
    else:
        a, b = r.sample(tier, 2)
        first = a if a.inflight <= b.inflight else b
        lead = Decision((first, *_by_activity(c for c in tier if c is not first)), P2C, "load_unknown", 0, matched)
    ranked = {id(c) for c in lead.order}
    rest = _by_activity(c for c in cands if id(c) not in ranked)
    if not rest:
        return lead
    return Decision((*lead.order, *rest), lead.mode, lead.reason, lead.hit_tokens, matched)


def _by_activity(cands: Iterable[Candidate]) -> list[Candidate]:
    """Retry targets behind the competing ones: good standing first, then known load, then least active."""
    return sorted(cands, key=lambda c: (c.suspect, c.load is None,
                                        c.load if c.load is not None else float(c.inflight)))


def _scored(cands: Sequence[Candidate], s: Scoring, bs: int, ledger_usable: bool, why: str, turn: int,
            r: random.Random, matched: dict[str, int], home: int | None = None) -> Decision:
    by_load = _by_load(cands, turn)
    cool = [c for c in by_load if not c.hot] or by_load[:1]  # all hot: the least loaded still has to serve
    affinity = ledger_usable and any(c.ledger_trusted and c.affinity_blocks > 0 for c in cands)
    new = [c for c in cool if c.new]
    # Only while older workers exist (a fleet starting up is all cold alike), and never for a request some
    # worker holds or is about to hold.
    if (new and len(new) < len(cands) and not any(c.affinity_blocks > 0 for c in cool)
            and r.random() < s.cold_start_share):
        # Nothing here is served from cache anyway: let a new, empty worker warm up.
        first = new[0]
        return Decision((first, *(c for c in by_load if c is not first)), LOAD_AWARE, "cold_start_share", 0,
                        matched)
    if not affinity:
        first = cool[0]
        if home is not None:
            tied = [c for c in cool if c.load == first.load]
            first = max(tied, key=lambda c: rendezvous(home, f"{c.id}/{c.rank}"))
        return Decision((first, *(c for c in by_load if c is not first)), LOAD_AWARE, why, 0, matched)
    # Equal scores: proven blocks beat predicted ones; then max() keeps the first, and `cool` is in rotated
    # load order, so remaining ties take turns.
    best = max(cool, key=lambda c: (c.score(s, bs), c.matched_blocks))
    holder = max(cool, key=lambda c: (c.affinity_blocks, -(c.load or 0.0)))
    floor = min(c.load or 0.0 for c in cool)
    if holder.affinity_blocks > best.affinity_blocks and (holder.load or 0.0) <= floor + s.near_min_window:
        best = holder
    rest = sorted((c for c in cands if c is not best), key=lambda c: -c.score(s, bs))
    order = (best, *rest)
    if best.matched_blocks > 0:
        longest = best.matched_blocks >= max(c.matched_blocks for c in cands)
        return Decision(order, EXACT, "longest_cached_prefix" if longest else "cache_vs_load",
                        best.matched_blocks * bs, matched)
    if any(c.hot and c.matched_blocks > 0 for c in cands):
        return Decision(order, LOAD_AWARE, "holder_over_high_watermark", 0, matched)
    if best.predicted_blocks > 0:
        # Only a prediction: follow it so siblings do not scatter, but claim nothing.
        return Decision(order, LOAD_AWARE, "predicted_prefix", 0, matched)
    if any(c.affinity_blocks > 0 for c in cands):  # a holder (proven or predicted) lost on load
        return Decision(order, LOAD_AWARE, "holder_too_loaded", 0, matched)
    return Decision(order, LOAD_AWARE, why, 0, matched)


def round_robin(cands: Sequence[Candidate], turn: int, reason: str) -> Decision:
    k = turn % len(cands)
    return Decision(tuple(list(cands[k:]) + list(cands[:k])), ROUND_ROBIN, reason)
