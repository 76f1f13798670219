"""Peering: this replica's own work out to its peers, theirs into the boards' peer rows (cortex/peering.py).

One ZeroMQ PUB socket publishes this replica's report (its extproc processes' backlog and in-flight rows, by
target id) every `peers.interval_s` when it changed and every `peers.heartbeat_s` regardless; one SUB socket is
connected to every address the `peers.connect` entries resolve to, re-resolved every `peers.resolve_interval_s`
(a headless Service's name lists every gateway pod, this one included: its own reports are ignored by id). Each
report received is written into the peer's own rows of the backlog and in-flight boards, which extproc sums with
its processes' rows; a peer silent for `peers.stale_after_s` has its rows cleared. The load readings this replica
took ride in its next report, and those a peer's report carries are handed to ingest (`peers.share_load_readings`,
cortex/peering.py). A bad message is counted and dropped; nothing here can stop ingest's other work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import zmq
import zmq.asyncio
from prometheus_client import Counter, Gauge

from cortex import peering
from cortex.config import CortexConfig
from cortex.inflight import BacklogBoard, InflightBoard
from ingest.loop_cpu import timed

log = logging.getLogger("cortex.ingest.peers")

REPORTS = Counter("cortex_peer_reports_total", "Peer reports by outcome: sent, applied, ignored (own, old or no "
                  "row free), bad (not a report of this version)", ["outcome"])
REFRESH_TICKS = 50
"""Ticks between two checks that the replica's extproc processes still write the rows this link read (1 s at the
default interval)."""
PEERS = Gauge("cortex_peers", "Peer replicas heard from within peers.stale_after_s", multiprocess_mode="livemax")


class Readings(Protocol):
    """Ingest's side of shared load readings."""

    def take_readings(self, now: float) -> tuple[peering.Reading, ...]:
        """The readings this replica took since the last call, to send (then forgotten)."""
        ...

    def apply_readings(self, peer: str, readings: tuple[peering.Reading, ...], now: float) -> None:
        """A peer's readings, received at `now`."""
        ...


def resolve(entry: str) -> set[str]:
    """Every tcp:// address a host:port entry names now (empty when it does not resolve yet)."""
    host, _, port = entry.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return set()
    return {f"tcp://[{i[4][0]}]:{port}" if ":" in str(i[4][0]) else f"tcp://{i[4][0]}:{port}" for i in infos}


