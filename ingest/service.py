"""The ingest process: runs the workers' lifecycle, one event source per target, probes, and the shared view.

Everything runs on one asyncio loop, so the ledger has a single writer and needs no locks. The view
(cortex.ledger_view) is the only thing other processes see: key membership per target slot plus the meta
document (cortex.contract: each target's state and load), stamped with a heartbeat so readers notice if
ingest dies.

Who does what: ingest/membership.py decides which workers run (config, admin API, persistence, Envoy's
pools); ingest/probes.py reads health, load and tokenizer parity and ingest/workers.py applies the readings;
ingest/source.py follows one target's event stream into its ledger. This module schedules them: per worker a
health task and a load task, one tokenizer parity loop, the heartbeat/publication loop and the config loop;
one watch per Kubernetes pool (ingest/k8s_discovery.py) and the re-resolution of worker hostnames.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import zmq.asyncio

from cortex import breaker_status, engines
from cortex.config import UNRESOLVED, CortexConfig, WorkerConfig
from cortex.config_watch import ConfigWatcher
from cortex.contract import ClusterMeta, encode_meta, target_id
from cortex.inflight import BacklogBoard, InflightBoard
from cortex.ledger_view import ViewWriter
from cortex.model_bundle import ModelBundle
from cortex.peering import board_rows
from cortex.upstream_tls import WorkerTls, verify_name
from ingest import k8s_discovery, membership, silence, tokenizer_parity
from ingest.hash_parity import ParityCheck
from ingest.ledger import Ledger
from ingest.loop_cpu import timed
from ingest.membership import MembershipError
from ingest.peers import PeerLink
from ingest.probes import check_tokens, probe_health, read_load
from ingest.regret import Regret
from ingest.source import EventSource, cancel_quietly, rank_endpoint
from ingest.subscription import subscription
from ingest.sync import SourceSync, SyncState
from ingest.workers import Target, Worker, load_poll_interval

log = logging.getLogger("cortex.ingest")

PUBLISH_SPACING_S = 0.1
"""Least time between two writes of the target list (extproc re-reads it on each)."""
ROUTED_HOLD_S = 30.0
"""A worker this replica sent requests to within this long is read at the routed cadence while active (a replica
behind an L4 balancer sends each worker a request every few seconds; its own share is known either way)."""


class Ingest:
    def __init__(self, cfg: CortexConfig, config_path: Path | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self._config = ConfigWatcher(config_path, lambda c: (c, self._load_probes(c)))
        self.view = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers,
                               capacity=cfg.ingest.view_capacity)
        self.regret = Regret(self.view, cfg.block_size)
        """The ledgers' key sink: the view's writer, counting the evictions that had to be computed again."""
        self.zmq = zmq.asyncio.Context.instance()
        self.workers: dict[str, Worker] = {}
        self._sources: dict[str, asyncio.Task[None]] = {}
        """The running event sources' tasks, per target id (a worker without kv_events runs none)."""
        # Each worker's load poll and health probe run on their own, so a worker that hangs (up to a
        # timeout per request) slows only its own readings, never the others' (issue 11).
        self._probe_tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._parity_tasks: dict[str, asyncio.Task[None]] = {}
        self._background: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        # https workers' probes check certificates with this, built once (a bad file stops ingest at start).
        self.tls = WorkerTls(cfg.upstream_tls)
        self._publish_soon = asyncio.Event()
        self._meta_dirty = True
        self._parity_wakeup = asyncio.Event()
        self.state_file = membership.state_file(cfg)
        self.heartbeat_at = 0.0
        """When the view was last stamped (monotonic; 0 before the first): /health/ready's "ledger view live"."""
        # Cortex's own ids for the tokenizer parity probes, per model (rendered once, at start).
        self._probes = self._load_probes(cfg)
        # Read-only: where this replica's extproc processes have requests in flight, so a worker this replica
        # routes to is polled at the active cadence from the first request on.
        self._board = InflightBoard(cfg.runtime_path() / "inflight", None, board_rows(cfg), cfg.ingest.max_workers)
        # Read-only: when the work this replica last sent each worker is predicted done; a worker sent requests
        # lately has its load read at the routed cadence (extproc fills in its own share between readings).
        self._backlog = BacklogBoard(cfg.runtime_path() / "backlog", None, board_rows(cfg), cfg.ingest.max_workers)
        self._membership = asyncio.Lock()
        """Held by the changes that await (discovery, re-resolution), so two never interleave."""
        self._pool_tasks: list[asyncio.Task[None]] = []
        self._discovered: dict[int, dict[str, WorkerConfig]] = {}
        """Per discovery.kubernetes pool: the workers it added (their configs as added)."""

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        for wcfg, source in membership.restore(self.cfg, self.state_file):
            self._add(wcfg, source)
        self._sync_envoy()
        self.publish_meta()
        self._background = [asyncio.create_task(timed("heartbeat", self._heartbeat_loop())),
                            asyncio.create_task(timed("parity", self._token_parity_loop())),
                            asyncio.create_task(timed("config", self._config_loop())),
                            asyncio.create_task(timed("config", self._resolve_loop()))]
        if self.cfg.peers.enabled:
            link = PeerLink(self.cfg, self.zmq, lambda: {t.id: t.slot for w in self.workers.values()
                                                         for t in w.targets})
            self._background.append(asyncio.create_task(timed("peers", link.run()), name="peers"))
        self._start_discovery()

    async def stop(self) -> None:
        for task in [*self._background, *self._pool_tasks, *self._sources.values(),
                     *(t for ts in self._probe_tasks.values() for t in ts), *self._parity_tasks.values()]:
            await cancel_quietly(task)
        if self._session is not None:
            await self._session.close()
        self.view.close()

    @staticmethod
    def _load_probes(cfg: CortexConfig) -> dict[str, list[Any]]:
        if cfg.ingest.token_parity == "off":
            return {}
        return {m.name: tokenizer_parity.expected(ModelBundle.load(m.name, m.tokenizer_dir(), m.chat_template),
                                                  engines.adapter(m.engine).tool_style)
                for m in cfg.models}

    async def _config_loop(self) -> None:
        """Apply edits of cortex.yaml within a second or two: new or changed workers and models, removed
        ones, Envoy's pools. A bad edit is logged and ignored; the running config stays."""
        while True:
            await asyncio.sleep(1.0)
            change = await self._config.poll()
            if change is not None:
                await self._apply_config(*change)

    async def _apply_config(self, cfg: CortexConfig, probes: dict[str, list[Any]]) -> None:
        if cfg.upstream_tls != self.cfg.upstream_tls:
            # Read once per process (ingest, extproc and Envoy must agree): kept until the restart.
            log.warning("upstream_tls changed: it takes effect when the gateway restarts")
            cfg = cfg.model_copy(update={"upstream_tls": self.cfg.upstream_tls})
        remove, add = membership.config_change(self.cfg, cfg, self.workers)
        rediscover = cfg.discovery.kubernetes != self.cfg.discovery.kubernetes
        self.cfg, self._probes = cfg, probes
        if rediscover:
            await self._stop_discovery()
        for wid in remove:
            await self.remove_worker(wid, persist=False)
        for wcfg in add:
            self._add(wcfg, membership.CONFIG)
        self._save_state()
        self._sync_envoy()
        self._meta_dirty = True
        if rediscover:
            self._start_discovery()
        log.info("config reloaded: %d models, %d workers", len(cfg.models), len(self.workers))

    def _save_state(self) -> None:
        membership.save(self.state_file, self.cfg, self.workers.values())

    def _sync_envoy(self) -> None:
        membership.sync_envoy(self.cfg, self.workers.values())

    # -- membership --------------------------------------------------------------------------------------

    def add_worker(self, wcfg: WorkerConfig) -> Worker:
        """Admin API: validate against the config's models, add, persist, and tell Envoy."""
        membership.check_addition(self.cfg, wcfg, self.workers)
        worker = self._add(wcfg, membership.API)
        self._save_state()
        self._sync_envoy()
        return worker

    async def remove_worker(self, worker_id: str, *, persist: bool = True) -> None:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise MembershipError(404, f"no worker {worker_id!r}")
        if persist:
            membership.check_removal(worker)
        del self.workers[worker_id]
        tasks = self._probe_tasks.pop(worker_id, [])
        parity = self._parity_tasks.pop(worker_id, None)
        for task in tasks if parity is None else [*tasks, parity]:
            await cancel_quietly(task)
        for t in worker.targets:
            t.events.close()  # fences any callback still in flight for the old incarnation
            stream = self._sources.pop(t.id, None)
            if stream is not None:
                await cancel_quietly(stream)
            # One write section: extproc sees the target's blocks all present or all gone.
            t.events.ledger.clear(self.view)
        if persist:
            self._save_state()
            self._sync_envoy()
        self._meta_dirty = True
        self.publish_meta()
        log.info("worker %s removed", worker_id)

    def _used_slots(self) -> set[int]:
        # A target's own slot and those its ledger took for a hybrid model's other KV-cache specs and lower tiers.
        used = {t.slot for w in self.workers.values() for t in w.targets}
        used.update(s for w in self.workers.values() for t in w.targets for s in t.events.ledger.slots())
        return used

    def _free_slots(self, n: int) -> list[int]:
        used = self._used_slots()
        free = [s for s in range(self.view.max_workers) if s not in used][:n]
        if len(free) < n:
            raise MembershipError(507, f"no free target slot (ingest.max_workers={self.view.max_workers})")
        return free

    def _spare_slot(self) -> int | None:
        """A slot for a ledger's other KV-cache spec or tier (None: all taken; that target is then not exact)."""
        used = self._used_slots()
        return next((s for s in range(self.view.max_workers) if s not in used), None)

    def _add(self, wcfg: WorkerConfig, source: str, address: str | None = None) -> Worker:
        model = self.cfg.model(wcfg.model)
        assert model is not None  # checked by config validation or add_worker
        worker = Worker(cfg=wcfg, address=address or wcfg.address(), source=source,
                        parity_policy=self.cfg.ingest.token_parity,
                        tls_name=verify_name(self.cfg.upstream_tls, wcfg))
        if worker.address == UNRESOLVED:
            # Kept, out of routing and out of Envoy's endpoints: the resolve loop moves it in once the name answers.
            worker.healthy = False
            log.warning("worker %s: %s does not resolve; it gets no request until it does", wcfg.id,
                        wcfg.host_port[0])
        if wcfg.kv_events is None:
            worker.events_usable, worker.events_reason = False, "no kv_events endpoint configured: routed by load"
        ranks: list[int | None] = [None] if wcfg.dp_size == 1 else list(range(wcfg.dp_size))
        for rank, slot in zip(ranks, self._free_slots(len(ranks)), strict=True):
            parity = ParityCheck(engine=wcfg.engine, page_size=model.engine_page_size(),
                                 hash_algo=model.hash_algo or engines.adapter(wcfg.engine).default_hash_algo,
                                 hash_seed=model.hash_seed)
            tid = target_id(wcfg.id, rank)
            events = EventSource(
                tid, Ledger(slot=slot, engine=wcfg.engine, block_size=self.cfg.block_size, parity=parity,
                            alloc=self._spare_slot), parity,
                SourceSync(has_replay=wcfg.kv_replay is not None), self.zmq, self.regret,
                endpoint=rank_endpoint(wcfg.kv_events, rank), replay_endpoint=rank_endpoint(wcfg.kv_replay, rank),
                topic=wcfg.kv_topic, on_change=self._changed, on_events=partial(self._events_arrived, worker))
            target = Target(worker=worker, rank=rank, slot=slot, events=events, regret=self.regret)
            # A slot may have been used by a removed target: start from a clean bitset and a clean count.
            self.view.clear_worker(slot)
            self.regret.forget([slot])
            worker.targets.append(target)
            if worker.events_usable:
                self._sources[tid] = asyncio.get_running_loop().create_task(timed("events", events.run()),
                                                                                name=f"src-{tid}")
        self.workers[wcfg.id] = worker
        loop = asyncio.get_running_loop()
        self._probe_tasks[wcfg.id] = [
            loop.create_task(timed("health", self._watch_health(worker)), name=f"health-{wcfg.id}"),
            loop.create_task(timed("load", self._poll_load(worker)), name=f"load-{wcfg.id}")]
        self._parity_wakeup.set()
        self._meta_dirty = True
        log.info("worker %s added (%s, %s, %d target(s))", wcfg.id, wcfg.url, source, len(worker.targets))
        return worker

    # -- workers found at run time: Kubernetes pools, hostnames resolved again -------------------------------

    def _start_discovery(self) -> None:
        assert self._session is not None
        for i, pool in enumerate(self.cfg.discovery.kubernetes):
            watch = k8s_discovery.PoolWatch(pool, self._session, partial(self._apply_pool_whole, i))
            self._pool_tasks.append(asyncio.create_task(timed("config", watch.run()), name=f"k8s-{i}"))

    async def _stop_discovery(self) -> None:
        """Stop the pools' watches and remove every worker they added (a changed pool starts afresh)."""
        for task in self._pool_tasks:
            await cancel_quietly(task)
        self._pool_tasks = []
        async with self._membership:
            for applied in self._discovered.values():
                for wid in applied:
                    current = self.workers.get(wid)
                    if current is not None and current.source == membership.K8S:
                        await self.remove_worker(wid, persist=False)
            self._discovered.clear()

    async def _apply_pool_whole(self, index: int, desired: dict[str, WorkerConfig]) -> None:
        # A watch cancelled (config reload) mid-change must not leave a worker half removed: the change
        # finishes, and _stop_discovery, which waits for the lock, then removes what it added.
        await asyncio.shield(self._apply_pool(index, desired))

    async def _apply_pool(self, index: int, desired: dict[str, WorkerConfig]) -> None:
        """A pool's workers as its pods are now: removed and added through the admin API's membership path
        (so a removed worker's ledger is dropped as for an admin removal; an unchanged one is left alone)."""
        async with self._membership:
            applied = self._discovered.setdefault(index, {})
            remove, add = k8s_discovery.changes(applied, desired)
            for wid in remove:
                del applied[wid]
                current = self.workers.get(wid)
                if current is not None and current.source == membership.K8S:
                    await self.remove_worker(wid, persist=False)
            added = 0
            for wcfg in add:
                try:
                    membership.check_addition(self.cfg, wcfg, self.workers)
                    self._add(wcfg, membership.K8S)
                except MembershipError as exc:
                    # Not in `applied`: tried again at the pool's next change.
                    log.warning("discovered worker %s not added: %s", wcfg.id, exc)
                    continue
                applied[wcfg.id] = wcfg
                added += 1
            if remove or added:
                self._sync_envoy()
                self._meta_dirty = True

    async def _resolve_loop(self) -> None:
        """Every health interval, resolve the hostnames of the workers named by one again: pods move, and a
        worker whose address no longer resolves moves to the new one (membership.address_moved)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.cfg.ingest.health_interval_s)
            for worker in list(self.workers.values()):
                host, port = worker.cfg.host_port
                with contextlib.suppress(ValueError):
                    ipaddress.ip_address(host)
                    continue
                try:
                    async with asyncio.timeout(self.cfg.ingest.health_timeout_s):
                        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                except (OSError, TimeoutError) as exc:
                    log.debug("resolving %s for worker %s failed: %s (address kept)", host, worker.id, exc)
                    continue
                moved = membership.address_moved(
                    worker.address, [membership.format_address(str(i[4][0]), port) for i in infos])
                if moved is not None:
                    await self._move(worker, moved)

    async def _move(self, worker: Worker, address: str) -> None:
        """A worker's hostname answers a new address: the same worker config at a new place (a new process
        behind the name: its ledger starts over, as for a config edit of its url)."""
        async with self._membership:
            if self.workers.get(worker.id) is not worker:
                return  # removed or replaced meanwhile
            log.info("worker %s: %s now resolves to %s (was %s)", worker.id, worker.cfg.host_port[0], address,
                     worker.address)
            await self.remove_worker(worker.id, persist=False)
            self._add(worker.cfg, worker.source, address)
            self._sync_envoy()
            self._meta_dirty = True

    @property
    def _meta_dirty(self) -> bool:
        """The target list changed since it was last written to the view."""
        return self._dirty

    @_meta_dirty.setter
    def _meta_dirty(self, value: bool) -> None:
        self._dirty = value
        if value:
            self._publish_soon.set()  # written at once, not at the next heartbeat

    def _changed(self) -> None:
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

    # -- probes and publication --------------------------------------------------------------------------

    def targets(self) -> list[Target]:
        return [t for w in self.workers.values() for t in w.targets]

    def publish_meta(self) -> None:
        targets = self.targets()
        self.view.set_meta(encode_meta(ClusterMeta(block_size=self.cfg.block_size,
                                                   targets=[t.routable_meta() for t in targets])))
        for t in targets:
            t.mark_published()
        self._meta_dirty = False

    async def _heartbeat_loop(self) -> None:
        """Stamp the view, notice requests this replica routes, and publish the target list when it changed:
        at once, at most every PUBLISH_SPACING_S (a burst of changes is one write). Load readings come from
        _poll_load (one task per worker) and mark the list changed only when a value, the poll interval in force,
        or the reading's freshness needs it: an idle fleet's list stays still and this loop wakes only every
        heartbeat_interval_s."""
        tick = 0
        published_at = 0.0
        while True:
            self.view.heartbeat()
            self._check_routed(tick)
            if self._meta_dirty:
                wait = published_at + PUBLISH_SPACING_S - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self.publish_meta()
                published_at = time.monotonic()
            self.heartbeat_at = time.monotonic()
            tick += 1
            self._publish_soon.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.ingest.heartbeat_interval_s):
                    await self._publish_soon.wait()

    def _check_routed(self, tick: int) -> None:
        """A worker with requests in flight from this replica's extproc processes is active: wake its polling."""
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
            if worker.healthy:
                try:
                    per_rank = await read_load(self._session, worker.cfg, timeout=max(icfg.load_poll_interval_s * 5,
                                                                                      0.5),
                                               tls=self.tls.kwargs(worker.tls_name))
                except Exception as exc:  # a worker's bad answer must not end its polling
                    log.debug("load read failed for %s: %s", worker.id, exc)
                else:
                    own = self._own_inflight()
                    worker.apply_load(per_rank, time.monotonic(), own)
            now = time.monotonic()
            if any(t.load.at and (t.load.running > 0 or t.load.waiting > 0) for t in worker.targets):
                worker.active_until = max(worker.active_until, now + self._active_hold_s())
            worker.idle = now >= worker.active_until
            every = load_poll_interval(not worker.idle, self._routed_here(worker, now, own), icfg)
            if every != worker.poll_every:
                worker.poll_every = every
                self._meta_dirty = True
            self._check_worker(worker, now)
            if any(t.load_news(now, worker.poll_every) for t in worker.targets):
                self._meta_dirty = True
            if not worker.idle:
                await asyncio.sleep(every)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(worker.wake.wait(), every)

    def _own_inflight(self) -> np.ndarray | None:
        """This replica's requests in flight per slot, from its extproc processes' board (None: unreadable)."""
        try:
            return self._board.totals()
        except Exception:  # an extra signal only
            log.debug("in-flight board unreadable", exc_info=True)
            return None

    def _routed_here(self, worker: Worker, now: float, own: np.ndarray | None) -> bool:
        """This replica sends the worker requests: some in flight now, or work sent there predicted done within
        the last ROUTED_HOLD_S (the backlog board's latest end)."""
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
            quiet_since = max(t.busy_since, ev.last_event_at)
            running = t.id in self._sources
            if running and t.busy_since and ev.sync.state is SyncState.READY and now - quiet_since > limit:
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

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        # extproc's circuit breakers, judged by the answers each process saw (cortex/breaker_status.py).
        breakers = breaker_status.read(self.cfg.runtime_path(), self.cfg.extproc.process_count())
        closed = {"state": "closed", "processes": {}}
        return {"workers": [{
            "id": w.id, "url": w.cfg.url, "model": w.cfg.model, "engine": w.cfg.engine, "source": w.source,
            "healthy": w.healthy, "health_failures": w.health_failures, "suspect": w.suspect,
            "breaker": breakers.get(w.address, closed),
            "dp_size": w.cfg.dp_size,
            "token_parity": {"status": w.token_parity.status, "reason": w.token_parity.reason,
                             "checks": w.token_parity.checks},
            "events": _worker_events(w),
            "targets": [{**t.status(now), "subscription": subscription(t)} for t in w.targets],
        } for w in self.workers.values()], "pid": os.getpid()}


def _worker_events(w: Worker) -> str:
    """The worker's KV-event status: the worst of its targets' (silent > waiting > flowing), or off."""
    if not w.events_usable:
        return silence.OFF
    statuses = {t.events_status for t in w.targets}
    return next((s for s in (silence.SILENT, silence.WAITING) if s in statuses), silence.FLOWING)
