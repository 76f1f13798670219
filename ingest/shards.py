"""Event shards, ingest's side (`ingest.event_shards: N`): N child processes follow the targets' KV-event streams
(ingest/event_shard.py) and send back each write section's key changes, which ingest applies to the view it alone
writes. What grows with a fleet's traffic (receiving, decoding and sequencing the batches, the ledgers, the tail
checks and replays) then runs on N more cores; what grows with its size only (health and load probes, the target
list) stays here, bounded by ingest's own budgets. docs/ledger.md, "Event shards".

`RemoteSource` stands where an EventSource stands in-process (ingest/workers.py's Target reads one or the other):
the same attributes, filled from the shard's reports, and the same requests, sent to the shard. A shard that dies
takes nothing with it that ingest cannot rebuild: its targets' slots are cleared and hidden at once, and a new
process is assigned the same targets, whose engines replay what they hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq

from cortex import logs
from cortex.contract import GroupSlot, TierSlot
from cortex.die_with_parent import die_with_parent
from ingest.lag import VIEW_LAG
from ingest.ledger_publish import KeySink
from ingest.shard_pipe import Pipe
from ingest.shard_wire import ADD, CLEAR, ENCODER, REMOVE, TO_INGEST, Assign, Control, Drop, Report, SourceState, Spares
from ingest.sync import SyncState

log = logging.getLogger("cortex.ingest")

SPARES = 2
"""Free view slots each shard holds for its ledgers' other KV-cache specs and tiers, topped up as they are used."""
RESTART_BACKOFF_S = (0.2, 1.0, 5.0)
STALLED_S = 30.0
"""A shard reports every second at least (ingest/event_shard.py REFRESH_S); one silent this long is hung, and is
replaced like one that died. Generous: a shard replaying its engines' whole buffers at start applies each replay in
one go (~1 s per 10,000 batches here), and a shard killed for that would only start the same replays again."""
HELLO_S = 60.0
"""How long a new shard process may take to start and say hello (its imports, on a loaded machine)."""


class RemoteSync:
    """The sequence state a shard reported (ingest/sync.py's SourceSync, read-only)."""

    def __init__(self) -> None:
        self.state = SyncState.CONNECTING
        self.reason = "assigned to an event shard"
        self.last_applied: int | None = None
        self.gaps = self.replays = self.resyncs = self.restarts = self.duplicates = self.tail_recoveries = 0


