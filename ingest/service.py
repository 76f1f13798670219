"""The ingest process: one ZMQ SUB per worker, the ledger, probes, and the shared view extproc reads.

Everything runs on one asyncio loop, so the ledger has a single writer and needs no locks. The view
(cortex.view) is the only thing other processes see: key membership per worker slot plus a small JSON
document with each worker's state and load, stamped with a heartbeat so readers notice if ingest dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
import zmq
import zmq.asyncio

from cortex.config import CortexConfig, WorkerConfig
from cortex.view import ViewWriter
from ingest.events import DecodeError, decode_batch
from ingest.ledger import WorkerLedger
from ingest.sequence import SeqVerdict, classify
from ingest.workers import SyncState, Worker, probe_health, read_load

log = logging.getLogger("cortex.ingest")


class Ingest:
    def __init__(self, cfg: CortexConfig) -> None:
        self.cfg = cfg
        self.started = time.monotonic()
        self.view = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers,
                               capacity=cfg.ingest.view_capacity)
        self.zmq = zmq.asyncio.Context.instance()
        self.workers: dict[str, Worker] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._background: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self.batches_applied = 0
        self.events_applied = 0
        self.last_apply_lag_s = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        for wcfg in self.cfg.workers:
            self.add_worker(wcfg)
        self.publish_meta()
        self._background = [asyncio.create_task(self._heartbeat_loop()),
                            asyncio.create_task(self._load_loop()),
                            asyncio.create_task(self._health_loop())]

    async def stop(self) -> None:
        for task in [*self._background, *self._tasks.values()]:
            task.cancel()
        for task in [*self._background, *self._tasks.values()]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()
        self.view.close()

    def _free_slot(self) -> int:
        used = {w.slot for w in self.workers.values()}
        for slot in range(self.view.max_workers):
            if slot not in used:
                return slot
        raise RuntimeError(f"no free worker slot (ingest.max_workers={self.view.max_workers})")

    def add_worker(self, wcfg: WorkerConfig) -> Worker:
        if wcfg.id in self.workers:
            raise ValueError(f"worker {wcfg.id!r} already exists")
        slot = self._free_slot()
        worker = Worker(cfg=wcfg, slot=slot, address=wcfg.address(),
                        ledger=WorkerLedger(slot=slot, engine=wcfg.engine, block_size=self.cfg.block_size))
        # A slot may have been used by a removed worker: start from a clean bitset.
        self.view.clear_worker(slot)
        if wcfg.kv_events is None:
            worker.state, worker.reason = SyncState.NO_EVENTS, "no kv_events endpoint configured"
        elif wcfg.block_size != self.cfg.block_size:
            worker.state = SyncState.UNSUPPORTED
            worker.reason = (f"engine block size {wcfg.block_size} != Cortex block_size {self.cfg.block_size}; "
                             "routed by load")
        else:
            self._tasks[wcfg.id] = asyncio.create_task(self._subscribe(worker), name=f"sub-{wcfg.id}")
        self.workers[wcfg.id] = worker
        log.info("worker %s added (slot %d, %s, %s)", wcfg.id, slot, wcfg.url, worker.state.value)
        return worker

    # -- event stream ------------------------------------------------------------------------------------

    async def _subscribe(self, worker: Worker) -> None:
        sock = self.zmq.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt_string(zmq.SUBSCRIBE, worker.cfg.kv_topic)
        assert worker.cfg.kv_events is not None
        sock.connect(worker.cfg.kv_events)
        # An empty ledger is a (trivially correct) subset of the GPU's contents, so the worker is usable at
        # once; batches published before the subscription joined are simply not claimed.
        worker.state, worker.reason = SyncState.READY, "subscribed"
        try:
            while True:
                frames = await sock.recv_multipart()
                self._on_message(worker, frames)
        finally:
            sock.close(0)

    def _on_message(self, worker: Worker, frames: list[bytes]) -> None:
        now = time.monotonic()
        worker.last_event_at = now
        if len(frames) != 3 or len(frames[1]) != 8:
            worker.decode_errors += 1
            return
        seq = int.from_bytes(frames[1], "big")
        verdict = classify(worker.last_seq, seq)
        if verdict is SeqVerdict.DUPLICATE:
            worker.duplicates += 1
            return
        if verdict in (SeqVerdict.GAP, SeqVerdict.RESTART):
            # Lost batches may have removed blocks we still list: forget the worker's ledger rather than
            # claim hits it may not have. (Replay-based recovery is the subject of the ledger issue.)
            if verdict is SeqVerdict.GAP:
                worker.gaps += 1
                worker.reason = f"gap before seq {seq}: ledger cleared, rebuilding from live events"
            else:
                worker.restarts += 1
                worker.reason = "publisher restarted: ledger cleared"
            log.warning("worker %s: %s (last seq %s, got %d)", worker.id, verdict.value, worker.last_seq, seq)
            worker.ledger.clear(self.view)
        worker.last_seq = seq
        try:
            batch = decode_batch(frames[2])
        except DecodeError as exc:
            worker.decode_errors += 1
            log.warning("worker %s: undecodable batch %d: %s", worker.id, seq, exc)
            return
        worker.decode_errors += len(batch.errors)
        # Each view call is its own short write section: every state a reader can see is one the worker
        # really passed through, and a storm of events never locks readers out for a whole batch.
        worker.ledger.apply(batch.events, self.view)
        worker.batches += 1
        self.batches_applied += 1
        self.events_applied += len(batch.events)
        if batch.ts:
            self.last_apply_lag_s = max(0.0, time.time() - batch.ts)

    # -- probes and publication --------------------------------------------------------------------------

    def publish_meta(self) -> None:
        now = time.monotonic()
        self.view.set_meta({
            "block_size": self.cfg.block_size,
            "workers": [w.routable_meta(now) for w in self.workers.values()],
        })

    async def _heartbeat_loop(self) -> None:
        while True:
            self.view.heartbeat()
            await asyncio.sleep(self.cfg.ingest.heartbeat_interval_s)

    async def _load_loop(self) -> None:
        assert self._session is not None
        interval = self.cfg.ingest.load_poll_interval_s
        while True:
            workers = [w for w in self.workers.values() if w.healthy]
            results = await asyncio.gather(
                *(read_load(self._session, w, timeout=max(interval * 5, 0.5)) for w in workers),
                return_exceptions=True)
            for w, res in zip(workers, results, strict=True):
                if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
                    log.debug("load read failed for %s: %s", w.id, res)
            self.publish_meta()
            await asyncio.sleep(interval)

    async def _health_loop(self) -> None:
        assert self._session is not None
        icfg = self.cfg.ingest
        while True:
            await asyncio.gather(*(probe_health(self._session, w, icfg.health_timeout_s, icfg.health_failures)
                                   for w in list(self.workers.values())))
            await asyncio.sleep(icfg.health_interval_s)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"workers": [w.status(now) for w in self.workers.values()]}