class PeerLink:
    def __init__(self, cfg: CortexConfig, ctx: zmq.asyncio.Context, slots: Callable[[], Mapping[str, int]],
                 readings: Readings | None = None) -> None:
        pcfg = cfg.peers
        assert pcfg.host is not None
        self.cfg = pcfg
        self.ctx = ctx
        self.slots = slots
        self.readings = readings if pcfg.share_load_readings else None
        self.own_rows = cfg.extproc.process_count()
        self.width = cfg.ingest.max_workers
        self.replica = pcfg.replica_id or f"{socket.gethostname()}:{pcfg.port}"
        self.table = peering.PeerTable(self.replica, pcfg.max_peers, pcfg.stale_after_s)
        rt = cfg.runtime_path()
        total = peering.board_rows(cfg)
        # Readers of the replica's own processes' rows, and one writer per peer row.
        self.inflight = InflightBoard(rt / "inflight", None, total, self.width)
        self.backlog = BacklogBoard(rt / "backlog", None, total, self.width)
        self.peer_inflight = [InflightBoard(rt / "inflight", self.own_rows + k, total, self.width)
                              for k in range(pcfg.max_peers)]
        self.peer_backlog = [BacklogBoard(rt / "backlog", self.own_rows + k, total, self.width)
                             for k in range(pcfg.max_peers)]
        self.connected: set[str] = set()
        self.seq = 0

    async def run(self) -> None:
        pub = self.ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100)
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 1000)
        pub.bind(f"tcp://{self.cfg.host}:{self.cfg.port}")
        try:
            # gather runs each in a task of its own: each is charged to the peers loop (ingest/loop_cpu.py).
            await asyncio.gather(timed("peers", self._publish(pub)), timed("peers", self._receive(sub)),
                                 timed("peers", self._resolve(sub)))
        finally:
            pub.close(0)
            sub.close(0)

    def live_peers(self) -> list[str]:
        """The peers heard from within `stale_after_s`."""
        return list(self.table.owner)

    def report(self, refresh: bool = False, now: float | None = None) -> peering.Report:
        if refresh:  # an extproc process restarted: follow its new rows (a stat per row: not every tick)
            self.inflight.refresh()
            self.backlog.refresh()
        readings = self.readings.take_readings(time.monotonic() if now is None else now) if self.readings else ()
        return peering.own_report(self.replica, self.seq, self.slots(), self.backlog.backlog_ms(rows=self.own_rows),
                                  self.inflight.totals(rows=self.own_rows), readings)

    async def _publish(self, pub: zmq.asyncio.Socket) -> None:
        last: dict[str, tuple[float, int]] | None = None
        sent_at = 0.0
        tick = 0
        while True:
            now = time.monotonic()
            tick += 1
            try:
                rep = self.report(refresh=tick % REFRESH_TICKS == 0, now=now)
                # Backlog drains with the clock: "changed" is a change of in-flight counts or of what is queued
                # beyond what the clock alone explains, so an idle replica sends heartbeats (and readings) only.
                changed = bool(rep.readings) or last is None or {t: n for t, (_, n) in rep.targets.items()} != {
                    t: n for t, (_, n) in last.items()} or _grew(last, rep.targets, (now - sent_at) * 1000.0)
                if changed or now - sent_at >= self.cfg.heartbeat_s:
                    await pub.send(peering.encode(rep), zmq.NOBLOCK)
                    REPORTS.labels("sent").inc()
                    self.seq += 1
                    last, sent_at = rep.targets, now
                for row in self.table.expire(now):
                    self.peer_inflight[row].own[:] = 0
                    self.peer_backlog[row].own[:] = 0
                PEERS.set(len(self.table.owner))
            except zmq.Again:
                pass
            except Exception:  # an extra signal only: never let it stop
                log.warning("peer report not sent", exc_info=True)
            await asyncio.sleep(self.cfg.interval_s)

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            data = await sub.recv()
            rep = peering.decode(data)
            if rep is None:
                REPORTS.labels("bad").inc()
                continue
            now = time.monotonic()
            row = self.table.receive(rep, now)
            if row is None:
                REPORTS.labels("ignored").inc()
                continue
            done, inflight = peering.rows_of(rep, self.slots(), self.width, now)
            self.peer_backlog[row].own[:] = done
            self.peer_inflight[row].own[:] = inflight
            REPORTS.labels("applied").inc()
            if rep.readings and self.readings is not None:
                try:
                    self.readings.apply_readings(rep.replica, rep.readings, now)
                except Exception:  # an extra signal only: the worker is read by this replica instead
                    log.warning("peer load readings not applied", exc_info=True)

    async def _resolve(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            want: set[str] = set()
            for entry in self.cfg.connect:
                want |= await asyncio.to_thread(resolve, entry)
            for addr in want - self.connected:
                sub.connect(addr)
            for addr in self.connected - want:
                with contextlib.suppress(zmq.ZMQError):
                    sub.disconnect(addr)
            self.connected = want
            await asyncio.sleep(self.cfg.resolve_interval_s)


def _grew(last: Mapping[str, tuple[float, int]], now: Mapping[str, tuple[float, int]], elapsed_ms: float) -> bool:
    """Work was queued since the last report: some target's backlog is above what was left then minus the time
    passed (1 ms of slack for rounding)."""
    return any(ms > max(last.get(t, (0.0, 0))[0] - elapsed_ms, 0.0) + 1.0 for t, (ms, _) in now.items())