class RemoteParity:
    """The hash parity check's state a shard reported (ingest/hash_parity.py's ParityCheck, read-only)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.status = "unknown"
        self.reason = "no chain start seen yet"
        self.checked = self.failures = 0

    @property
    def failed(self) -> bool:
        return self.status == "failed"


class RemoteLedger:
    """The ledger's figures a shard reported (ingest/ledger.py's Ledger, read-only), and its clear."""

    def __init__(self, source: RemoteSource, slot: int, block_size: int) -> None:
        self._source = source
        self.block_size = block_size
        self.blocks = self.blocks_stored = self.blocks_removed = self.blocks_restated = 0
        self.events_applied = self.events_inactive = self.layout_version = self.lookahead = 0
        self.unsupported = ""
        self.groups: tuple[GroupSlot, ...] = ()
        self.tiers: tuple[TierSlot, ...] = ()
        self.own_slots = [slot]
        self.lane_sizes: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.unknown_media: dict[str, int] = {}

    def layout(self) -> tuple[tuple[GroupSlot, ...], tuple[TierSlot, ...]]:
        return self.groups, self.tiers

    def slots(self) -> list[int]:
        return list(self.own_slots)

    def lanes(self) -> dict[str, int]:
        return dict(self.lane_sizes)

    def clear(self, sink: KeySink) -> None:
        """Forget what the target holds (its worker went down): cleared in the view now, and in the shard's ledger
        under a new generation, so no change the shard made before it learned of this lands after it."""
        for slot in self.own_slots:
            sink.clear_worker(slot)
        self._source.fence()
        self._source.send(Control(self._source.name, "clear", gen=self._source.gen))


class RemoteSource:
    """An EventSource that runs in an event shard (module docstring)."""

    def __init__(self, pool: ShardPool, assign: Assign, *, on_change: Callable[[], None],
                 on_events: Callable[[], None] | None) -> None:
        self.pool = pool
        self.name = assign.tid
        self.assign = assign
        self.on_change = on_change
        self.on_events = on_events
        self.shard: _Shard | None = None
        self.closed = False
        self.sync = RemoteSync()
        self.parity = RemoteParity(assign.page_size)
        self.ledger = RemoteLedger(self, assign.slot, assign.block_size)
        self.batches = self.decode_errors = self.tail_checks = self.tail_connections = self.received = 0
        self.lag_s = 0.0
        self.link_up = False
        self.link_since = time.monotonic()
        self.diagnosis: tuple[str, str] | None = None
        self.last_event_at = 0.0
        self.unknown_events: dict[str, int] = {}
        self.shown = False
        self._layout_told = 0

    @property
    def gen(self) -> int:
        return self.assign.gen

    def fence(self) -> None:
        """A new generation: changes made under the old one are not applied any more."""
        self.assign.gen = self.pool.next_gen()

    def send(self, msg: Assign | Drop | Control) -> None:
        if self.shard is not None and not self.closed:
            self.shard.send(msg)

    # -- what ingest asks (EventSource's interface)

    async def run(self) -> None:
        self.pool.assign(self)
        try:
            await asyncio.Event().wait()
        finally:
            self.pool.drop(self)

    def close(self) -> None:
        self.closed = True

    def silent(self, reason: str, now: float) -> None:
        self.last_event_at = now  # as in-process: one resync per silent period, not one per load reading
        self.send(Control(self.name, "silent", reason=reason))

    def check_tail(self) -> None:
        self.send(Control(self.name, "check_tail"))

    def check_link(self, now: float) -> None:
        """The shard diagnoses its unreachable endpoints itself (ingest/event_shard.py REFRESH_S)."""

    def layout_published(self, version: int) -> None:
        # Called at every write of the target list: only a new layout is news to the shard.
        if version > self._layout_told and version == self.ledger.layout_version:
            self._layout_told = version
            self.send(Control(self.name, "layout_published", version=version))

    # -- what the shard reports

    def _news(self) -> tuple[object, ...]:
        """What ingest's target list shows of a source: a report that moves it is a change (`on_change`)."""
        return (self.sync.state, self.sync.reason, self.parity.status, self.ledger.unsupported,
                self.ledger.layout_version, self.shown, self.diagnosis, self.link_up)

    def update(self, st: SourceState) -> None:
        s, p, led = self.sync, self.parity, self.ledger
        before, received = self._news(), self.received
        s.state, s.reason, s.last_applied = SyncState(st.state), st.reason, st.last_applied
        s.gaps, s.replays, s.resyncs, s.restarts = st.gaps, st.replays, st.resyncs, st.restarts
        s.duplicates, s.tail_recoveries = st.duplicates, st.tail_recoveries
        p.status, p.reason, p.checked, p.failures = st.parity_status, st.parity_reason, st.parity_checked, \
            st.parity_failures
        led.blocks, led.blocks_stored, led.blocks_removed = st.blocks, st.blocks_stored, st.blocks_removed
        led.blocks_restated, led.events_applied, led.events_inactive = st.blocks_restated, st.events_applied, \
            st.events_inactive
        led.unsupported, led.layout_version, led.lookahead = st.unsupported, st.layout_version, st.lookahead
        led.groups, led.tiers, led.own_slots = tuple(st.groups), tuple(st.tiers), st.slots
        led.lane_sizes, led.dropped, led.unknown_media = st.lanes, st.dropped, st.unknown_media
        self.batches, self.decode_errors, self.tail_checks = st.batches, st.decode_errors, st.tail_checks
        self.tail_connections, self.lag_s, self.received = st.tail_connections, st.lag_s, st.received
        self.link_up, self.link_since, self.diagnosis = st.link_up, st.link_since, st.diagnosis
        self.last_event_at = max(self.last_event_at, st.last_event_at)
        self.unknown_events, self.shown = st.unknown_events, st.shown
        if self._news() != before:
            self.on_change()
        if self.received != received and self.on_events is not None:
            self.on_events()

    def lost(self, reason: str) -> None:
        """Its shard died: nothing it listed is known any more (the caller clears the view's slots)."""
        self.fence()
        self.sync.state, self.sync.reason = SyncState.STALE, reason
        self.shown = False
        self.ledger.own_slots = [self.assign.slot]
        self.ledger.groups, self.ledger.tiers = (), ()
        self._layout_told = 0
        self.on_change()


