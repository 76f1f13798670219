"""extproc's read side of the cluster: the shared ledger view, the worker list, and in-flight counts.

Nothing here blocks or talks to another process per request. A background task (refresh(), a few times
a second) re-maps the view when ingest replaced it, re-reads the worker document when its version moved,
and decides whether ingest is alive. When it is not, extproc keeps routing on the last worker list it had
(or the config's), by its own in-flight counts, and says so in the match mode.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prometheus_client import Counter

from cortex.calibration import CALIBRATION_FILE, Calibration
from cortex.config import UNRESOLVED, CortexConfig
from cortex.contract import (
    ContractError,
    GroupSlot,
    LoadReading,
    TargetMeta,
    TierSlot,
    load_max_age_s,
    read_meta,
    target_id,
)
from cortex.inflight import BacklogBoard, InflightBoard, TouchBoard
from cortex.ledger_view import ViewBusy, ViewReader
from cortex.peering import board_rows
from cortex.upstream_tls import verify_name

log = logging.getLogger("cortex.extproc")

VIEW_REFUSED = Counter("cortex_ledger_view_refused", "meta documents of the ledger view this extproc process could "
                       "not read (a schema version it was not written for, or a malformed document)")
# Here rather than in extproc/metrics.py, which imports the router (and so this module).

FILES_EVERY_S = 1.0
"""How often refresh() stats the files it follows (the view's path, the calibration, the peers' board rows)."""


def engine_load_of(load: LoadReading, now: float) -> tuple[float | None, float]:
    """(running + waiting, or None when unknown; the time at which this reading turns unknown, inf if never
    or already). `at` is the reading's monotonic time (ingest's clock is this host's); older documents
    carried `age_s` at publication instead."""
    at = load.at
    if at is None:
        at = None if load.age_s is None else now - load.age_s
    if at is None:
        return None, math.inf
    expires = at + load_max_age_s(load.every_s)
    if now > expires:
        return None, math.inf
    return load.running + load.waiting, expires


def derived_load(reading: float | None, inflight_at_read: float | None, inflight_now: float) -> float | None:
    """A worker's running + waiting now, from its last reading and this replica's own requests in flight there
    then and now: the other replicas' and clients' share as read (the reading less this replica's share then, at
    least 0: a request of ours still on its way to the engine was not in it) plus ours now. So this replica's own
    traffic is seen at once, the others' as of the reading. None: the reading is unknown; a reading that does not
    say this replica's share then (`inflight_at_read` None) is taken as it is."""
    if reading is None or inflight_at_read is None:
        return reading
    return max(reading - inflight_at_read, 0.0) + inflight_now


def derived_waiting(waiting: float, reading: float | None, inflight_at_read: float | None) -> float:
    """The engine's waiting count at its last reading less the share of it that must have been this replica's:
    those of ours in flight then beyond all the engine ran must have been waiting. This replica's own queued work
    is its backlog (extproc/backlog.py), counted now, not as read, so a reading taken while a request of ours
    waited does not queue the worker behind that request after it ended (a conversation's next turn, sent within
    the poll interval, would otherwise leave the worker holding its prefix). An upper bound on the others'
    waiting requests, as `derived_load` is on their load: ours may have been running while theirs waited."""
    if reading is None or inflight_at_read is None:
        return waiting
    ours_waiting = max(inflight_at_read - max(reading - waiting, 0.0), 0.0)
    return max(waiting - ours_waiting, 0.0)


