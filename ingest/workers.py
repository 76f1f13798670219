"""Workers and routing targets as ingest sees them: identity, view slot, stream state, health and load.

A worker is one OpenAI endpoint; a target is one KV cache behind it (the worker itself, or one of its
data-parallel ranks, each with its own event stream and cache). Targets are what the ledger tracks and
what extproc routes to. Load is read from each engine's own endpoint: vLLM `/metrics`
(`vllm:num_requests_running` / `_waiting`, per `engine` label = DP rank) and SGLang `/v1/loads`
(`num_running_reqs` / `num_waiting_reqs` per `dp_rank`). Health uses tolerant defaults (a busy GPU
answers late): a worker is marked down only after N consecutive failed probes.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from cortex.config import WorkerConfig
from cortex.contract import LoadReading, TargetMeta
from ingest import silence
from ingest.hash_parity import ParityCheck
from ingest.ledger import Ledger
from ingest.sync import SourceSync, SyncState
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

    def to_meta(self, every_s: float) -> LoadReading:
        """For extproc: the reading's own time (the host's monotonic clock, which ingest and extproc share like
        the view's heartbeat) and the poll interval in force, so extproc ages it itself and ingest need not
        republish an unchanged reading just to move its age (docs/performance.md, "What an idle replica
        costs")."""
        return LoadReading(running=self.running, waiting=self.waiting, at=self.at or None, every_s=every_s)


@dataclass
class Target:
    worker: Worker
    rank: int | None
    """Data-parallel rank, or None for a worker without DP."""
    slot: int
    ledger: Ledger
    parity: ParityCheck
    sync: SourceSync
    epoch: int
    load: Load = field(default_factory=Load)
    last_event_at: float = 0.0
    busy_since: float = 0.0
    batches: int = 0
    decode_errors: int = 0
    tail_checks: int = 0
    activity: float = 0.0
    """The engine's own cumulative work counter, from the load poll."""
    activity_checked: float = 0.0
    """Its value when the last tail check was asked for: a change means batches may exist we never saw."""
    was_busy: bool = False
    lag_s: float = 0.0
    """Age of the newest applied batch when it was applied (engine timestamp to ingest clock)."""
    link_up: bool = False
    """The KV-event SUB socket is connected to the publisher (ZMQ's socket monitor)."""
    link_since: float = field(default_factory=time.monotonic)
    """When the connection last came up or went down (or the target was created)."""
    events_status: str = silence.WAITING
    """ingest.silence: flowing, waiting, silent (or off when no kv_events endpoint is configured)."""
    silence_reason: str = ""
    work_at: float = 0.0
    """When the engine was first seen working since the newest batch (0: not seen)."""
    activity_base: float | None = None
    batch_at: float = 0.0
    """When ingest.silence last saw a batch arrive (live or replayed); 0: never."""
    received_base: int = 0
    published_load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """(running, waiting, reading time) of the load last written to the view."""

    @property
    def id(self) -> str:
        return self.worker.id if self.rank is None else f"{self.worker.id}@{self.rank}"

    def endpoint(self, base: str | None) -> str | None:
        """This rank's ZMQ endpoint: the engines offset the port by the rank (kv-events.md §1.4)."""
        if base is None or self.rank in (None, 0):
            return base
        host, port = base.rsplit(":", 1)
        return f"{host}:{int(port) + self.rank}"

    @property
    def exact_kv(self) -> bool:
        return (self.sync.state is SyncState.READY and not self.parity.failed and self.worker.events_usable
                and self.worker.tokens_trusted and self.events_status != silence.SILENT)

    def why_code(self) -> str:
        """A short, stable reason code for headers and metrics ('' while exact-KV routing is allowed)."""
        if not self.worker.events_usable:
            return "no_kv_events"
        if self.parity.failed:
            return "hash_parity_failed"
        if not self.worker.tokens_trusted:
            return "tokenizer_mismatch" if self.worker.token_parity.status == TOKENS_FAILED else "tokenizer_unverified"
        if self.events_status == silence.SILENT:
            return "events_silent"
        if self.sync.state is SyncState.READY:
            return ""
        return f"ledger_{self.sync.state.value.lower()}"

    def why_not_exact(self) -> str:
        if not self.worker.events_usable:
            return self.worker.events_reason
        if self.parity.failed:
            return f"hash parity failed: {self.parity.reason}"
        if not self.worker.tokens_trusted:
            return f"tokenizer parity {self.worker.token_parity.status}: {self.worker.token_parity.reason}"
        if self.events_status == silence.SILENT:
            return f"publishes no KV events: {self.silence_reason}"
        return self.sync.reason

    def routable_meta(self) -> TargetMeta:
        """The slice extproc reads on the hot path (cortex.contract; kept small: it is re-parsed on every
        change)."""
        w = self.worker
        return TargetMeta(
            id=self.id, worker=w.id, rank=self.rank, slot=self.slot, model=w.cfg.model,
            engine=w.cfg.engine, address=w.address, healthy=w.healthy, suspect=w.suspect,
            exact_kv=self.exact_kv,
            state=self.sync.state.value, reason=self.why_not_exact(), why=self.why_code(),
            load=self.load.to_meta(w.poll_every),
            added_at=w.added_at, role=w.cfg.role, bootstrap_port=w.bootstrap_port,
        )

    def status(self, now: float) -> dict[str, Any]:
        s = self.sync
        meta = msgspec.structs.asdict(self.routable_meta())
        del meta["age_s"]  # the contract's legacy field; the age in seconds follows
        return {
            **meta,
            "load": {**self.load.to_json(now), "every_s": self.worker.poll_every},
            "age_s": round(now - self.worker.added_at, 1),
            "kv_events": self.endpoint(self.worker.cfg.kv_events),
            "kv_replay": self.endpoint(self.worker.cfg.kv_replay),
            "events": self.events_status if self.worker.events_usable else silence.OFF,
            "events_reason": self.silence_reason,
            "events_connected": self.link_up,
            "last_seq": s.last_applied,
            "last_event_age_s": round(now - self.last_event_at, 3) if self.last_event_at else None,
            "batches": self.batches, "gaps": s.gaps, "replays": s.replays, "resyncs": s.resyncs,
            "restarts": s.restarts, "duplicates": s.duplicates, "decode_errors": self.decode_errors,
            "tail_checks": self.tail_checks, "tail_recoveries": s.tail_recoveries,
            "parity": {"status": self.parity.status, "reason": self.parity.reason, "checked": self.parity.checked},
            "cached_blocks": self.ledger.blocks, "blocks_stored": self.ledger.blocks_stored,
            "blocks_removed": self.ledger.blocks_removed, "dropped_events": dict(self.ledger.dropped),
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
    added_at: float = field(default_factory=time.monotonic)
    token_parity: TokenParity = field(default_factory=TokenParity)
    parity_policy: str = "required"
    bootstrap_port: int | None = None
    """SGLang prefill: the bootstrap port a decode must reach (config, else the worker's /server_info)."""
    poll_every: float = 0.0
    """The load poll interval in force (ingest.load_poll_interval_s while active, else the idle one)."""
    active_until: float = 0.0
    """Monotonic time until which its load is polled at the active cadence."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to cut an idle-cadence wait short (a KV event arrived, or this replica routed to it)."""

    def __post_init__(self) -> None:
        self.bootstrap_port = self.cfg.bootstrap_port

    @property
    def suspect(self) -> bool:
        """Not in good standing: never probed yet, or its latest probe failed. Still routable while healthy,
        but a worker in good standing gets the first attempt (extproc/scheduler.py)."""
        return not self.probed_ok or self.health_failures > 0

    @property
    def needs_bootstrap_port(self) -> bool:
        return self.cfg.engine == "sglang" and self.cfg.role == "prefill" and self.bootstrap_port is None

    @property
    def tokens_trusted(self) -> bool:
        if self.parity_policy == "off":
            return True
        if self.parity_policy == "best_effort":
            return self.token_parity.status != TOKENS_FAILED
        return self.token_parity.status == TOKENS_OK
    """Where it came from: `config` or `api` (kept across ingest restarts in the runtime directory)."""

    @property
    def id(self) -> str:
        return self.cfg.id


_VLLM_SERIES = re.compile(
    rb'^vllm:(num_requests_running|num_requests_waiting|prefix_cache_queries_total)(?:\{([^}]*)\})?\s+(\S+)', re.M)
_ENGINE_LABEL = re.compile(rb'engine="(\d+)"')
_VLLM_INDEX = {b"num_requests_running": 0, b"num_requests_waiting": 1, b"prefix_cache_queries_total": 2}


def parse_vllm_metrics(text: bytes) -> dict[int, tuple[float, float, float]]:
    """(running, waiting, activity) per DP rank (vLLM's `engine` label; 0 when absent). Activity is a
    cumulative counter (prompt tokens looked up in the prefix cache) that moves whenever a request ran."""
    out: dict[int, list[float]] = {}
    for name, labels, value in _VLLM_SERIES.findall(text):
        m = _ENGINE_LABEL.search(labels or b"")
        rank = int(m.group(1)) if m else 0
        out.setdefault(rank, [0.0, 0.0, 0.0])[_VLLM_INDEX[name]] += float(value)
    return {r: (v[0], v[1], v[2]) for r, v in out.items()}


def parse_sglang_loads(doc: Any) -> dict[int, tuple[float, float, float]]:
    """Same shape from SGLang's /v1/loads; activity is its cumulative prefill-token count."""
    loads = doc.get("loads", []) if isinstance(doc, dict) else []
    out: dict[int, tuple[float, float, float]] = {}
    for e in loads:
        if isinstance(e, dict):
            rank = int(e.get("dp_rank") or 0)
            prev = out.get(rank, (0.0, 0.0, 0.0))
            out[rank] = (prev[0] + float(e.get("num_running_reqs", 0)), prev[1] + float(e.get("num_waiting_reqs", 0)),
                         prev[2] + float(e.get("total_prefill_uncached_tokens", 0)))
    return out


async def read_load(session: aiohttp.ClientSession, worker: Worker, timeout: float) -> None:
    t = aiohttp.ClientTimeout(total=timeout)
    if worker.cfg.engine == "sglang":
        async with session.get(f"{worker.cfg.url}/v1/loads", timeout=t) as resp:
            resp.raise_for_status()
            per_rank = parse_sglang_loads(await resp.json(content_type=None))
    else:
        async with session.get(f"{worker.cfg.url}/metrics", timeout=t) as resp:
            resp.raise_for_status()
            per_rank = parse_vllm_metrics(await resp.read())
    now = time.monotonic()
    for target in worker.targets:
        if target.rank is None:
            running, waiting, activity = (sum(v[i] for v in per_rank.values()) for i in range(3))
        else:
            running, waiting, activity = per_rank.get(target.rank, (0.0, 0.0, 0.0))
        target.load = Load(running=running, waiting=waiting, at=now)
        target.activity = activity
        if running > 0 and not target.busy_since:
            target.busy_since = now
        elif running == 0:
            target.busy_since = 0.0


async def probe_health(session: aiohttp.ClientSession, worker: Worker, timeout: float, failures: int) -> None:
    try:
        async with session.get(f"{worker.cfg.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            ok = r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        ok = False
    if ok and worker.needs_bootstrap_port:
        # Read, not assumed (engines.md §1.3): a decode told the wrong port waits for a KV that never comes.
        try:
            async with session.get(f"{worker.cfg.url}/server_info",
                                   timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                info = await r.json(content_type=None) if r.status == 200 else {}
            port = info.get("disaggregation_bootstrap_port") if isinstance(info, dict) else None
            if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
                worker.bootstrap_port = port
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            pass  # asked again at the next probe; until then the worker is not paired
    if ok:
        worker.health_failures = 0
        worker.healthy = True
        worker.probed_ok = True
    else:
        worker.health_failures += 1
        if worker.health_failures >= failures:
            worker.healthy = False

