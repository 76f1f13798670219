"""What every routing policy sees and returns: candidates, the facts of one decision, the decision itself.

A policy takes the candidates (built in one place, extproc/candidates.py) and the facts, and returns a
`Decision`: an order of candidates, the match mode and a reason code. Never headers, never I/O: the server
maps the decision onto Envoy's mutations. Randomness comes only from the `random.Random` a policy is handed,
so a decision is deterministic given its seed (tests/test_policy_conformance.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cortex import engines
from cortex.config import SchedulerConfig
from cortex.inflight import Touch

EXACT = "exact_kv_events"
LOAD_AWARE = "load_aware"
P2C = "fallback_p2c"
ROUND_ROBIN = "fallback_round_robin"
MODES = (EXACT, LOAD_AWARE, P2C, ROUND_ROBIN)

DEFAULT_SCORING = SchedulerConfig()


@dataclass(frozen=True, slots=True)
class Candidate:
    id: str
    slot: int
    address: str
    matched_blocks: int = 0
    """Leading prompt blocks the ledger proves this worker's engine reuses, as it counts them in `cached_tokens`
    (0 when the ledger is not trusted for it): its GPU hit, then the part of a lower tier's run it counts."""
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
    """Over the high watermark and not yet back under the low one (by requests, or by predicted queue)."""
    hot_requests: bool = False
    """The request-count flag alone, as a committed decision carries it to the next (candidates.Hysteresis)."""
    hot_queue: bool | None = None
    """The predicted-queue flag alone (None: the rule in force does not keep it)."""
    new: bool = False
    """Inside its cold-start window."""
    rank: int | None = None
    """Data-parallel rank to pin on the worker, or None."""
    engine: str = engines.DEFAULT_ENGINE
    suspect: bool = False
    """Not in good standing: its latest health probe failed, or it was never probed yet (ingest's view)."""
    backlog_ms: float = 0.0
    """Prefill work this replica sent it that is predicted not to be done yet (extproc/backlog.py)."""
    foreign_ms: float = 0.0
    """Prefill work other replicas and clients sent it, estimated: the engine's active requests beyond this
    replica's in flight there, each with the prefill this replica's own in-flight requests have left on average
    (candidates.py)."""
    calibration: float = 1.0
    """Its observed over predicted TTFT (cortex observe learns it; 1.0 until it has)."""
    kv_usage: float | None = None
    """Share of its KV pool held by running requests (engine-reported; None: unknown)."""
    kv_capacity_tokens: float | None = None
    """Its KV pool in tokens (engine-reported; None: unknown)."""
    evicted_tokens_per_s: float | None = None
    """How fast its engine has been evicting lately (ingest's average of its BlockRemoved; None: unknown)."""
    last_sent: Touch | None = None
    """When this replica last sent it the last block of its matched prefix, and how many tokens its engine has
    evicted since as far as the published count says (None: not known, or no match): the claim rule's bound on
    how far that prefix has moved towards the front of the engine's LRU."""
    uncounted_s: float = 0.0
    """Seconds since the eviction count was read: evictions in them are not counted yet."""
    regret_share: float = 0.0
    """Of the tokens its engine evicts lately, the share that had to be computed again soon after (0: it evicts
    nothing, or nothing it evicts comes back): the price per token of evicting there (ttft.py)."""
    tier_blocks: int = 0
    """Blocks right after its GPU hit that a lower tier (CPU, storage) holds: loaded, not computed."""
    tier_claimed: int = 0
    """Of those, the ones in `matched_blocks` (the engine counts them in `cached_tokens`)."""
    tier_credit: float = 0.0
    """`tier_blocks` weighted by tier (scheduler.tier_weights): what they are worth next to GPU blocks."""
    tier_media: tuple[tuple[str, int], ...] = ()
    """`tier_blocks` by the tier each is loaded from (route explain)."""

    @property
    def affinity_blocks(self) -> float:
        """Blocks whose prefill this worker saves, for scoring: GPU blocks whole, lower-tier ones at their weight,
        or what it is about to hold (predictions) if more."""
        if not self.tier_blocks:
            return max(self.matched_blocks, self.predicted_blocks)
        return max(self.matched_blocks - self.tier_claimed + self.tier_credit, self.predicted_blocks)

    @property
    def load(self) -> float | None:
        return None if self.engine_load is None else max(self.engine_load, float(self.inflight))

    def score(self, s: SchedulerConfig, block_size: int) -> float:
        """Milliseconds of time to first token saved (cache) minus lost (load, queue): cache_aware.py's formula."""
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
    """Prompt tokens proven cached on order[0] (never a prediction); 0 unless mode is EXACT."""
    matched_tokens: dict[str, int] = field(default_factory=dict)
    estimates: Mapping[str, Any] = field(default_factory=dict)
    """Per candidate id, what the time model predicted (ttft.Estimate; empty for the other policies)."""

    @property
    def chosen(self) -> Candidate:
        return self.order[0]


@dataclass(frozen=True, slots=True)
class Facts:
    """What one decision knows besides the candidates."""

    block_size: int
    ledger_usable: bool
    """The ledger answered for this prompt (matches are known); False: no cache affinity can be used."""
    why_not_exact: str
    """The reason code when no proven hit decides."""
    scoring: SchedulerConfig = DEFAULT_SCORING
    home: int | None = None
    """The prompt's first block key: its rendezvous home among equally loaded workers (None: no home)."""
    session: int | None = None
    """The session key's hash (session.key_hash): the request stays on the session's worker (session.py)."""
    prompt_tokens: int = 0
    """The prompt's length in tokens (an estimate when routing stopped early), for the time model."""
    typical_prefill_ms: float | None = None
    """The typical prefill of a request here, learned from the requests routed (None: scoring.queued_request_ms)."""


class Policy(Protocol):
    """One routing policy. `decide` never sees headers or I/O, and draws randomness only from `rng`."""

    name: str

    def decide(self, cands: Sequence[Candidate], facts: Facts, rng: random.Random) -> Decision: ...


def queue_ms(c: Candidate, typical_ms: float) -> float:
    """The prefill work ahead of a new request on `c`: this replica's own plus the estimate of everyone else's,
    or what the engine's waiting count implies at the typical prefill, whichever is larger."""
    return work_ahead_ms(c.backlog_ms, c.foreign_ms, c.engine_waiting, typical_ms)


def work_ahead_ms(backlog_ms: float, foreign_ms: float, engine_waiting: float, typical_ms: float) -> float:
    """`queue_ms` from its parts, before the candidate is built."""
    return max(backlog_ms + foreign_ms, engine_waiting * typical_ms)


def still_hot(was_hot: bool, active: float, s: SchedulerConfig) -> bool:
    """Hysteresis: hot from the high watermark on, until the low watermark is reached again."""
    return active > s.low_watermark if was_hot else active >= s.high_watermark


def active_of(c: Candidate) -> float:
    return c.load if c.load is not None else float(c.inflight)


def by_load(cands: Sequence[Candidate], start: int) -> list[Candidate]:
    # Rotate before the stable sort so equal loads take turns instead of always hitting the first worker.
    k = start % len(cands)
    rotated = list(cands[k:]) + list(cands[:k])
    return sorted(rotated, key=active_of)


def by_activity(cands: Iterable[Candidate]) -> list[Candidate]:
    """Retry targets behind the competing ones: good standing first, then known load, then least active."""
    return sorted(cands, key=lambda c: (c.suspect, c.load is None, active_of(c)))


def matched_of(cands: Sequence[Candidate], block_size: int) -> dict[str, int]:
    return {c.id: c.matched_blocks * block_size for c in cands if c.ledger_trusted}
