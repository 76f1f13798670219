"""Workers and routing targets as ingest sees them: identity, view slot, stream state, health and load.

A worker is one OpenAI endpoint; a target is one KV cache behind it (the worker itself, or one of its
data-parallel ranks, each with its own event stream and cache). Targets are what the ledger tracks and
what extproc routes to (cortex.contract.TargetMeta is what it publishes). The probes (ingest/probes.py)
return readings; `Worker.apply_health`, `apply_load` and `apply_tokens` are the one place they land. Health
uses tolerant defaults (a busy GPU answers late): a worker is marked down only after N consecutive failed
probes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from cortex import engines
from cortex.config import IngestConfig, WorkerConfig
from cortex.contract import LoadReading, TargetMeta, load_max_age_s, target_id
from cortex.engines import RankLoad
from ingest import silence
from ingest.probes import HealthReading, LoadByRank
from ingest.regret import Regret
from ingest.shards import RemoteSource
from ingest.source import EventSource, rank_endpoint
from ingest.sync import SyncState
from ingest.tokenizer_parity import FAILED as TOKENS_FAILED
from ingest.tokenizer_parity import OK as TOKENS_OK
from ingest.tokenizer_parity import TokenParity


@dataclass
class Load:
    running: float = 0.0
    waiting: float = 0.0
    at: float = 0.0  # monotonic time of the reading; 0 = never read

    def to_json(self, now: float) -> dict[str, Any]:
        return {"running": self.running, "waiting": self.waiting,
                "age_s": round(now - self.at, 3) if self.at else None}

    def to_meta(self, every_s: float, kv_usage: float | None = None, kv_capacity_tokens: float | None = None,
                evicted_tokens: float | None = None, evicted_tokens_per_s: float | None = None,
                regretted_tokens_per_s: float | None = None, inflight: float | None = None) -> LoadReading:
        """For extproc: the reading's own time (the host's monotonic clock, which ingest and extproc share like
        the view's heartbeat) and the poll interval in force, so extproc ages it itself and ingest need not
        republish an unchanged reading just to move its age (docs/performance.md, "What an idle replica
        costs")."""
        return LoadReading(running=self.running, waiting=self.waiting, at=self.at or None, every_s=every_s,
                           kv_usage=kv_usage, kv_capacity_tokens=kv_capacity_tokens,
                           evicted_tokens=evicted_tokens, evicted_tokens_per_s=evicted_tokens_per_s,
                           regretted_tokens_per_s=regretted_tokens_per_s, inflight=inflight)


EVICTION_RISE_S = 1.0
EVICTION_FALL_S = 10.0
"""Time constants of the eviction rate's average: it follows a rise within about a second and lets go over
about ten. The claim rule reads a high rate as caution, so the estimate errs high: admissions evict in bursts,
and a pool that just started churning must not look calm while its average catches up."""


def eviction_rate(rate: float, evicted_tokens: float, dt: float) -> float:
    """The average of tokens evicted per second, after `evicted_tokens` more over `dt` seconds."""
    if dt <= 0:
        return rate
    now = evicted_tokens / dt
    tau = EVICTION_RISE_S if now > rate else EVICTION_FALL_S
    return rate + (1.0 - math.exp(-dt / tau)) * (now - rate)


def _computed(readings: Iterable[RankLoad]) -> tuple[float, float] | None:
    """(uncached tokens, finished requests) summed over the ranks read; None when any rank does not report them."""
    uncached = finished = 0.0
    for r in readings:
        if r.uncached is None or r.finished is None:
            return None
        uncached, finished = uncached + r.uncached, finished + r.finished
    return uncached, finished


def load_poll_interval(active: bool, routed: bool, icfg: IngestConfig, active_workers: int = 1,
                       idle_workers: int = 1) -> float:
    """How often a worker's load is read. Idle: `idle_load_poll_interval_s`. Active and sent requests by this
    replica: `routed_load_poll_interval_s`, since extproc adds this replica's own in-flight change to the reading
    between two (cortex.contract LoadReading.inflight), so only the other replicas' and clients' share waits for
    the next one. Active by others' traffic only: `load_poll_interval_s`. Each cadence stretches so that the
    workers read at it (`active_workers`, or `idle_workers`) stay within `load_reads_per_s`, a budget for each: a
    large fleet's reads cost what a mid-sized one's do, each reading older in proportion. An idle worker's reading
    may be older at no cost: a sign of work (its KV events, a request routed to it) reads it at once."""
    if not active:
        every, workers = icfg.idle_load_poll_interval_s, idle_workers
    else:
        every = icfg.routed_load_poll_interval_s if routed else icfg.load_poll_interval_s
        workers = active_workers
    if icfg.load_reads_per_s is not None:
        every = max(every, workers / icfg.load_reads_per_s)
    return every


@dataclass
class Target:
    """One routing target as ingest keeps it: its event stream (`events`, which owns the sync state, the ledger
    and its hash parity check) and what the probes and the silence check read about it."""

    worker: Worker
    rank: int | None
    """Data-parallel rank, or None for a worker without DP."""
    slot: int
    events: EventSource | RemoteSource
    """Its stream, followed here or in an event shard (ingest/shards.py): the same attributes either way."""
    load: Load = field(default_factory=Load)
    busy_since: float = 0.0
    activity: float = 0.0
    """The engine's own cumulative work counter, from the load poll."""
    computed: tuple[float, float] | None = None
    """(uncached prompt tokens, finished requests), the engine's cumulative counts from the load poll (None: not
    reported): what proves a stored block (ingest/silence.py)."""
    kv_usage: float | None = None
    """Share of its KV-cache pool in use (0..1) at the last load reading; None: not reported."""
    kv_capacity_tokens: float | None = None
    """Its KV-cache pool in tokens, as the engine reports it; None: not reported."""
    evicted_tokens: float = 0.0
    """Tokens the engine has evicted since its ledger started (its BlockRemoved, as the ledger applied them), at
    the last load reading: extproc counts how many were evicted since it last sent a prefix there, against the
    pool's free part (extproc/policies/claims.py)."""
    evicted_tokens_per_s: float = 0.0
    """How fast it has been evicting lately (`eviction_rate`), for the evictions not counted yet."""
    regret: Regret | None = None
    """Ingest's count of the evicted tokens an engine had to compute again (ingest/regret.py); None in tests."""
    regretted_tokens_per_s: float = 0.0
    """How fast the tokens it evicts have been coming back (stored again soon after), averaged like the evictions:
    over the eviction rate, the share of what it evicts that is missed."""
    regretted_seen: float = 0.0
    """The regret count at the last load reading."""
    inflight_at_read: float | None = None
    """This replica's requests in flight there when the last reading was taken (None: not known)."""
    evictions_seen: tuple[int, float] = (0, 0.0)
    """(the ledger's removed-block count, when) at the last load reading."""
    activity_checked: float = 0.0
    """Its value when the last tail check was asked for: a change means batches may exist we never saw."""
    was_busy: bool = False
    events_status: str = silence.WAITING
    """ingest.silence: flowing, waiting, silent (or off when no kv_events endpoint is configured)."""
    silence_reason: str = ""
    work_at: float = 0.0
    """When the engine was first seen working since the newest batch (0: not seen)."""
    activity_base: float | None = None
    computed_base: tuple[float, float] | None = None
    batch_at: float = 0.0
    """When ingest.silence last saw a batch arrive (live or replayed); 0: never."""
    received_base: int = 0
    published_load: tuple[float, float, float, float | None, float] = (0.0, 0.0, 0.0, None, 0.0)
    """(running, waiting, evicted tokens, this replica's in flight, reading time) of the load last written to the
    view."""

    @property
    def id(self) -> str:
        return target_id(self.worker.id, self.rank)

    def endpoint(self, base: str | None) -> str | None:
        return rank_endpoint(base, self.rank)

    @property
    def exact_kv(self) -> bool:
        return (self.events.sync.state is SyncState.READY and not self.events.parity.failed
                and self.worker.events_usable and self.worker.tokens_trusted and self.events_status != silence.SILENT
                and not self.events.ledger.unsupported)

    def why_code(self) -> str:
        """A short, stable reason code for headers and metrics ('' while exact-KV routing is allowed)."""
        if not self.worker.events_usable:
            return "no_kv_events"
        if self.events.parity.failed:
            return "hash_parity_failed"
        if self.events.ledger.unsupported:
            return "kv_layout_unsupported"
        if not self.worker.tokens_trusted:
            return "tokenizer_mismatch" if self.worker.token_parity.status == TOKENS_FAILED else "tokenizer_unverified"
        if self.events_status == silence.SILENT:
            return "events_silent"
        if self.events.sync.state is SyncState.READY:
            return ""
        return f"ledger_{self.events.sync.state.value.lower()}"

    def why_not_exact(self) -> str:
        if not self.worker.events_usable:
            return self.worker.events_reason
        if self.events.parity.failed:
            return f"hash parity failed: {self.events.parity.reason}"
        if self.events.ledger.unsupported:
            return f"KV-cache layout: {self.events.ledger.unsupported}"
        if not self.worker.tokens_trusted:
            return f"tokenizer parity {self.worker.token_parity.status}: {self.worker.token_parity.reason}"
        if self.events_status == silence.SILENT:
            return f"publishes no KV events: {self.silence_reason}"
        if self.events.diagnosis is not None:
            return self.events.diagnosis[1]
        return self.events.sync.reason

    # -- what the service learns from the load poll; these methods are the only writers of the fields above --

    def note_evictions(self, now: float) -> None:
        page = self.events.parity.page_size
        removed = self.events.ledger.blocks_removed
        seen, seen_at = self.evictions_seen
        self.evictions_seen = (removed, now)
        self.evicted_tokens = float(removed * page)
        regretted = self.regret.regretted(self.slot) if self.regret is not None else 0.0
        if seen_at and removed >= seen:  # fewer: a new ledger (a restart) counts from zero again
            self.evicted_tokens_per_s = eviction_rate(self.evicted_tokens_per_s, (removed - seen) * page,
                                                      now - seen_at)
            self.regretted_tokens_per_s = eviction_rate(self.regretted_tokens_per_s,
                                                        max(0.0, regretted - self.regretted_seen), now - seen_at)
        self.regretted_seen = regretted

    def load_news(self, now: float, every_s: float) -> bool:
        """Publish a reading whose values changed, or whose published predecessor is getting old (extproc
        ages readings itself, against max(2 s, 2 x the interval in force): republishing an unchanged one
        every max(1 s, interval) keeps it fresh there with margin, at a fraction of the polls). Evictions are news:
        the claim rule counts them since a prefix was last sent (they change only while the worker works)."""
        running, waiting, evicted, inflight, at = self.published_load
        # This replica's share at the reading is news too: extproc takes the other replicas' share as the reading
        # less it (cluster_view.derived_load).
        return self.load.at > at and ((self.load.running, self.load.waiting, self.evicted_tokens, self.inflight_at_read)
                                      != (running, waiting, evicted, inflight) or now - at >= max(1.0, every_s))

    def mark_published(self) -> None:
        self.published_load = (self.load.running, self.load.waiting, self.evicted_tokens, self.inflight_at_read,
                               self.load.at)
        # The target list was just built and written, in this same call chain: it describes the ledger's layout now.
        self.events.layout_published(self.events.ledger.layout_version)

    def tail_check_due(self) -> bool:
        """The engine worked since the last poll (its counter moved, or requests ran or just finished): its
        batches may all have been lost, so no arrival would ever trigger a tail check."""
        busy = self.load.running > 0 or self.load.waiting > 0
        due = self.activity != self.activity_checked or busy or self.was_busy
        if due:
            self.activity_checked = self.activity
        self.was_busy = busy
        return due

    def quiet_while_busy(self, now: float, limit_s: float) -> bool:
        """Busy by a current reading, and no batch for `limit_s` since it became busy or since the last batch: its
        events may be getting lost. A reading too old to route by (contract.load_max_age_s: the worker stopped
        answering its load reads, as an engine whose event loop tokenizes a 10 MB body does) is no evidence of
        work, and neither is the busy state it left."""
        if not self.busy_since or not self.load.at or now - self.load.at > load_max_age_s(self.worker.poll_every):
            return False
        return now - max(self.busy_since, self.events.last_event_at) > limit_s

    def observe_publisher(self, now: float, bound_s: float) -> str:
        """After a load reading: does this target serve requests but publish no KV events (ingest.silence)?
        Updates events_status and silence_reason; returns the status it replaced."""
        # Counted, not timed: the silence resync moves the stream's last_event_at without any batch arriving.
        received = self.events.received
        if received != self.received_base:
            # A batch (live or replayed) arrived: whatever work came before is accounted for.
            self.received_base, self.batch_at = received, now
            self.work_at = 0.0
            self.activity_base, self.computed_base = (self.activity, self.computed) if self.load.at else (None, None)
        elif self.load.at:
            if self.activity_base is None or self.activity < self.activity_base:
                # first reading, or a restarted engine's counters
                self.activity_base, self.computed_base = self.activity, self.computed
            if not self.work_at and self._stored_blocks():
                self.work_at = now
        status, reason = silence.verdict(silence.Observation(
            now=now, healthy=self.worker.healthy, connected=self.events.link_up, link_since=self.events.link_since,
            last_batch_at=self.batch_at, work_at=self.work_at, bound_s=bound_s))
        before = self.events_status
        self.events_status, self.silence_reason = status, reason
        return before

    def _stored_blocks(self) -> bool:
        """The engine did work since the base that must have stored a KV block: proved from its counts where it
        reports them (silence.stored_a_block), else any work at all (its activity counter moved, or requests ran)."""
        now, base = self.computed, self.computed_base
        if now is None or base is None or now[0] < base[0] or now[1] < base[1]:
            assert self.activity_base is not None
            return self.activity > self.activity_base or self.load.running > 0
        return silence.stored_a_block(now[0] - base[0], now[1] - base[1], self.load.running + self.load.waiting,
                                      self.events.parity.page_size)

    def routable_meta(self) -> TargetMeta:
        """The slice extproc reads on the hot path (cortex.contract; kept small: it is re-parsed on every
        change)."""
        w = self.worker
        ledger = self.events.ledger
        groups, tiers = ledger.layout()
        return TargetMeta(
            id=self.id, worker=w.id, rank=self.rank, slot=self.slot, model=w.cfg.model,
            engine=w.cfg.engine, address=w.address, healthy=w.healthy, suspect=w.suspect,
            exact_kv=self.exact_kv,
            state=self.events.sync.state.value, reason=self.why_not_exact(), why=self.why_code(),
            load=self.load.to_meta(w.poll_every, self.kv_usage, self.kv_capacity_tokens, self.evicted_tokens,
                                   round(self.evicted_tokens_per_s, 1), round(self.regretted_tokens_per_s, 1),
                                   self.inflight_at_read),
            added_at=w.added_at, role=w.cfg.role, bootstrap_port=w.bootstrap_port, tls_name=w.tls_name,
            groups=groups, tiers=tiers, lookahead_blocks=-(-ledger.lookahead // ledger.block_size),
        )

    def status(self, now: float) -> dict[str, Any]:
        ev = self.events
        s, parity, ledger = ev.sync, ev.parity, ev.ledger
        meta = msgspec.to_builtins(self.routable_meta())
        del meta["age_s"]  # the contract's legacy field; the age in seconds follows
        return {
            **meta,
            "load": {**self.load.to_json(now), "every_s": self.worker.poll_every, "kv_usage": self.kv_usage,
                     "kv_capacity_tokens": self.kv_capacity_tokens,
                     "evicted_tokens": self.evicted_tokens,
                     "evicted_tokens_per_s": round(self.evicted_tokens_per_s, 1),
                     "regretted_tokens_per_s": round(self.regretted_tokens_per_s, 1),
                     "inflight": self.inflight_at_read, "read_by": self.worker.read_by or "self"},
            "age_s": round(now - self.worker.added_at, 1),
            "kv_events": self.endpoint(self.worker.cfg.kv_events),
            "kv_replay": self.endpoint(self.worker.cfg.kv_replay),
            "events": self.events_status if self.worker.events_usable else silence.OFF,
            "events_reason": self.silence_reason,
            "events_connected": ev.link_up,
            "events_diagnosis": ev.diagnosis[0] if ev.diagnosis is not None else None,
            "last_seq": s.last_applied,
            "view": "shown" if ev.shown else "hidden",
            "last_event_age_s": round(now - ev.last_event_at, 3) if ev.last_event_at else None,
            "batches": ev.batches, "gaps": s.gaps, "replays": s.replays, "resyncs": s.resyncs,
            "restarts": s.restarts, "duplicates": s.duplicates, "decode_errors": ev.decode_errors,
            "tail_checks": ev.tail_checks, "tail_connections": ev.tail_connections,
            "tail_recoveries": s.tail_recoveries,
            "parity": {"status": parity.status, "reason": parity.reason, "checked": parity.checked},
            "cached_blocks": ledger.blocks, "blocks_stored": ledger.blocks_stored,
            "blocks_removed": ledger.blocks_removed, "blocks_restated": ledger.blocks_restated,
            "dropped_events": dict(ledger.dropped),
            # Per copy set (tier / KV-cache group [/ locality / ownership]): blocks held.
            "kv_lanes": ledger.lanes(),
            "kv_layout_unsupported": ledger.unsupported or None,
            "unknown_events": dict(ev.unknown_events), "unknown_media": dict(ledger.unknown_media),
            "inactive_events": ledger.events_inactive,
            "event_shard": ev.shard.index if isinstance(ev, RemoteSource) and ev.shard is not None else None,
        }


@dataclass
class Worker:
    cfg: WorkerConfig
    address: str
    targets: list[Target] = field(default_factory=list)
    healthy: bool = True
    """Routable: false after `ingest.health_failures` consecutive failed probes, true again at one success."""
    health_failures: int = 0
    """Consecutive failed probes so far (0 after a success)."""
    probed_ok: bool = False
    """Has passed a health probe since it was added (probes start at once)."""
    events_usable: bool = True
    events_reason: str = ""
    source: str = "config"
    """Where it came from: `config` or `api` (kept across ingest restarts in the runtime directory)."""
    added_at: float = field(default_factory=time.monotonic)
    token_parity: TokenParity = field(default_factory=TokenParity)
    parity_policy: str = "required"
    bootstrap_port: int | None = None
    """SGLang prefill: the bootstrap port a decode must reach (config, else the worker's /server_info)."""
    poll_every: float = 0.0
    """The load poll interval in force (`load_poll_interval`)."""
    active_until: float = 0.0
    """Monotonic time until which its load is polled at the active cadence."""
    idle: bool = True
    """On the idle cadence: its next reading waits for `wake` (or the idle interval)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to cut an idle-cadence wait short (a KV event arrived, or this replica routed to it)."""
    tls_name: str | None = None
    """An https worker: the name its certificate must carry (cortex/upstream_tls.py verify_name); None: http."""
    read_by: str = ""
    """Who took its latest load reading: "" this replica, else the peer whose report carried it."""
    shared_at: float = -math.inf
    """When a peer's reading of it last arrived (monotonic; cortex/peering.py reads_itself)."""
    routed_at: float = -math.inf
    """When requests of this replica or its peers were last seen in flight there (ingest's heartbeat)."""
    reads_here: bool = True
    """This replica reads its load itself (not a peer): counted in `ingest.load_reads_per_s`' budget."""

    def __post_init__(self) -> None:
        self.bootstrap_port = self.cfg.bootstrap_port

    @property
    def suspect(self) -> bool:
        """Not in good standing: never probed yet, or its latest probe failed. Still routable while healthy,
        but a worker in good standing gets the first attempt (extproc/policies/tiers.py)."""
        return not self.probed_ok or self.health_failures > 0

    @property
    def needs_bootstrap_port(self) -> bool:
        return (engines.adapter(self.cfg.engine).pd_prefill_needs_bootstrap_port and self.cfg.role == "prefill"
                and self.bootstrap_port is None)

    @property
    def bootstrap_port_info(self) -> tuple[str, str] | None:
        """Where the health probe reads this worker's bootstrap port, while it needs one and has none."""
        return engines.adapter(self.cfg.engine).bootstrap_port_info if self.needs_bootstrap_port else None

    @property
    def tokens_trusted(self) -> bool:
        if self.parity_policy == "off":
            return True
        if self.parity_policy == "best_effort":
            return self.token_parity.status != TOKENS_FAILED
        return self.token_parity.status == TOKENS_OK

    @property
    def id(self) -> str:
        return self.cfg.id

    # -- readings (ingest/probes.py) land here, and only here ---------------------------------------------

    def apply_health(self, reading: HealthReading, failures: int) -> None:
        """A health probe's result: down after `failures` consecutive failures, up again at one success."""
        if reading.bootstrap_port is not None:
            self.bootstrap_port = reading.bootstrap_port
        if reading.ok:
            self.health_failures = 0
            self.healthy = True
            self.probed_ok = True
        else:
            self.health_failures += 1
            if self.health_failures >= failures:
                self.healthy = False

    def apply_load(self, per_rank: LoadByRank, now: float, inflight: np.ndarray | None = None) -> None:
        """A load reading, per rank: each target takes its rank's (a worker without DP, the sum). `inflight`: this
        replica's requests in flight per slot at the reading (None: not known)."""
        for target in self.targets:
            if target.rank is None:
                readings = per_rank.values()
                running = sum(v.running for v in readings)
                waiting = sum(v.waiting for v in readings)
                activity = sum(v.activity for v in readings)
                computed = _computed(readings)
                # The ranks' pools are alike: the worker's usage is their mean.
                usages = [v.kv_usage for v in per_rank.values() if v.kv_usage is not None]
                kv_usage = sum(usages) / len(usages) if usages else None
                pools = [v.kv_capacity_tokens for v in per_rank.values() if v.kv_capacity_tokens is not None]
                capacity = sum(pools) if pools else None
            else:
                rank_load = per_rank.get(target.rank, RankLoad(0.0, 0.0, 0.0))
                running, waiting, activity, kv_usage, capacity = rank_load[:5]
                computed = _computed([rank_load])
            target.load = Load(running=running, waiting=waiting, at=now)
            target.inflight_at_read = (float(inflight[target.slot])
                                       if inflight is not None and 0 <= target.slot < inflight.size else None)
            target.activity = activity
            target.computed = computed
            target.kv_usage = kv_usage
            target.kv_capacity_tokens = capacity
            target.note_evictions(now)
            if running > 0 and not target.busy_since:
                target.busy_since = now
            elif running == 0:
                target.busy_since = 0.0

    def apply_tokens(self, status: str, reason: str, now: float) -> str:
        """A tokenizer parity check's result; returns the status it replaced."""
        tp = self.token_parity
        before = tp.status
        tp.checks += 1
        tp.checked_at = now
        if status == TOKENS_FAILED and before != TOKENS_FAILED:
            tp.failures += 1
        tp.status, tp.reason = status, reason
        return before
