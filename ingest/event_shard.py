"""An event shard's process: the KV-event streams of the targets ingest assigns it, each one an EventSource as
ingest runs in-process (ingest/source.py), whose key changes and state go back to ingest (ingest/shard_wire.py)
instead of into the view. Started by ingest (ingest/shards.py) as `python -m ingest.event_shard`; it exits when
ingest does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from cortex import gc_pauses, logs
from ingest.shard_pipe import Pipe
from ingest.shard_wire import (
    ADD,
    CLEAR,
    ENCODER,
    REMOVE,
    TO_SHARD,
    Assign,
    Control,
    Drop,
    KeyOp,
    Report,
    SourceState,
    Spares,
)
from ingest.source import EventSource, cancel_quietly, follow, streams_context

log = logging.getLogger("cortex.ingest")

REFRESH_S = 1.0
"""How often the sources whose counters moved without a change of state are reported (tail checks, duplicates),
each event endpoint that accepts no connection is diagnosed (in-process ingest does that at each load reading),
and, when nothing else went out, an empty report tells ingest this shard is alive (ingest/shards.py STALLED_S)."""
SEND_TIMEOUT_MS = 2000


class _Recorder:
    """One source's KeySink: its ledger's changes, tagged with the target's generation, in the shard's report."""

    __slots__ = ("gen", "shard", "tid")

    def __init__(self, shard: Shard, tid: str, gen: int) -> None:
        self.shard, self.tid, self.gen = shard, tid, gen

    def add(self, worker: int, keys: list[int]) -> None:
        self.shard.op(KeyOp(self.tid, self.gen, ADD, worker, keys))

    def remove(self, worker: int, keys: list[int]) -> None:
        self.shard.op(KeyOp(self.tid, self.gen, REMOVE, worker, keys))

    def clear_worker(self, worker: int) -> None:
        self.shard.op(KeyOp(self.tid, self.gen, CLEAR, worker))


class _Stamps:
    """Stands in for the process's lag histogram: ingest observes each batch's lag when it applies the change."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def observe(self, lag_s: float) -> None:
        self.shard.stamps.append(time.time() - lag_s)


class _Followed:
    __slots__ = ("recorder", "reported", "source", "task")

    def __init__(self, source: EventSource, recorder: _Recorder, task: asyncio.Task[None] | None) -> None:
        self.source, self.recorder, self.task = source, recorder, task
        self.reported: tuple[object, ...] = ()
        """`counters()` as last reported: the refresh reports a source whose counters moved since."""

    def counters(self) -> tuple[object, ...]:
        s = self.source
        return s.received, s.tail_checks, s.tail_connections, s.link_up, s.diagnosis, s.decode_errors


class Shard:
    """The shard's state: the sources it follows and what the next report carries. One asyncio loop, as ingest's."""

    def __init__(self, ctx: zmq.asyncio.Context, out: Callable[[bytes], None]) -> None:
        self.ctx = ctx
        """The streams' context."""
        self._out = out
        """Sends one frame to ingest (a blocking send with a timeout: raises zmq.Again when it times out)."""
        self.followed: dict[str, _Followed] = {}
        self.ops: list[KeyOp] = []
        self.stamps: list[float] = []
        self.dirty: set[str] = set()
        self.spares: list[int] = []
        self._flushing = False
        self._lag = _Stamps(self)
        self.sent_at = 0.0
        self.parent = os.getppid()

    # -- what goes to ingest

    def op(self, op: KeyOp) -> None:
        self.ops.append(op)
        self.dirty.add(op.tid)  # its ledger's figures moved with it
        self.soon()

    def touched(self, tid: str) -> None:
        self.dirty.add(tid)
        self.soon()

    def soon(self) -> None:
        """One report per turn of the loop, whatever the number of batches and sources in it."""
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flushing = False
        states = []
        for tid in self.dirty:
            f = self.followed.get(tid)
            if f is not None:
                states.append(state_of(f.source, f.recorder.gen))
                f.reported = f.counters()
        if not (self.ops or states or self.stamps) and time.monotonic() - self.sent_at < REFRESH_S:
            return
        report = Report(ops=self.ops, states=states, stamps=self.stamps)
        self.ops, self.stamps, self.dirty = [], [], set()
        # Blocking, with a timeout: ingest not reading holds the shard back (its streams queue in their sockets)
        # rather than growing a queue here; an ingest gone for good is noticed by the parent check.
        frame = ENCODER.encode(report)
        self.sent_at = time.monotonic()
        while True:
            try:
                self._out(frame)
                return
            except zmq.Again:
                if os.getppid() != self.parent:
                    raise SystemExit("event shard: ingest is gone") from None
                log.warning("event shard: ingest has not read a report for %d ms", SEND_TIMEOUT_MS)

    # -- what ingest asks

    def handle(self, msg: Assign | Drop | Control | Spares) -> None:
        if isinstance(msg, Assign):
            self._drop(msg.tid)
            self._assign(msg)
        elif isinstance(msg, Drop):
            self._drop(msg.tid)
        elif isinstance(msg, Spares):
            self.spares.extend(msg.slots)
        else:
            self._control(msg)

    def _assign(self, a: Assign) -> None:
        recorder = _Recorder(self, a.tid, a.gen)
        source = follow(a, self.ctx, recorder, alloc=self._spare, on_change=lambda: self.touched(a.tid),
                        on_events=lambda: self.touched(a.tid), lag=self._lag)
        task = None if a.endpoint is None else asyncio.get_running_loop().create_task(source.run(),
                                                                                   name=f"src-{a.tid}")
        self.followed[a.tid] = _Followed(source, recorder, task)
        self.touched(a.tid)

    def _drop(self, tid: str) -> None:
        f = self.followed.pop(tid, None)
        if f is None:
            return
        f.source.close()
        if f.task is not None:
            f.task.cancel()

    def _control(self, c: Control) -> None:
        f = self.followed.get(c.tid)
        if f is None:
            return
        source = f.source
        if c.op == "silent":
            source.silent(c.reason, time.monotonic())
        elif c.op == "check_tail":
            source.check_tail()
        elif c.op == "clear":
            f.recorder.gen = c.gen
            source.ledger.clear(f.recorder)
        else:
            source.layout_published(c.version)
        self.touched(c.tid)

    def _spare(self) -> int | None:
        return self.spares.pop(0) if self.spares else None

    # -- the loops

    def received(self, frame: bytes) -> None:
        self.handle(TO_SHARD.decode(frame))

    async def refresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            if os.getppid() != self.parent:
                log.warning("event shard: ingest is gone; exiting")
                return
            now = time.monotonic()
            for tid, f in self.followed.items():
                f.source.check_link(now)
                if f.counters() != f.reported:
                    self.dirty.add(tid)
            if self.dirty or now - self.sent_at >= REFRESH_S:
                self.soon()

    async def close(self) -> None:
        for f in self.followed.values():
            f.source.close()
            if f.task is not None:
                await cancel_quietly(f.task)


