"""Each worker's probe loops: when ingest reads a worker's health, load and tokenizer parity, and the checks a
load reading triggers (a silent stream, a publisher that never spoke, lost tails).

Per worker a health task and a load task, so a worker that hangs (up to a timeout per request) slows only its
own readings, never the others' (issue 11); one tokenizer parity loop starts a check per worker as it falls due.
The reads themselves are ingest/probes.py's and applying a reading is ingest/workers.py's; this module decides
when they run. The load cadence adapts (workers.load_poll_interval): a worker at work is read often, an idle one
rarely, and a sign of work (events arriving, requests this replica routes there) wakes the idle wait at once.
Peered replicas split the reads (cortex/peering.py): a worker another live replica reads is not read here while its
readings keep arriving in that replica's reports (`apply_readings`); those this replica takes go out in its own
(`take_readings`).

Part of the Ingest (ingest/service.py), which owns the state this part reads and starts its tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

import aiohttp
import numpy as np
from prometheus_client import Counter

from cortex import peering
from cortex.config import CortexConfig
from cortex.inflight import BacklogBoard, InflightBoard
from cortex.ledger_view import ViewWriter
from cortex.upstream_tls import WorkerTls
from ingest import silence, tokenizer_parity
from ingest.loop_cpu import timed
from ingest.peers import PeerLink
from ingest.probes import LoadByRank, check_tokens, probe_health, read_load
from ingest.sync import SyncState
from ingest.workers import Worker, load_poll_interval

log = logging.getLogger("cortex.ingest")

READINGS = Counter("cortex_ingest_load_readings_total", "Workers' load readings applied, by source: read (this "
                   "replica read the engine) or peer (a peer replica's reading, from its report)", ["source"])

ROUTED_HOLD_S = 30.0
"""A worker this replica sent requests to within this long is read at the routed cadence while active (a replica
behind an L4 balancer sends each worker a request every few seconds; its own share is known either way)."""


class ProbeLoops:
    """The Ingest's probe loops (module docstring)."""

    # Set up by Ingest.__init__ (ingest/service.py); cfg and _probes are replaced at each config reload.
    cfg: CortexConfig
    view: ViewWriter
    workers: dict[str, Worker]
    tls: WorkerTls
    _session: aiohttp.ClientSession | None
    _sources: dict[str, asyncio.Task[None]]
    _parity_tasks: dict[str, asyncio.Task[None]]
    _parity_wakeup: asyncio.Event
    _probes: dict[str, list[Any]]
    _board: InflightBoard
    _backlog: BacklogBoard
    _meta_dirty: bool
    """The target list changed since it was last written to the view (setting it wakes the publication)."""
    _peer_link: PeerLink | None
    _outbox: dict[str, tuple[float, LoadByRank]]
    """The readings this replica took since its last peer report, by worker id (the latest of each)."""
    _active_n = 0
    _idle_n = 0
    _counted_at = -math.inf

    def _check_routed(self, tick: int) -> None:
        """A worker with requests in flight from this replica's extproc processes, or its peers' (their rows of the
        board), is active and routed to: wake its polling, and note when (`_routed_here`)."""
        try:
            if tick % 8 == 0:
                self._board.refresh()  # an extproc process restarted: follow its new row
                self._backlog.refresh()
            totals = self._board.totals()
        except Exception:  # an extra signal only: never let it stop the heartbeat
            log.debug("in-flight board unreadable", exc_info=True)
            return
        if not totals.any():
            return
        now = time.monotonic()
        for w in self.workers.values():
            if any(0 <= t.slot < totals.size and totals[t.slot] > 0 for t in w.targets):
                w.routed_at = now
                self._wake(w, now)

    async def _poll_load(self, worker: Worker) -> None:
        """One worker's load readings. A read that hangs holds back this worker's next read only.

        Adaptive (workers.load_poll_interval): while the worker is active (requests running or waiting at the last
        reading, KV events arriving, requests routed here in flight), every `routed_load_poll_interval_s` if this
        replica sends it requests, else every `load_poll_interval_s`; every `idle_load_poll_interval_s` otherwise,
        and a sign of work wakes that idle wait at once (_wake)."""
        assert self._session is not None
        icfg = self.cfg.ingest
        while True:
            worker.wake.clear()
            own = None
            worker.reads_here = self._reads_itself(worker, time.monotonic())
            if worker.healthy and worker.reads_here:
                try:
                    per_rank = await read_load(self._session, worker.cfg, timeout=max(icfg.load_poll_interval_s * 5,
                                                                                      0.5),
                                               tls=self.tls.kwargs(worker.tls_name))
                except Exception as exc:  # a worker's bad answer must not end its polling
                    log.debug("load read failed for %s: %s", worker.id, exc)
                else:
                    own = self._own_inflight()
                    at = time.monotonic()
                    worker.apply_load(per_rank, at, own)
                    worker.read_by = ""
                    READINGS.labels("read").inc()
                    if self._peer_link is not None:
                        self._outbox[worker.id] = (at, per_rank)
            now = time.monotonic()
            if any(t.load.at and (t.load.running > 0 or t.load.waiting > 0) for t in worker.targets):
                worker.active_until = max(worker.active_until, now + self._active_hold_s())
            worker.idle = now >= worker.active_until
            every = load_poll_interval(not worker.idle, self._routed_here(worker, now, own), icfg,
                                       *self._read_here(now))
            if every != worker.poll_every:
                worker.poll_every = every
                self._meta_dirty = True
            self._after_reading(worker, now)
            if not worker.idle:
                await asyncio.sleep(every)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(worker.wake.wait(), every)

    def _after_reading(self, worker: Worker, now: float) -> None:
        self._check_worker(worker, now)
        if any(t.load_news(now, worker.poll_every) for t in worker.targets):
            self._meta_dirty = True

    def _reads_itself(self, worker: Worker, now: float) -> bool:
        """This replica reads the worker's load itself (cortex/peering.py reads_itself): not peered, sharing off,
        no live peer, it is the worker's reader, or its reader's readings stopped arriving."""
        link = self._peer_link
        if link is None or link.readings is None:
            return True
        peers = link.live_peers()
        if not peers:
            return True
        every = max(worker.poll_every, self.cfg.ingest.load_poll_interval_s)
        return peering.reads_itself(link.replica, worker.id, peers, worker.shared_at, now,
                                    peering.patience(every, link.cfg.interval_s))

    def take_readings(self, now: float) -> tuple[peering.Reading, ...]:
        """The readings this replica took since its last report, for the report (ingest/peers.py)."""
        if not self._outbox:
            return ()
        out = tuple(peering.Reading(wid, round(max(now - at, 0.0) * 1000.0, 1), per_rank)
                    for wid, (at, per_rank) in self._outbox.items())
        self._outbox.clear()
        return out

    def apply_readings(self, peer: str, readings: tuple[peering.Reading, ...], now: float) -> None:
        """A peer's readings (ingest/peers.py), applied as this replica's own would be, with this replica's
        in-flight counts as of now: each only when newer than the worker's latest reading here, and not for a
        worker this replica does not know or holds down (its own health probes decide that)."""
        own = self._own_inflight()
        for r in readings:
            w = self.workers.get(r.worker)
            if w is None or not w.healthy:
                continue
            at = now - max(r.age_ms, 0.0) / 1000.0
            if any(t.load.at >= at for t in w.targets):
                continue
            w.apply_load(r.ranks, at, own)
            w.read_by, w.shared_at = peer, now
            READINGS.labels("peer").inc()
            if any(t.load.running > 0 or t.load.waiting > 0 for t in w.targets):
                self._wake(w, now)
            self._after_reading(w, now)

    def _read_here(self, now: float) -> tuple[int, int]:
        """Workers this replica reads itself on an active cadence, and on the idle one (the read budgets' divisors:
        a worker a peer reads costs nothing here), counted at most every 0.1 s: every load loop asks, and counting
        is O(workers)."""
        if now - self._counted_at >= 0.1:
            self._counted_at = now
            here = [w.idle for w in self.workers.values() if w.reads_here]
            self._idle_n = sum(here)
            self._active_n = len(here) - self._idle_n
        return self._active_n, self._idle_n

    def _own_inflight(self) -> np.ndarray | None:
        """This replica's requests in flight per slot, from its extproc processes' board (None: unreadable)."""
        try:
            return self._board.totals()
        except Exception:  # an extra signal only
            log.debug("in-flight board unreadable", exc_info=True)
            return None

    def _routed_here(self, worker: Worker, now: float, own: np.ndarray | None) -> bool:
        """This replica, or a peer, sends the worker requests: some in flight now or at a heartbeat within the last
        ROUTED_HOLD_S (the board's rows are this replica's processes' and its peers': extproc adds the change in
        both to a reading), or work this replica sent there predicted done within that time (the backlog board's
        latest end)."""
        if now - worker.routed_at < ROUTED_HOLD_S:
            return True
        try:
            latest = self._backlog.latest()
        except Exception:
            log.debug("backlog board unreadable", exc_info=True)
            latest = None
        since = now - ROUTED_HOLD_S
        for t in worker.targets:
            if own is not None and 0 <= t.slot < own.size and own[t.slot] > 0:
                return True
            if latest is not None and 0 <= t.slot < latest.size and latest[t.slot] > since:
                return True
        return False

    def _check_worker(self, w: Worker, now: float) -> None:
        """After each load reading: the checks that depend on it (silence, lost tails)."""
        self._check_silence(w, now)
        self._check_publishers(w, now)
        self._check_tails(w)

    def _check_silence(self, w: Worker, now: float) -> None:
        """A busy worker whose stream has been quiet too long may be losing events: resync it."""
        if not w.events_usable:
            return
        limit = self.cfg.ingest.event_silence_s
        for t in w.targets:
            ev = t.events
            if t.id in self._sources and ev.sync.state is SyncState.READY and t.quiet_while_busy(now, limit):
                ev.silent(f"no event batch for {limit:.0f}s while the worker was busy", now)

    def _check_publishers(self, w: Worker, now: float) -> None:
        """Name the workers that serve requests but publish no KV events (ingest.silence): reported in
        /cortex/workers, the metrics and the log, and kept out of exact-KV routing while silent."""
        # A decode-only worker publishes only if its engine keeps a prefix cache for the KV it receives
        # (SGLang's --disaggregation-decode-enable-radix-cache is off by default): its quiet proves nothing.
        if not w.events_usable or w.cfg.role == "decode":
            return
        for t in w.targets:
            if t.id in self._sources:
                t.events.check_link(now)
            before = t.observe_publisher(now, self.cfg.ingest.event_silence_s)
            status = t.events_status
            if status == silence.SILENT and before != silence.SILENT:
                log.warning("worker %s (target %s) publishes no KV events: %s; routed by load only until "
                            "its events arrive", w.id, t.id, t.silence_reason)
            elif status != silence.SILENT and before == silence.SILENT:
                log.info("worker %s (target %s): KV events %s again", w.id, t.id, status)
            if status != before:
                self._meta_dirty = True

    def _check_tails(self, w: Worker) -> None:
        """The engine worked since the last poll (its counter moved, or requests ran or just finished): its
        batches may all have been lost, so no arrival would ever trigger a tail check. Ask replay."""
        for t in w.targets:
            if t.id in self._sources and t.tail_check_due():
                t.events.check_tail()

    async def _watch_health(self, worker: Worker) -> None:
        """One worker's health probes: the first at once (a new worker is not in good standing until it
        passed one), then every health_interval_s after the previous probe ended."""
        assert self._session is not None
        icfg = self.cfg.ingest
        while True:
            was_healthy = worker.healthy
            shown = (worker.healthy, worker.suspect, worker.bootstrap_port)
            try:
                reading = await probe_health(self._session, worker.cfg.url, icfg.health_timeout_s,
                                             bootstrap_port_info=worker.bootstrap_port_info,
                                             tls=self.tls.kwargs(worker.tls_name))
            except Exception:  # probe_health reads every expected failure itself; keep probing whatever else
                log.exception("health probe of %s failed unexpectedly", worker.id)
            else:
                worker.apply_health(reading, icfg.health_failures)
            if was_healthy and not worker.healthy and self.workers.get(worker.id) is worker:
                # A dead engine's cache is gone, or soon will be: prune what the ledger lists for it.
                log.warning("worker %s is down (%d failed probes): its ledger entries are pruned",
                            worker.id, worker.health_failures)
                for t in worker.targets:
                    t.events.ledger.clear(self.view)
            elif worker.healthy and not was_healthy:
                log.info("worker %s is up again", worker.id)
            if (worker.healthy, worker.suspect, worker.bootstrap_port) != shown:
                self._meta_dirty = True  # health, standing or an SGLang prefill's bootstrap port changed
            await asyncio.sleep(icfg.health_interval_s)

    async def _token_parity_loop(self) -> None:
        if self.cfg.ingest.token_parity == "off":
            return
        interval = self.cfg.ingest.token_parity_interval_s
        while True:
            now = time.monotonic()
            for w in list(self.workers.values()):
                task = self._parity_tasks.get(w.id)
                if task is not None and not task.done():
                    continue  # a worker that does not answer holds up its own check only
                if w.healthy and now >= w.token_parity.checked_at + (
                        interval if w.token_parity.status == tokenizer_parity.OK else 10.0):
                    self._parity_tasks[w.id] = asyncio.create_task(timed("parity", self._check_tokens(w)),
                                                                   name=f"parity-{w.id}")
            pending = any(w.token_parity.status != tokenizer_parity.OK for w in self.workers.values())
            self._parity_wakeup.clear()
            with contextlib.suppress(TimeoutError):
                # A new worker wakes the loop at once: its exact-KV routing waits on this check.
                await asyncio.wait_for(self._parity_wakeup.wait(), 1.0 if pending else 5.0)

    async def _check_tokens(self, w: Worker) -> None:
        assert self._session is not None
        status, reason = await check_tokens(self._session, w.cfg, self._probes[w.cfg.model],
                                            self.cfg.ingest.health_timeout_s, tls=self.tls.kwargs(w.tls_name))
        if w.apply_tokens(status, reason, time.monotonic()) != status:
            level = logging.ERROR if status == tokenizer_parity.FAILED else logging.INFO
            log.log(level, "worker %s: tokenizer parity %s: %s", w.id, status, reason)
            self._meta_dirty = True

    def _events_arrived(self, worker: Worker) -> None:
        # Events mean the engine is working, whoever sent it the requests (another replica, direct traffic).
        self._wake(worker, time.monotonic())

    def _wake(self, worker: Worker, now: float) -> None:
        """Poll this worker at an active cadence from now on (for a while), starting with a reading now if it was
        on the idle one (an active cadence is not cut short: events arrive all the time from a busy worker)."""
        worker.active_until = max(worker.active_until, now + self._active_hold_s())
        if worker.idle:
            worker.wake.set()

    def _active_hold_s(self) -> float:
        # How long a sign of work keeps a worker on the active cadence after it was last seen.
        return 2 * self.cfg.ingest.idle_load_poll_interval_s