@dataclass(frozen=True, slots=True)
class TargetInfo:
    """One routing target: a worker, or one data-parallel rank of it."""

    id: str
    worker: str
    rank: int | None
    slot: int
    model: str
    engine: str
    address: str
    exact_kv: bool
    """Ingest vouches for its ledger (stream in sync, hash parity not failed)."""
    healthy: bool
    engine_load: float | None
    engine_waiting: float = 0.0
    kv_usage: float | None = None
    """Share of its KV pool held by running requests at the last reading (None: unknown or too old)."""
    kv_capacity_tokens: float | None = None
    """Its KV pool in tokens (None: not reported)."""
    evicted_tokens_per_s: float | None = None
    """How fast its engine has been evicting lately (None: not known)."""
    regretted_tokens_per_s: float | None = None
    """How fast what it evicts has been coming back (None: not known)."""
    load_at: float | None = None
    """When its load and eviction count were read (monotonic; None: never)."""
    load_inflight: float | None = None
    """This replica's requests in flight there at that reading (None: not known; `derived_load`)."""
    added_at: float | None = None
    """When ingest added it (monotonic; None until ingest has spoken)."""
    why: str = ""
    """Why its ledger is not trusted, as a reason code ('' when it is)."""
    role: str = "both"
    """`both`, `prefill` or `decode` (PD pools, docs/pd.md)."""
    bootstrap_port: int | None = None
    """SGLang prefill: the port its decode connects to (None until ingest has read it)."""
    suspect: bool = False
    """Not in good standing with ingest (never probed yet, or its latest probe failed): routable, but never
    first while a worker in good standing exists. False for the config's list (nothing is known yet)."""
    tls_name: str | None = None
    """An https worker: the name its certificate must carry (extproc's own requests check it); None: http."""
    groups: tuple[GroupSlot, ...] = ()
    """A hybrid model's KV-cache specs and their slots (empty: `slot`'s leading run is the hit)."""
    tiers: tuple[TierSlot, ...] = ()
    """Its lower tiers' slots (empty: GPU only)."""
    lookahead_blocks: int = 0
    """Blocks a hit gives up to the engine's lookahead hashing (extproc/engine_hits.py)."""

    def load_now(self, inflight_now: float, alive: bool) -> tuple[float | None, float]:
        """Its running + waiting and its waiting count now, as routing and the waiting room read them
        (`derived_load`, `derived_waiting`): (None, 0) when its load is unknown or the view is not alive."""
        load = derived_load(self.engine_load, self.load_inflight, inflight_now) if alive else None
        if load is None:
            return None, 0.0
        return load, derived_waiting(self.engine_waiting, self.engine_load, self.load_inflight)

    @property
    def age_s(self) -> float | None:
        """Time since ingest added it (None until ingest has spoken)."""
        return None if self.added_at is None else time.monotonic() - self.added_at

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0].strip("[]")


