"""The ingest process: worker lifecycle, one event source per target, probes, and the shared view.

Everything runs on one asyncio loop, so the ledger has a single writer and needs no locks. The view
(cortex.ledger_view) is the only thing other processes see: key membership per target slot plus a small JSON
document with each target's state and load, stamped with a heartbeat so readers notice if ingest dies.

Workers come from the config file and from the admin API; API changes are kept in
`<runtime_dir>/workers.json`, so a restarted ingest (the supervisor restarts it) comes back with the same
fleet. Every membership change also rewrites Envoy's EDS files, so Envoy and Cortex agree on the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import zmq.asyncio

from cortex.config import CortexConfig, WorkerConfig
from cortex.config_watch import ConfigWatcher
from cortex.contract import ClusterMeta, encode_meta
from cortex.envoy_config import atomic_write, write_xds
from cortex.inflight import InflightBoard
from cortex.ledger_view import ViewWriter
from cortex.model_bundle import ModelBundle
from ingest import silence, tokenizer_parity
from ingest.hash_parity import ParityCheck
from ingest.ledger import Ledger
from ingest.readiness import subscription
from ingest.source import EventSource, cancel_quietly
from ingest.sync import SourceSync, SyncState
from ingest.workers import Target, Worker, probe_health, read_load

log = logging.getLogger("cortex.ingest")

PUBLISH_SPACING_S = 0.1
"""Least time between two writes of the target list (extproc re-reads it on each)."""


class MembershipError(ValueError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Ingest:
    def __init__(self, cfg: CortexConfig, config_path: Path | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self._config = ConfigWatcher(config_path, lambda c: (c, self._load_probes(c)))
        self.view = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers,
                               capacity=cfg.ingest.view_capacity)
        self.zmq = zmq.asyncio.Context.instance()
        self.workers: dict[str, Worker] = {}
        self._sources: dict[str, tuple[EventSource, asyncio.Task[None]]] = {}
        # Each worker's load poll and health probe run on their own, so a worker that hangs (up to a
        # timeout per request) slows only its own readings, never the others' (issue 11).
        self._probe_tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._parity_tasks: dict[str, asyncio.Task[None]] = {}
        self._background: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._epochs = itertools.count(1)
        self._publish_soon = asyncio.Event()
        self._meta_dirty = True
        self._parity_wakeup = asyncio.Event()
        self.state_file = cfg.runtime_path() / "workers.json"
        self.heartbeat_at = 0.0
        """When the view was last stamped (monotonic; 0 before the first): /health/ready's "ledger view live"."""
        # Cortex's own ids for the tokenizer parity probes, per model (rendered once, at start).
        self._probes = self._load_probes(cfg)
        # Read-only: where this replica's extproc processes have requests in flight, so a worker this replica
        # routes to is polled at the active cadence from the first request on.
        self._board = InflightBoard(cfg.runtime_path() / "inflight", None, cfg.extproc.process_count(),
                                    cfg.ingest.max_workers)

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        for wcfg, source in self._initial_workers():
            self._add(wcfg, source)
        self._sync_envoy()
        self.publish_meta()
        self._background = [asyncio.create_task(self._heartbeat_loop()),
                            asyncio.create_task(self._token_parity_loop()),
                            asyncio.create_task(self._config_loop())]

    async def stop(self) -> None:
        for task in [*self._background, *(task for _, task in self._sources.values()),
                     *(t for ts in self._probe_tasks.values() for t in ts), *self._parity_tasks.values()]:
            await cancel_quietly(task)
        if self._session is not None:
            await self._session.close()
        self.view.close()

    def _initial_workers(self) -> list[tuple[WorkerConfig, str]]:
        added: list[WorkerConfig] = []
        removed: set[str] = set()
        if self.state_file.is_file():
            try:
                doc = orjson.loads(self.state_file.read_bytes())
                added = [WorkerConfig.model_validate(w) for w in doc.get("added", [])]
                removed = set(doc.get("removed", []))
            except (ValueError, TypeError) as exc:
                log.error("ignoring unreadable %s: %s", self.state_file, exc)
        out = [(w, "config") for w in self.cfg.workers if w.id not in removed]
        ids = {w.id for w, _ in out}
        out += [(w, "api") for w in added if w.id not in ids]
        restored = [w.id for w, src in out if src == "api"]
        if restored or removed:
            # Persistence is deliberate (a restarted ingest keeps its fleet), but must never surprise anyone.
            log.info("fleet changes made through the admin API restored from %s: added %s, removed %s "
                     "(`cortex run --reset-workers` forgets them)", self.state_file, restored or "none",
                     sorted(removed) or "none")
        return out

    @staticmethod
    def _load_probes(cfg: CortexConfig) -> dict[str, list[Any]]:
        if cfg.ingest.token_parity == "off":
            return {}
        return {m.name: tokenizer_parity.expected(ModelBundle.load(m.name, m.tokenizer_dir(), m.chat_template))
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
        old = {w.id: w for w in self.cfg.workers}
        new = {w.id: w for w in cfg.workers}
        self.cfg, self._probes = cfg, probes
        for wid, wcfg in old.items():
            current = self.workers.get(wid)
            if current is not None and current.source == "config" and new.get(wid) != wcfg:
                await self.remove_worker(wid, persist=False)
        for wid, wcfg in new.items():
            if wid not in self.workers:
                self._add(wcfg, "config")
        self._save_state()
        self._sync_envoy()
        self._meta_dirty = True
        log.info("config reloaded: %d models, %d workers", len(cfg.models), len(self.workers))

    def _save_state(self) -> None:
        config_ids = {w.id for w in self.cfg.workers}
        doc = {"added": [w.cfg.model_dump(mode="json") for w in self.workers.values() if w.source == "api"],
               "removed": sorted(config_ids - set(self.workers))}
        atomic_write(self.state_file, orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())

    def _sync_envoy(self) -> None:
        write_xds(self.cfg, [w.cfg for w in self.workers.values()])

    # -- membership --------------------------------------------------------------------------------------

    def add_worker(self, wcfg: WorkerConfig) -> Worker:
        """Admin API: validate against the config's models, add, persist, and tell Envoy."""
        if wcfg.id in self.workers:
            raise MembershipError(409, f"worker {wcfg.id!r} already exists")
        model = self.cfg.model(wcfg.model)
        if model is None:
            raise MembershipError(422, f"model {wcfg.model!r} is not one of the configured models "
                                       f"{[m.name for m in self.cfg.models]}")
        if model.engine != wcfg.engine:
            raise MembershipError(422, f"worker engine {wcfg.engine!r} but model {wcfg.model!r} is served by "
                                       f"{model.engine!r}")
        worker = self._add(wcfg, "api")
        self._save_state()
        self._sync_envoy()
        return worker

    async def remove_worker(self, worker_id: str, *, persist: bool = True) -> None:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise MembershipError(404, f"no worker {worker_id!r}")
        del self.workers[worker_id]
        tasks = self._probe_tasks.pop(worker_id, [])
        parity = self._parity_tasks.pop(worker_id, None)
        for task in tasks if parity is None else [*tasks, parity]:
            await cancel_quietly(task)
        for t in worker.targets:
            t.epoch = next(self._epochs)  # fences any callback still in flight for the old incarnation
            entry = self._sources.pop(t.id, None)
            if entry is not None:
                await cancel_quietly(entry[1])
            # One write section: extproc sees the target's blocks all present or all gone.
            t.ledger.clear(self.view)
        if persist:
            self._save_state()
            self._sync_envoy()
        self._meta_dirty = True
        self.publish_meta()
        log.info("worker %s removed", worker_id)

    def _free_slots(self, n: int) -> list[int]:
        used = {t.slot for w in self.workers.values() for t in w.targets}
        free = [s for s in range(self.view.max_workers) if s not in used][:n]
        if len(free) < n:
            raise MembershipError(507, f"no free target slot (ingest.max_workers={self.view.max_workers})")
        return free

    def _add(self, wcfg: WorkerConfig, source: str) -> Worker:
        model = self.cfg.model(wcfg.model)
        assert model is not None  # checked by config validation or add_worker
        worker = Worker(cfg=wcfg, address=wcfg.address(), source=source,
                        parity_policy=self.cfg.ingest.token_parity)
        if wcfg.kv_events is None:
            worker.events_usable, worker.events_reason = False, "no kv_events endpoint configured: routed by load"
        ranks: list[int | None] = [None] if wcfg.dp_size == 1 else list(range(wcfg.dp_size))
        for rank, slot in zip(ranks, self._free_slots(len(ranks)), strict=True):
            parity = ParityCheck(engine=wcfg.engine, page_size=model.engine_page_size(),
                                 hash_algo=model.hash_algo or ("sha256" if wcfg.engine == "vllm" else None),
                                 hash_seed=model.hash_seed)
            target = Target(worker=worker, rank=rank, slot=slot,
                            ledger=Ledger(slot=slot, engine=wcfg.engine, block_size=self.cfg.block_size,
                                          parity=parity),
                            parity=parity, sync=SourceSync(has_replay=wcfg.kv_replay is not None),
                            epoch=next(self._epochs))
            # A slot may have been used by a removed target: start from a clean bitset.
            self.view.clear_worker(slot)
            worker.targets.append(target)
            if worker.events_usable:
                src = EventSource(target, self.zmq, self.view, self._changed, on_events=self._events_arrived)
                self._sources[target.id] = (src, asyncio.get_running_loop().create_task(src.run(),
                                                                                         name=f"src-{target.id}"))
        self.workers[wcfg.id] = worker
        loop = asyncio.get_running_loop()
        self._probe_tasks[wcfg.id] = [loop.create_task(self._watch_health(worker), name=f"health-{wcfg.id}"),
                                      loop.create_task(self._poll_load(worker), name=f"load-{wcfg.id}")]
        self._parity_wakeup.set()
        self._meta_dirty = True
        log.info("worker %s added (%s, %s, %d target(s))", wcfg.id, wcfg.url, source, len(worker.targets))
        return worker

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

    def _events_arrived(self, target: Target) -> None:
        # Events mean the engine is working, whoever sent it the requests (another replica, direct traffic).
        self._wake(target.worker, time.monotonic())

    def _wake(self, worker: Worker, now: float) -> None:
        """Poll this worker at the active cadence from now on (for a while), starting with a reading now."""
        worker.active_until = max(worker.active_until, now + self._active_hold_s())
        if worker.poll_every > self.cfg.ingest.load_poll_interval_s:
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
            t.published_load = (t.load.running, t.load.waiting, t.load.at)
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

        Adaptive: every `load_poll_interval_s` while the worker is active (requests running or waiting at the
        last reading, KV events arriving, requests routed here in flight), every `idle_load_poll_interval_s`
        otherwise; a sign of work wakes the slow wait at once (_wake)."""
        assert self._session is not None
        icfg = self.cfg.ingest
        while True:
            fast, slow = icfg.load_poll_interval_s, icfg.idle_load_poll_interval_s
            worker.wake.clear()
            if worker.healthy:
                try:
                    await read_load(self._session, worker, timeout=max(fast * 5, 0.5))
                except Exception as exc:  # a worker's bad answer must not end its polling
                    log.debug("load read failed for %s: %s", worker.id, exc)
            now = time.monotonic()
            if any(t.load.at and (t.load.running > 0 or t.load.waiting > 0) for t in worker.targets):
                worker.active_until = max(worker.active_until, now + self._active_hold_s())
            every = fast if now < worker.active_until else slow
            if every != worker.poll_every:
                worker.poll_every = every
                self._meta_dirty = True
            self._check_worker(worker, now)
            if self._reading_news(worker, now):
                self._meta_dirty = True
            if every <= fast:
                await asyncio.sleep(every)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(worker.wake.wait(), every)

    @staticmethod
    def _reading_news(worker: Worker, now: float) -> bool:
        """Publish a reading whose values changed, or whose published predecessor is getting old (extproc
        ages readings itself, against max(2 s, 2 x the interval in force): republishing an unchanged one
        every max(1 s, interval) keeps it fresh there with margin, at a fraction of the polls)."""
        for t in worker.targets:
            running, waiting, at = t.published_load
            if t.load.at > at and ((t.load.running, t.load.waiting) != (running, waiting)
                                   or now - at >= max(1.0, worker.poll_every)):
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
            quiet_since = max(t.busy_since, t.last_event_at)
            entry = self._sources.get(t.id)
            if entry and t.busy_since and t.sync.state is SyncState.READY and now - quiet_since > limit:
                entry[0].perform(t.sync.silent(f"no event batch for {limit:.0f}s while the worker was busy"))
                t.last_event_at = now  # one resync per silent period

    def _check_publishers(self, w: Worker, now: float) -> None:
        """Name the workers that serve requests but publish no KV events (ingest.silence): reported in
        /cortex/workers, the metrics and the log, and kept out of exact-KV routing while silent."""
        # A decode-only worker publishes only if its engine keeps a prefix cache for the KV it receives
        # (SGLang's --disaggregation-decode-enable-radix-cache is off by default): its quiet proves nothing.
        if not w.events_usable or w.cfg.role == "decode":
            return
        for t in w.targets:
            # Counted, not timed: _check_silence above moves last_event_at without any batch arriving.
            received = t.batches + t.decode_errors + t.sync.duplicates
            if received != t.received_base:
                # A batch (live or replayed) arrived: whatever work came before is accounted for.
                t.received_base, t.batch_at = received, now
                t.work_at, t.activity_base = 0.0, t.activity if t.load.at else None
            elif t.load.at:
                if t.activity_base is None or t.activity < t.activity_base:
                    t.activity_base = t.activity  # first reading, or a restarted engine's counter
                if not t.work_at and (t.activity > t.activity_base or t.load.running > 0):
                    t.work_at = now
            status, reason = silence.verdict(silence.Observation(
                now=now, healthy=w.healthy, connected=t.link_up, link_since=t.link_since,
                last_batch_at=t.batch_at, work_at=t.work_at, bound_s=self.cfg.ingest.event_silence_s))
            if status == silence.SILENT and t.events_status != silence.SILENT:
                log.warning("worker %s (target %s) publishes no KV events: %s; routed by load only until "
                            "its events arrive", w.id, t.id, reason)
            elif status != silence.SILENT and t.events_status == silence.SILENT:
                log.info("worker %s (target %s): KV events %s again", w.id, t.id, status)
            if (status, reason) != (t.events_status, t.silence_reason):
                self._meta_dirty = status != t.events_status or self._meta_dirty
                t.events_status, t.silence_reason = status, reason

    def _check_tails(self, w: Worker) -> None:
        """The engine worked since the last poll (its counter moved, or requests ran or just finished): its
        batches may all have been lost, so no arrival would ever trigger a tail check. Ask replay."""
        for t in w.targets:
            entry = self._sources.get(t.id)
            if entry is None:
                continue
            busy = t.load.running > 0 or t.load.waiting > 0
            if t.activity != t.activity_checked or busy or t.was_busy:
                t.activity_checked = t.activity
                entry[0].check_tail()
            t.was_busy = busy

    async def _watch_health(self, worker: Worker) -> None:
        """One worker's health probes: the first at once (a new worker is not in good standing until it
        passed one), then every health_interval_s after the previous probe ended."""
        assert self._session is not None
        icfg = self.cfg.ingest
        while True:
            was_healthy = worker.healthy
            shown = (worker.healthy, worker.suspect, worker.bootstrap_port)
            try:
                await probe_health(self._session, worker, icfg.health_timeout_s, icfg.health_failures)
            except Exception:  # probe_health counts every expected failure itself; keep probing whatever else
                log.exception("health probe of %s failed unexpectedly", worker.id)
            if was_healthy and not worker.healthy and self.workers.get(worker.id) is worker:
                # A dead engine's cache is gone, or soon will be: prune what the ledger lists for it.
                log.warning("worker %s is down (%d failed probes): its ledger entries are pruned",
                            worker.id, worker.health_failures)
                for t in worker.targets:
                    t.ledger.clear(self.view)
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
                    self._parity_tasks[w.id] = asyncio.create_task(self._check_tokens(w), name=f"parity-{w.id}")
            pending = any(w.token_parity.status != tokenizer_parity.OK for w in self.workers.values())
            self._parity_wakeup.clear()
            with contextlib.suppress(TimeoutError):
                # A new worker wakes the loop at once: its exact-KV routing waits on this check.
                await asyncio.wait_for(self._parity_wakeup.wait(), 1.0 if pending else 5.0)

    async def _check_tokens(self, w: Worker) -> None:
        assert self._session is not None
        try:
            res: tuple[str, str] | Exception = await tokenizer_parity.check(
                self._session, w.cfg.url, w.cfg.engine, w.cfg.model, self._probes[w.cfg.model],
                self.cfg.ingest.health_timeout_s)
        except Exception as exc:  # counted as unanswered; checked again in 10 s
            res = exc
        tp = w.token_parity
        status, reason = res if isinstance(res, tuple) else (tokenizer_parity.UNKNOWN, repr(res))
        tp.checks += 1
        tp.checked_at = time.monotonic()
        if status != tp.status:
            level = logging.ERROR if status == tokenizer_parity.FAILED else logging.INFO
            log.log(level, "worker %s: tokenizer parity %s: %s", w.id, status, reason)
            self._meta_dirty = True
        if status == tokenizer_parity.FAILED and tp.status != tokenizer_parity.FAILED:
            tp.failures += 1
        tp.status, tp.reason = status, reason

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"workers": [{
            "id": w.id, "url": w.cfg.url, "model": w.cfg.model, "engine": w.cfg.engine, "source": w.source,
            "healthy": w.healthy, "health_failures": w.health_failures, "suspect": w.suspect,
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