class _Shard:
    """One shard process's incarnations and the targets assigned to it."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.sources: dict[str, RemoteSource] = {}
        self.spares: set[int] = set()
        self.out: Callable[[bytes, int], None] | None = None
        """Sends one frame to the current incarnation (None: none running)."""
        self.connected = False
        self.heard = 0.0
        """When the current incarnation last sent something (monotonic)."""
        self.pid: int | None = None
        self.restarts = 0

    def send(self, msg: Assign | Drop | Control | Spares) -> None:
        if self.out is None or not self.connected:
            return  # an incarnation not yet connected gets every assignment when it says hello
        with contextlib.suppress(zmq.Again):  # its peer is gone: the restart assigns everything again
            self.out(ENCODER.encode(msg), zmq.NOBLOCK)


class ShardPool:
    """The event shard processes of one ingest, and the view changes they send."""

    def __init__(self, count: int, view: Any, sink: KeySink, spare_slot: Callable[[], int | None],
                 on_change: Callable[[], None]) -> None:
        self.count = count
        self.view = view
        """The ViewWriter (a lost shard's slots are cleared in one write section)."""
        self.sink = sink
        self.spare_slot = spare_slot
        self.on_change = on_change
        self.shards = [_Shard(i) for i in range(count)]
        self._gen = 0
        self._tasks: list[asyncio.Task[None]] = []

    def next_gen(self) -> int:
        self._gen += 1
        return self._gen

    def reserved(self) -> set[int]:
        """Slots granted to shards and not yet used by a ledger (not free for anyone else)."""
        return {s for shard in self.shards for s in shard.spares}

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._keep(shard), name=f"event-shard-{shard.index}")
                       for shard in self.shards]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def source(self, assign: Assign, **kw: Any) -> RemoteSource:
        return RemoteSource(self, assign, **kw)

    def assign(self, src: RemoteSource) -> None:
        shard = min(self.shards, key=lambda s: len(s.sources))
        shard.sources[src.name] = src
        src.shard = shard
        shard.send(src.assign)

    def drop(self, src: RemoteSource) -> None:
        shard = src.shard
        if shard is not None and shard.sources.get(src.name) is src:
            del shard.sources[src.name]
            shard.send(Drop(src.name))
        src.shard = None

    # -- one shard's life

    async def _keep(self, shard: _Shard) -> None:
        """Run the shard's process, and another when it exits: each incarnation is assigned every target anew."""
        while True:
            started = time.monotonic()
            try:
                await self._incarnation(shard)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event shard %d failed", shard.index)
            self._lose(shard)
            shard.restarts += 1
            # A shard that lived a while restarts at once; one that keeps dying is given time.
            pause = 0.0 if time.monotonic() - started > 30 else \
                RESTART_BACKOFF_S[min(shard.restarts, len(RESTART_BACKOFF_S)) - 1]
            await asyncio.sleep(pause)

    async def _incarnation(self, shard: _Shard) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        pipe = Pipe(sock, lambda frame: self._frame(shard, frame))
        shard.out, shard.connected, shard.spares, shard.heard = pipe.send, False, set(), time.monotonic()
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ingest.event_shard", "--endpoint", f"tcp://127.0.0.1:{port}",
                "--index", str(shard.index), *logs.child_args(),
                env={**os.environ, logs.PROCESS_ENV: f"ingest-shard-{shard.index}"}, preexec_fn=die_with_parent)
            shard.pid = proc.pid
            log.info("event shard %d started (pid %d)", shard.index, proc.pid)
            while True:
                limit = STALLED_S if shard.connected else HELLO_S
                left = shard.heard + limit - time.monotonic()
                if left <= 0 and (shard.sources or not shard.connected):
                    log.error("event shard %d sent nothing for %.0f s: killed; its targets are hidden and "
                              "assigned again", shard.index, limit)
                    return
                with contextlib.suppress(TimeoutError):
                    # A second at most: the limit changes when the hello arrives.
                    async with asyncio.timeout(min(max(left, 0.1), 1.0)):
                        await proc.wait()
                    log.error("event shard %d exited (code %s): its targets are hidden and assigned again",
                              shard.index, proc.returncode)
                    return
        finally:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(asyncio.CancelledError):
                    await proc.wait()
            shard.out, shard.connected, shard.pid = None, False, None
            pipe.close()

    def _lose(self, shard: _Shard) -> None:
        """The shard's process is gone: what its targets listed is unknown from now on."""
        with self.view.batch():
            for src in shard.sources.values():
                for slot in src.ledger.own_slots:
                    self.sink.clear_worker(slot)
                src.lost("its event shard is restarting")
        shard.spares = set()

    def _frame(self, shard: _Shard, frame: bytes) -> None:
        shard.heard = time.monotonic()
        self._received(shard, TO_INGEST.decode(frame))

    def _received(self, shard: _Shard, report: Report) -> None:
        if not shard.connected:  # the incarnation's hello: it follows nothing yet
            shard.connected = True
            for src in shard.sources.values():
                src.fence()
                shard.send(src.assign)
            self._top_up(shard)
        # Each change is a write section of its own, as in-process (removals before additions within a ledger's
        # section, so a reader between two sees a subset): a report holding a whole replay is not one long section
        # that extproc's lookups would wait behind.
        sink = self.sink
        for op in report.ops:
            owner = shard.sources.get(op.tid)
            if owner is None or owner.gen != op.gen:
                continue  # an older generation's change (cleared, removed or reassigned since)
            if op.kind == ADD:
                sink.add(op.slot, op.keys)
            elif op.kind == REMOVE:
                sink.remove(op.slot, op.keys)
            elif op.kind == CLEAR:
                sink.clear_worker(op.slot)
        now = time.time()
        for stamp in report.stamps:
            VIEW_LAG.observe(max(0.0, now - stamp))
        used = False
        for st in report.states:
            reported = shard.sources.get(st.tid)
            if reported is None or reported.gen != st.gen:
                continue
            reported.update(st)
            if shard.spares.intersection(st.slots):
                shard.spares.difference_update(st.slots)
                used = True
        if used:
            self._top_up(shard)

    def _top_up(self, shard: _Shard) -> None:
        new: list[int] = []
        while len(shard.spares) < SPARES:
            slot = self.spare_slot()
            if slot is None:
                break
            shard.spares.add(slot)
            new.append(slot)
        if new:
            shard.send(Spares(new))

    def status(self) -> list[dict[str, Any]]:
        return [{"index": s.index, "pid": s.pid, "targets": len(s.sources), "restarts": s.restarts}
                for s in self.shards]