class ClusterView:
    def __init__(self, cfg: CortexConfig, view_path: Path, index: int) -> None:
        self.cfg = cfg
        self.view_path = view_path
        self.stale_after = cfg.extproc.view_stale_after_s
        self.reader: ViewReader | None = None
        # Peered (cortex/peering.py), the boards have a row per peer after the processes' rows: the in-flight
        # counts and the backlog read below are the whole fleet's, as far as the peers have said.
        rows = board_rows(cfg)
        self.inflight = InflightBoard(cfg.runtime_path() / "inflight", index, rows, cfg.ingest.max_workers)
        self.backlog = BacklogBoard(cfg.runtime_path() / "backlog", index, rows, cfg.ingest.max_workers)
        self.touches = TouchBoard(cfg.runtime_path() / "touches", index, cfg.extproc.process_count(),
                                  cfg.ingest.max_workers)
        """When this replica last sent each block to each worker (the claim rule's recency)."""
        self.calibration = Calibration(cfg.runtime_path() / CALIBRATION_FILE)
        """Observed over predicted TTFT per worker, as `cortex observe` last wrote it."""
        self.alive = False
        self._lost = False
        self.block_size = cfg.block_size
        self._meta_version = -1
        self._published: list[TargetMeta] = []
        self._built: dict[str, tuple[TargetMeta, TargetInfo, float]] = {}
        """Per target id: the entry last published, the TargetInfo built from it, when its reading ages out."""
        self._refused_version = -1
        """The meta version last refused (cortex.contract): not decoded again until ingest writes a new one."""
        self._refused_reason = ""
        self._load_expires = math.inf
        """When the next published load reading turns unknown: the target list is rebuilt then."""
        self._inflight_failed = False
        self.refreshed_at = 0.0
        """When refresh() last ran (monotonic)."""
        self._files_at = -math.inf
        """When refresh() last looked at the files (FILES_EVERY_S)."""
        self.targets: dict[str, list[TargetInfo]] = {}
        self.by_address: dict[str, TargetInfo] = {}
        self._set_targets(self._config_targets())

    def _config_targets(self) -> list[TargetMeta]:
        """Until ingest has spoken: the config's workers, slots in config order as ingest assigns them."""
        targets: list[TargetMeta] = []
        for w in self.cfg.workers:
            ranks: list[int | None] = [None] if w.dp_size == 1 else list(range(w.dp_size))
            for rank in ranks:
                address = w.address()
                targets.append(TargetMeta(id=target_id(w.id, rank), worker=w.id, rank=rank,
                                          slot=len(targets), model=w.model, engine=w.engine, address=address,
                                          exact_kv=False, healthy=address != UNRESOLVED, role=w.role,
                                          bootstrap_port=w.bootstrap_port,
                                          tls_name=verify_name(self.cfg.upstream_tls, w)))
        return targets

    def _set_targets(self, targets: list[TargetMeta]) -> None:
        by_model: dict[str, list[TargetInfo]] = {}
        by_address: dict[str, TargetInfo] = {}
        now = time.monotonic()
        expires_first = math.inf
        built = {}
        for t in targets:
            kept = self._built.get(t.id)
            # Ingest republishes the whole list when one reading moves: a target whose entry is unchanged, and
            # whose reading has not aged out since, keeps the TargetInfo built for it (at 256 targets, building
            # them all again was most of each version's cost; docs/performance.md, "The worker document").
            if kept is not None and kept[0] == t and now < kept[2]:
                info, expires = kept[1], kept[2]
            else:
                info, expires = self._target_info(t, now)
            built[t.id] = (t, info, expires)
            expires_first = min(expires_first, expires)
            if t.load.evicted_tokens is not None:
                self.touches.note_evicted(t.slot, t.load.evicted_tokens)
            by_model.setdefault(info.model, []).append(info)
            by_address.setdefault(info.address, info)
        self.targets = by_model
        self.by_address = by_address
        self._published = targets
        self._built = built
        self._load_expires = expires_first

    @staticmethod
    def _target_info(t: TargetMeta, now: float) -> tuple[TargetInfo, float]:
        """The routing view of one published target, and when its load reading turns unknown."""
        engine_load, expires = engine_load_of(t.load, now)
        added_at = t.added_at
        if added_at is None and t.age_s is not None:
            added_at = now - t.age_s
        why = t.why if t.why is not None else "" if t.exact_kv else "ledger_unknown"
        info = TargetInfo(id=t.id, worker=t.worker or t.id, rank=t.rank, slot=t.slot, model=t.model,
                          engine=t.engine, address=t.address, exact_kv=t.exact_kv, healthy=t.healthy,
                          engine_load=engine_load, engine_waiting=t.load.waiting, added_at=added_at, why=why,
                          kv_usage=t.load.kv_usage if engine_load is not None else None,
                          kv_capacity_tokens=t.load.kv_capacity_tokens,
                          evicted_tokens_per_s=t.load.evicted_tokens_per_s,
                          regretted_tokens_per_s=t.load.regretted_tokens_per_s, load_at=t.load.at,
                          load_inflight=t.load.inflight,
                          role=t.role, bootstrap_port=t.bootstrap_port, suspect=t.suspect,
                          tls_name=t.tls_name, groups=t.groups, tiers=t.tiers,
                          lookahead_blocks=t.lookahead_blocks)
        return info, expires

    def refresh(self) -> None:
        """Background upkeep; cheap enough to run every 100-250 ms, and before a request when it has not."""
        now = self.refreshed_at = time.monotonic()
        # What needs a stat() of a file (a replaced view file, the calibration, a restarted peer's board rows) is
        # looked at once a second: each is a system call, and this runs ten times a second in every process. A
        # view file replaced by growth or by a new ingest is followed at once anyway (the writer marks the old
        # one retired, which every read checks); the stat is the fallback.
        files = now - self._files_at >= FILES_EVERY_S
        if files:
            self._files_at = now
        if self.reader is None:
            self.reader = ViewReader.open(self.view_path)
        elif (self.reader.refresh() if files else self.reader.followed()):
            self._meta_version = self._refused_version = -1  # a new file: its versions count afresh
        try:
            if files:
                self.calibration.refresh()
                self.inflight.refresh()
                self.backlog.refresh()
                self.touches.refresh()
        except Exception:
            # The peers' in-flight rows are an extra signal; a failure there must not freeze the worker list,
            # health and load this process routes by (issue 11: a dead worker stayed first after it was
            # marked down because this call raised on every tick before the list was re-read).
            if not self._inflight_failed:
                log.exception("in-flight board refresh failed; the ledger view is still refreshed")
            self._inflight_failed = True
        else:
            self._inflight_failed = False
        if self.reader is None:
            self._mark(False, "no ledger view yet")
            return
        if self.reader.heartbeat_age() > self.stale_after:
            self._mark(False, "ingest heartbeat stopped")
            return
        version, raw = self.reader.meta_raw()
        if version == self._refused_version:
            self._mark(False, self._refused_reason)
            return
        meta = None
        if version != self._meta_version:
            try:
                meta = read_meta(raw)
            except ContractError as exc:
                self._refuse(version, str(exc))
                return
        if meta is not None:
            self._meta_version, self._refused_reason = version, ""
            self.block_size = meta.block_size
            self._set_targets(meta.targets)
        elif time.monotonic() > self._load_expires:
            # Ingest republishes only what changed: a reading that stopped coming ages out here.
            self._set_targets(self._published)
        self._mark(True, "")

    def _refuse(self, version: int, reason: str) -> None:
        """A document this process cannot read (a rolling restart put a newer ingest next to it): the view is
        unusable until ingest publishes one it can, exactly as if ingest's heartbeat had stopped -- routed by
        the last target list read (or the config's) and this process's in-flight counts, no hit claimed."""
        if reason != self._refused_reason:
            log.error("ledger view refused: %s; routing by load without the ledger until it is readable", reason)
        VIEW_REFUSED.inc()
        self._refused_version, self._refused_reason = version, reason
        self._mark(False, f"ledger view refused: {reason}")

    def _mark(self, alive: bool, why: str) -> None:
        # The first sight of the view is the normal start (the server logs that it serves); a loss and a
        # recovery are what an operator must see.
        if alive and not self.alive:
            (log.info if self._lost else log.debug)("ledger view available%s", " again" if self._lost else "")
        elif self.alive and not alive:
            self._lost = True
            log.warning("ledger view unavailable: %s", why)
        self.alive = alive

    @property
    def synced(self) -> bool:
        """The view is alive and this process has read ingest's target list (not only the config's)."""
        return self.alive and self._meta_version >= 0

    def candidates(self, model: str) -> list[TargetInfo]:
        return [t for t in self.targets.get(model, ()) if t.healthy]

    def all_candidates(self) -> list[TargetInfo]:
        return [t for ts in self.targets.values() for t in ts if t.healthy]

    def match(self, keys: list[int]) -> np.ndarray | None:
        """Leading blocks held per slot, or None when the view cannot be trusted right now."""
        if not self.alive or self.reader is None or not len(keys):
            return None
        try:
            return self.reader.match(keys)
        except ViewBusy:
            return None

    def match_detail(self, keys: list[int], slots: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """`match`, plus per key which of `slots` hold it (ViewReader.match_detail); None as for `match`."""
        if not self.alive or self.reader is None or not len(keys):
            return None
        try:
            return self.reader.match_detail(keys, slots)
        except ViewBusy:
            return None
