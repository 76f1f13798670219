"""extproc's read side of the cluster: the shared ledger view, the worker list, and in-flight counts.

Nothing here blocks or talks to another process per request. A background task (refresh(), a few times
a second) re-maps the view when ingest replaced it, re-reads the worker document when its version moved,
and decides whether ingest is alive. When it is not, extproc keeps routing on the last worker list it had
(or the config's), by its own in-flight counts, and says so in the match mode.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cortex.config import CortexConfig
from cortex.inflight import InflightBoard
from cortex.view import ViewBusy, ViewReader

log = logging.getLogger("cortex.extproc")

LOAD_MAX_AGE_S = 2.0  # an engine load reading older than this is treated as unknown


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    id: str
    slot: int
    model: str
    address: str
    state: str
    healthy: bool
    engine_load: float | None


class ClusterView:
    def __init__(self, cfg: CortexConfig, view_path: Path, index: int) -> None:
        self.cfg = cfg
        self.view_path = view_path
        self.stale_after = cfg.extproc.view_stale_after_s
        self.reader: ViewReader | None = None
        self.inflight = InflightBoard(cfg.runtime_path() / "inflight", index, cfg.extproc.processes,
                                      cfg.ingest.max_workers)
        self.alive = False
        self.block_size = cfg.block_size
        self._meta_version = -1
        self.workers: dict[str, list[WorkerInfo]] = {}
        self.by_address: dict[str, WorkerInfo] = {}
        # Until ingest has spoken, the config's worker list (slots in config order, as ingest assigns them).
        self._set_workers([{"id": w.id, "slot": i, "model": w.model, "address": w.address(),
                            "state": "UNKNOWN", "healthy": True, "load": {}}
                           for i, w in enumerate(cfg.workers)])

    def _set_workers(self, docs: list[dict[str, Any]]) -> None:
        by_model: dict[str, list[WorkerInfo]] = {}
        by_address: dict[str, WorkerInfo] = {}
        for d in docs:
            load = d.get("load") or {}
            age = load.get("age_s")
            engine_load = (float(load.get("running", 0)) + float(load.get("waiting", 0))
                           if age is not None and age <= LOAD_MAX_AGE_S else None)
            info = WorkerInfo(id=d["id"], slot=int(d["slot"]), model=d["model"], address=d["address"],
                              state=d.get("state", "UNKNOWN"), healthy=bool(d.get("healthy", True)),
                              engine_load=engine_load)
            by_model.setdefault(info.model, []).append(info)
            by_address[info.address] = info
        self.workers = by_model
        self.by_address = by_address

    def refresh(self) -> None:
        """Background upkeep; cheap enough to run every 100-250 ms."""
        if self.reader is None:
            self.reader = ViewReader.open(self.view_path)
        elif self.reader.refresh():
            self._meta_version = -1
        self.inflight.refresh()
        if self.reader is None:
            self._mark(False, "no ledger view yet")
            return
        alive = self.reader.heartbeat_age() <= self.stale_after
        self._mark(alive, "ingest heartbeat stopped")
        if not alive:
            return
        version, doc = self.reader.meta()
        if version != self._meta_version and doc.get("workers") is not None:
            self._meta_version = version
            self.block_size = int(doc.get("block_size", self.block_size))
            self._set_workers(doc["workers"])

    def _mark(self, alive: bool, why: str) -> None:
        if alive != self.alive:
            log.warning("ledger view %s", "available" if alive else f"unavailable: {why}")
        self.alive = alive

    def candidates(self, model: str) -> list[WorkerInfo]:
        return [w for w in self.workers.get(model, ()) if w.healthy]

    def match(self, keys: list[int]) -> np.ndarray | None:
        """Leading blocks held per slot, or None when the view cannot be trusted right now."""
        if not self.alive or self.reader is None or not keys:
            return None
        try:
            return self.reader.match(keys)
        except ViewBusy:
            return None
