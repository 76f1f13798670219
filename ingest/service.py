"""The ingest process: runs the workers' lifecycle, one event source per target, probes, and the shared view.

Everything runs on one asyncio loop, so the ledger has a single writer and needs no locks. The view
(cortex.ledger_view) is the only thing other processes see: key membership per target slot plus the meta
document (cortex.contract: each target's state and load), stamped with a heartbeat so readers notice if
ingest dies.

Who does what: ingest/membership.py decides which workers run (config, admin API, persistence, Envoy's
pools); ingest/probes.py reads health, load and tokenizer parity and ingest/workers.py applies the readings;
ingest/source.py follows one target's event stream into its ledger. This module wires the process: what the
Ingest owns, its start and stop, the config loop, adding and removing workers, and the heartbeat/publication
loop. Two parts of the Ingest live beside it: ingest/probe_loops.py (per worker a health task and a load task,
one tokenizer parity loop) and ingest/discovery.py (one watch per Kubernetes pool, ingest/k8s_discovery.py, and
the re-resolution of worker hostnames).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from cortex import breaker_status, engines, gc_pauses
from cortex.config import UNRESOLVED, CortexConfig, WorkerConfig
from cortex.config_watch import ConfigWatcher
from cortex.contract import ClusterMeta, encode_meta, target_id
from cortex.inflight import BacklogBoard, InflightBoard
from cortex.ledger_view import ViewWriter
from cortex.model_bundle import BundleCache
from cortex.peering import board_rows
from cortex.upstream_tls import WorkerTls, verify_name
from ingest import membership, silence, tokenizer_parity
from ingest.discovery import Discovery
from ingest.loop_cpu import timed
from ingest.membership import MembershipError
from ingest.peers import PeerLink
from ingest.probe_loops import ProbeLoops
from ingest.probes import LoadByRank
from ingest.regret import Regret
from ingest.shard_wire import Assign
from ingest.shards import RemoteSource, ShardPool
from ingest.source import EventSource, cancel_quietly, follow, rank_endpoint, streams_context
from ingest.subscription import subscription
from ingest.workers import Target, Worker

log = logging.getLogger("cortex.ingest")

PUBLISH_SPACING_S = 0.1
"""Least time between two writes of the target list (extproc re-reads it on each)."""


class Ingest(ProbeLoops, Discovery):
    """The ingest process's state and wiring; its probe loops and its discovery are parts of it (module
    docstring), each declaring what of this state it reads."""

    def __init__(self, cfg: CortexConfig, config_path: Path | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self._bundles = BundleCache()
        """The models' bundles, kept so a config reload loads only the tokenizers whose files changed."""
        self._config = ConfigWatcher(config_path, lambda c: (c, self._load_probes(c, self._bundles)), self._bundles)
        self.view = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers,
                               capacity=cfg.ingest.view_capacity)
        self.regret = Regret(self.view, cfg.block_size)
        """The ledgers' key sink: the view's writer, counting the evictions that had to be computed again."""
        self.zmq = streams_context()
        self.workers: dict[str, Worker] = {}
        self._sources: dict[str, asyncio.Task[None]] = {}
        """The running event sources' tasks, per target id (a worker without kv_events runs none)."""
        # Each worker's load poll and health probe run on their own, so a worker that hangs (up to a
        # timeout per request) slows only its own readings, never the others' (issue 11).
        self._probe_tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._parity_tasks: dict[str, asyncio.Task[None]] = {}
        self._background: list[asyncio.Task[None]] = []
        self.frozen_objects = 0
        """Objects kept out of the collector's walk (cortex/gc_pauses.py: settled after start-up and each reload)."""
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
        self._probes = self._load_probes(cfg, self._bundles)
        # Read-only: where this replica's extproc processes have requests in flight, so a worker this replica
        # routes to is polled at the active cadence from the first request on.
        self._board = InflightBoard(cfg.runtime_path() / "inflight", None, board_rows(cfg), cfg.ingest.max_workers)
        # Read-only: when the work this replica last sent each worker is predicted done; a worker sent requests
        # lately has its load read at the routed cadence (extproc fills in its own share between readings).
        self._backlog = BacklogBoard(cfg.runtime_path() / "backlog", None, board_rows(cfg), cfg.ingest.max_workers)
        self._peer_link: PeerLink | None = None
        self._outbox: dict[str, tuple[float, LoadByRank]] = {}
        self._membership = asyncio.Lock()
        """Held by the changes that await (discovery, re-resolution), so two never interleave."""
        self._pool_tasks: list[asyncio.Task[None]] = []
        self._discovered: dict[int, dict[str, WorkerConfig]] = {}
        """Per discovery.kubernetes pool: the workers it added (their configs as added)."""
        self.shards = None if cfg.ingest.event_shards == 0 else ShardPool(
            cfg.ingest.event_shards, self.view, self.regret, self._spare_slot, self._changed)
        """The event shards following the targets' streams (ingest/shards.py); None: followed here."""

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        if self.shards is not None:
            self.shards.start()
        for wcfg, source in membership.restore(self.cfg, self.state_file):
            self._add(wcfg, source)
        self._sync_envoy()
        self.publish_meta()
        self._background = [asyncio.create_task(timed("heartbeat", self._heartbeat_loop())),
                            asyncio.create_task(timed("parity", self._token_parity_loop())),
                            asyncio.create_task(timed("config", self._config_loop())),
                            asyncio.create_task(timed("config", self._resolve_loop()))]
        if self.cfg.peers.enabled:
            link = self._peer_link = PeerLink(self.cfg, self.zmq, lambda: {t.id: t.slot for w in self.workers.values()
                                                                           for t in w.targets}, readings=self)
            self._background.append(asyncio.create_task(timed("peers", link.run()), name="peers"))
        self._start_discovery()

    async def stop(self) -> None:
        for task in [*self._background, *self._pool_tasks, *self._sources.values(),
                     *(t for ts in self._probe_tasks.values() for t in ts), *self._parity_tasks.values()]:
            await cancel_quietly(task)
        if self.shards is not None:
            await self.shards.stop()
        if self._session is not None:
            await self._session.close()
        self.view.close()
        self.zmq.destroy(linger=0)  # its own context (ingest/source.py streams_context), not the process's shared one

    @staticmethod
    def _load_probes(cfg: CortexConfig, bundles: BundleCache) -> dict[str, list[Any]]:
        if cfg.ingest.token_parity == "off":
            return {}
        loaded = bundles.load_all(cfg.bundle_sources())
        return {m.name: tokenizer_parity.expected(loaded[m.name], engines.adapter(m.engine).tool_style)
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
        if cfg.ingest.event_shards != self.cfg.ingest.event_shards:
            log.warning("ingest.event_shards changed: it takes effect when the gateway restarts")
            cfg = cfg.model_copy(update={"ingest": cfg.ingest.model_copy(
                update={"event_shards": self.cfg.ingest.event_shards})})
        if cfg.fails_closed() != self.cfg.fails_closed():
            # Envoy's bootstrap holds it (cortex/envoy_config.py): an edit that adds the first tenant must not
            # look as if keys and limits now held while extproc is down.
            log.warning("extproc.failure_mode: %s", (
                "requests no extproc process answers are refused from the gateway's next restart; until then Envoy "
                "serves them without Cortex (no key check, no tenant limit)" if cfg.fails_closed() else
                "requests no extproc process answers are served without Cortex from the gateway's next restart; "
                "until then Envoy refuses them"))
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
        self.frozen_objects = gc_pauses.settle()
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
        if self.shards is not None:
            used.update(self.shards.reserved())  # given to a shard for its ledgers, not yet used
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
        hash_algo = model.hash_algo or engines.adapter(wcfg.engine).default_hash_algo
        for rank, slot in zip(ranks, self._free_slots(len(ranks)), strict=True):
            tid = target_id(wcfg.id, rank)
            endpoint, replay_endpoint = rank_endpoint(wcfg.kv_events, rank), rank_endpoint(wcfg.kv_replay, rank)
            on_events = partial(self._events_arrived, worker)
            assign = Assign(tid=tid, gen=0 if self.shards is None else self.shards.next_gen(), slot=slot,
                            engine=wcfg.engine, block_size=self.cfg.block_size, page_size=model.engine_page_size(),
                            hash_algo=hash_algo, hash_seed=model.hash_seed, endpoint=endpoint,
                            replay_endpoint=replay_endpoint, topic=wcfg.kv_topic)
            events: EventSource | RemoteSource = (
                follow(assign, self.zmq, self.regret, alloc=self._spare_slot, on_change=self._changed,
                       on_events=on_events) if self.shards is None
                else self.shards.source(assign, on_change=self._changed, on_events=on_events))
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

    # -- publication -------------------------------------------------------------------------------------

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
        } for w in self.workers.values()], "pid": os.getpid(),
            "event_shards": [] if self.shards is None else self.shards.status()}


def _worker_events(w: Worker) -> str:
    """The worker's KV-event status: the worst of its targets' (silent > waiting > flowing), or off."""
    if not w.events_usable:
        return silence.OFF
    statuses = {t.events_status for t in w.targets}
    return next((s for s in (silence.SILENT, silence.WAITING) if s in statuses), silence.FLOWING)
