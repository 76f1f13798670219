"""Workers found at run time: the Kubernetes pools' workers (ingest/k8s_discovery.py watches each pool) and
workers named by a hostname, resolved again as pods move.

Both change the fleet through the same membership path as the admin API (Ingest.remove_worker and Ingest._add),
one change at a time under the Ingest's membership lock, so a removed worker's ledger is dropped as for an admin
removal and an unchanged one is left alone.

Part of the Ingest (ingest/service.py), which owns the state this part reads and starts its tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from functools import partial
from typing import TYPE_CHECKING

import aiohttp

from cortex.config import CortexConfig, WorkerConfig
from ingest import k8s_discovery, membership
from ingest.loop_cpu import timed
from ingest.membership import MembershipError
from ingest.source import cancel_quietly
from ingest.workers import Worker

log = logging.getLogger("cortex.ingest")


class Discovery:
    """The Ingest's discovery of workers at run time (module docstring)."""

    # Set up by Ingest.__init__ (ingest/service.py); cfg is replaced at each config reload.
    cfg: CortexConfig
    workers: dict[str, Worker]
    _session: aiohttp.ClientSession | None
    _membership: asyncio.Lock
    _pool_tasks: list[asyncio.Task[None]]
    _discovered: dict[int, dict[str, WorkerConfig]]
    _meta_dirty: bool

    if TYPE_CHECKING:  # the Ingest's membership changes (ingest/service.py)
        async def remove_worker(self, worker_id: str, *, persist: bool = True) -> None: ...
        def _add(self, wcfg: WorkerConfig, source: str, address: str | None = None) -> Worker: ...
        def _sync_envoy(self) -> None: ...

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