def state_of(source: EventSource, gen: int) -> SourceState:
    s, parity, ledger = source.sync, source.parity, source.ledger
    groups, tiers = ledger.layout()
    return SourceState(
        tid=source.name, gen=gen, state=s.state.value, reason=s.reason, last_applied=s.last_applied, gaps=s.gaps,
        replays=s.replays, resyncs=s.resyncs, restarts=s.restarts, duplicates=s.duplicates,
        tail_recoveries=s.tail_recoveries, parity_status=parity.status, parity_reason=parity.reason,
        parity_checked=parity.checked, parity_failures=parity.failures, blocks=ledger.blocks,
        blocks_stored=ledger.blocks_stored, blocks_removed=ledger.blocks_removed,
        blocks_restated=ledger.blocks_restated, events_applied=ledger.events_applied,
        events_inactive=ledger.events_inactive, unsupported=ledger.unsupported,
        layout_version=ledger.layout_version, groups=list(groups), tiers=list(tiers), slots=ledger.slots(),
        lanes=ledger.lanes(), dropped=dict(ledger.dropped), unknown_media=dict(ledger.unknown_media),
        lookahead=ledger.lookahead, batches=source.batches, decode_errors=source.decode_errors,
        tail_checks=source.tail_checks, tail_connections=source.tail_connections, lag_s=source.lag_s,
        link_up=source.link_up, link_since=source.link_since, diagnosis=source.diagnosis,
        last_event_at=source.last_event_at, unknown_events=dict(source.unknown_events), shown=source.shown,
        received=source.received)


async def serve(endpoint: str) -> None:
    ctx = streams_context()
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    sock.connect(endpoint)
    shard: Shard | None = None
    pipe = Pipe(sock, lambda frame: shard.received(frame) if shard is not None else None)
    shard = Shard(ctx, pipe.send)
    # Hello: ingest assigns this incarnation its targets once it hears from it (a PAIR sends nothing before).
    pipe.send(ENCODER.encode(Report(ops=[], states=[], stamps=[])))
    gc_pauses.watch()
    gc_pauses.settle()
    try:
        await shard.refresh()
    except Exception:  # ingest sees the exit, clears this shard's targets and starts another
        log.exception("event shard failed")
    finally:
        await shard.close()
        pipe.close()
        ctx.destroy(linger=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ingest.event_shard")
    parser.add_argument("--endpoint", required=True, help="ingest's PAIR socket for this shard")
    parser.add_argument("--index", type=int, required=True)
    logs.add_flags(parser, config=False)
    args = parser.parse_args(argv)
    logs.configure(*logs.resolve(args.log_level, args.log_format), process=f"ingest-shard-{args.index}")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.endpoint))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
