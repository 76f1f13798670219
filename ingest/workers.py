"""Worker lifecycle as ingest sees it: identity, view slot, event-stream state, health and load.

Load is read from each engine's own endpoint: vLLM `/metrics` (`vllm:num_requests_running` /
`vllm:num_requests_waiting`) and SGLang `/v1/loads` (`num_running_reqs` / `num_waiting_reqs`). Health uses
tolerant defaults (a busy GPU answers late): a worker is marked down only after N consecutive failures.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import aiohttp

from cortex.config import WorkerConfig
from ingest.ledger import WorkerLedger


class SyncState(Enum):
    CONNECTING = "CONNECTING"  # subscription not up yet: nothing known, nothing claimed
    READY = "READY"            # ledger is a subset of what the GPU holds: usable for exact-KV routing
    STALE = "STALE"            # the stream broke; not used for routing until resynced
    NO_EVENTS = "NO_EVENTS"    # worker has no KV-event endpoint: routed by load only
    UNSUPPORTED = "UNSUPPORTED"  # its events cannot be mapped onto Cortex keys (e.g. block size)


@dataclass
class Load:
    running: float = 0.0
    waiting: float = 0.0
    at: float = 0.0  # monotonic time of the reading; 0 = never read

    def to_json(self, now: float) -> dict[str, Any]:
        return {"running": self.running, "waiting": self.waiting,
                "age_s": round(now - self.at, 3) if self.at else None}


@dataclass
class Worker:
    cfg: WorkerConfig
    slot: int
    address: str
    ledger: WorkerLedger
    state: SyncState = SyncState.CONNECTING
    reason: str = "subscribing"
    healthy: bool = True
    health_failures: int = 0
    last_seq: int | None = None
    last_event_at: float = 0.0
    gaps: int = 0
    restarts: int = 0
    duplicates: int = 0
    batches: int = 0
    decode_errors: int = 0
    load: Load = field(default_factory=Load)

    @property
    def id(self) -> str:
        return self.cfg.id

    def routable_meta(self, now: float) -> dict[str, Any]:
        """The slice extproc needs on the hot path (kept small: it is parsed on every change)."""
        return {
            "id": self.id, "slot": self.slot, "model": self.cfg.model, "engine": self.cfg.engine,
            "address": self.address, "state": self.state.value, "reason": self.reason,
            "healthy": self.healthy, "load": self.load.to_json(now),
        }

    def status(self, now: float) -> dict[str, Any]:
        """What GET /cortex/workers shows."""
        return {
            **self.routable_meta(now),
            "url": self.cfg.url,
            "kv_events": self.cfg.kv_events,
            "last_seq": self.last_seq,
            "last_event_age_s": round(now - self.last_event_at, 3) if self.last_event_at else None,
            "batches": self.batches,
            "gaps": self.gaps,
            "restarts": self.restarts,
            "duplicates": self.duplicates,
            "decode_errors": self.decode_errors,
            "cached_blocks": self.ledger.blocks,
            "blocks_stored": self.ledger.blocks_stored,
            "blocks_removed": self.ledger.blocks_removed,
            "dropped_events": dict(self.ledger.dropped),
            "health_failures": self.health_failures,
        }


_VLLM_GAUGE = re.compile(rb"^vllm:(num_requests_running|num_requests_waiting)(?:\{[^}]*\})?\s+(\S+)", re.M)


def parse_vllm_metrics(text: bytes) -> tuple[float, float]:
    running = waiting = 0.0
    for name, value in _VLLM_GAUGE.findall(text):
        if name == b"num_requests_running":
            running += float(value)
        else:
            waiting += float(value)
    return running, waiting


def parse_sglang_loads(doc: Any) -> tuple[float, float]:
    loads = doc.get("loads", []) if isinstance(doc, dict) else []
    running = sum(float(e.get("num_running_reqs", 0)) for e in loads if isinstance(e, dict))
    waiting = sum(float(e.get("num_waiting_reqs", 0)) for e in loads if isinstance(e, dict))
    return running, waiting


async def read_load(session: aiohttp.ClientSession, worker: Worker, timeout: float) -> None:
    t = aiohttp.ClientTimeout(total=timeout)
    if worker.cfg.engine == "sglang":
        async with session.get(f"{worker.cfg.url}/v1/loads", timeout=t) as resp:
            resp.raise_for_status()
            running, waiting = parse_sglang_loads(await resp.json(content_type=None))
    else:
        async with session.get(f"{worker.cfg.url}/metrics", timeout=t) as resp:
            resp.raise_for_status()
            running, waiting = parse_vllm_metrics(await resp.read())
    worker.load = Load(running=running, waiting=waiting, at=time.monotonic())


async def probe_health(session: aiohttp.ClientSession, worker: Worker, timeout: float, failures: int) -> None:
    try:
        async with session.get(f"{worker.cfg.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            ok = r.status == 200
    except (TimeoutError, aiohttp.ClientError, OSError):
        ok = False
    if ok:
        worker.health_failures = 0
        worker.healthy = True
    else:
        worker.health_failures += 1
        if worker.health_failures >= failures:
            worker.healthy = False
