"""One event source: a ZMQ SUB on a target's publisher, its replay socket, and the sync state machine.

transport (this file) -> decoder (ingest.events) -> sequence state (ingest.sync) -> ledger (ingest.ledger)
-> shared view. Replay uses a DEALER (a REQ socket would receive only the first frame set of the reply
stream) and accepts both reply layouts: `[b"", topic, seq, payload]` (vLLM >= 0.26, SGLang >= 0.5.22)
and `[b"", seq, payload]` (older), ending at seq 0xffffffffffffffff or an empty payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from cortex.kv_events import END_SEQ
from ingest.events import DecodeError, decode_batch
from ingest.ledger import KeySink
from ingest.sync import Action, Apply, Clear, RequestReplay, SyncState
from ingest.workers import Target

log = logging.getLogger("cortex.ingest")

DRAIN_MAX = 64
TAIL_QUIET_S = 0.02
"""After this long without a new batch, ask the replay socket whether anything newer was lost."""
REPLAY_TIMEOUT_S = 3.0
"""A replay whose socket sends nothing for this long is given up (no publisher there, or no replay socket)."""
REPLAY_MAX_S = 60.0
"""The longest a replay may stream. The limit above is for silence only: a replica started late replays the
engine's whole buffer (10 000 batches, tens of MB), which can take longer, and a replay cut short leaves a hole
before the live batches, so the ledger would start cold (docs/deployment.md)."""


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start_seq: int, timeout_s: float = REPLAY_TIMEOUT_S,
                 max_s: float = REPLAY_MAX_S) -> tuple[list[tuple[int, bytes]], bool]:
    """Ask a publisher's ROUTER for every buffered batch from start_seq. Returns (batches, complete);
    incomplete after `timeout_s` without a message or `max_s` in all."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out: list[tuple[int, bytes]] = []
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        give_up = time.monotonic() + max_s
        while True:
            left = min(timeout_s, give_up - time.monotonic())
            if left <= 0 or not await sock.poll(int(left * 1000)):
                return out, False
            frames = await sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:
                _, seq_b, payload = frames
            elif len(frames) == 2:
                seq_b, payload = frames
            else:
                return out, False
            if seq_b == END_SEQ or not payload:
                return out, True
            if len(seq_b) != 8:
                return out, False
            out.append((int.from_bytes(seq_b, "big"), payload))
    finally:
        sock.close(0)


class EventSource:
    """Runs one target's subscription on the ingest loop; all ledger writes happen on that loop."""

    def __init__(self, target: Target, ctx: zmq.asyncio.Context, sink: KeySink,
                 on_change: Callable[[], None], on_events: Callable[[Target], None] | None = None) -> None:
        self.target = target
        self.ctx = ctx
        self.sink = sink
        self.on_change = on_change
        self.on_events = on_events
        """Called after each group of live batches (the engine is working: ingest polls its load faster)."""
        self.epoch = target.epoch
        self._replay_task: asyncio.Task[None] | None = None
        self._tail_task: asyncio.Task[None] | None = None
        self._shown = False
        """Whether the view shows this target's keys: only while its stream is in sync (READY)."""
        cfg = target.worker.cfg
        self.endpoint = target.endpoint(cfg.kv_events)
        self.replay_endpoint = target.endpoint(cfg.kv_replay)

    def _socket(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        assert self.endpoint is not None
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # Notice a dead peer at the transport level too (engines never send heartbeats themselves).
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.target.worker.cfg.kv_topic)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        return sock, monitor

    @staticmethod
    def _close(sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(0)
        sock.close(0)

    async def run(self) -> None:
        """Subscribe, and follow the connection's life through ZMQ's socket monitor.

        A lost connection may come back as a restarted engine whose numbers happen to continue where the old
        ones stopped, so it clears the target's ledger; the SUB socket is then re-created, which also fences
        off anything still queued from the old connection (the old incarnation's late batches).
        """
        sock, monitor = self._socket()
        try:
            while True:
                poller = zmq.asyncio.Poller()
                poller.register(sock, zmq.POLLIN)
                poller.register(monitor, zmq.POLLIN)
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    if event in (zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED):
                        # ingest.silence tells a worker whose publisher never accepts us from an idle one.
                        self.target.link_up = event == zmq.EVENT_CONNECTED
                        self.target.link_since = time.monotonic()
                    if event == zmq.EVENT_CONNECTED:
                        # Batches published before the SUB handshake completes are lost (slow joiner):
                        # exactly what the initial replay fills.
                        self.perform(self.target.sync.connected())
                    elif event == zmq.EVENT_DISCONNECTED:
                        self.perform(self.target.sync.disconnected("connection to the publisher lost"))
                        self._close(sock, monitor)
                        sock, monitor = self._socket()
                        continue
                if sock in ready:
                    await self._receive(sock)
        finally:
            for task in (self._replay_task, self._tail_task):
                if task is not None:
                    task.cancel()
            self._close(sock, monitor)

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        """Take every batch already queued (up to DRAIN_MAX) and publish their net effect at once: under
        an event storm the view then sees a few large writes instead of many small ones."""
        t = self.target
        with t.ledger.deferred(self.sink):
            for _ in range(DRAIN_MAX):
                frames = await sock.recv_multipart()
                t.last_event_at = time.monotonic()
                if len(frames) != 3 or len(frames[1]) != 8:
                    t.decode_errors += 1
                else:
                    self.perform(t.sync.live(int.from_bytes(frames[1], "big"), frames[2]))
                if not await sock.poll(0, zmq.POLLIN):
                    break
        if self.on_events is not None:
            self.on_events(t)
        self.check_tail()

    def check_tail(self) -> None:
        """Ask replay for anything newer than the last applied batch once the stream is quiet. Called after
        each received group, and by the load poll when the engine did work (its whole output may have been
        lost, so no arrival would ever trigger the check)."""
        if self.replay_endpoint is not None and (self._tail_task is None or self._tail_task.done()):
            self._tail_task = asyncio.create_task(self._tail_check())

    async def _tail_check(self) -> None:
        t = self.target
        while True:
            seen = t.last_event_at
            await asyncio.sleep(TAIL_QUIET_S)
            if t.last_event_at == seen:
                break  # the stream went quiet
        if t.sync.state is not SyncState.READY or t.sync.replay_pending or t.sync.last_applied is None:
            return
        assert self.replay_endpoint is not None
        epoch = t.epoch
        t.tail_checks += 1
        try:
            batches, _ = await replay(self.ctx, self.replay_endpoint, t.sync.last_applied + 1, timeout_s=1.0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("target %s: tail check failed: %s", t.id, exc)
            return
        if batches and epoch == t.epoch:
            with t.ledger.deferred(self.sink):
                self.perform(t.sync.tail_checked(batches))

    def perform(self, actions: list[Action]) -> None:
        t = self.target
        if self.epoch != t.epoch:  # a late callback from a removed incarnation: fenced off
            return
        changed = False
        # One net view write for the whole list: a reader never sees a batch's additions without the
        # removals of the next one, nor a target shown again before its catch-up batches are in.
        with t.ledger.deferred(self.sink):
            for action in actions:
                if isinstance(action, Apply):
                    self._apply(action.payload)
                elif isinstance(action, Clear):
                    log.warning("target %s: %s", t.id, action.reason)
                    t.ledger.clear(self.sink)
                    if action.publisher_restart:
                        t.parity.reset()
                    changed = True
                elif isinstance(action, RequestReplay):
                    self._start_replay(action.from_seq)
                    changed = True
            ready = t.sync.state is SyncState.READY
            if self._shown and not ready:
                # Out of sync: a batch held back behind a hole, or not received yet, may remove what the ledger
                # lists. Readers learn of the state a refresh (~100 ms) later, so the view hides the target now
                # (issue 11: a claim above cached_tokens right after a sequence gap).
                t.ledger.hide(self.sink)
                changed = True
            elif ready and not self._shown:
                t.ledger.reveal(self.sink)
            self._shown = ready
        if changed:
            self.on_change()

    def _apply(self, payload: bytes) -> None:
        t = self.target
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            t.decode_errors += 1
            log.warning("target %s: undecodable batch: %s", t.id, exc)
            return
        t.decode_errors += len(batch.errors)
        if batch.ts > 0:
            # Engine clock to ingest clock: includes publish queueing, the network and any replay delay.
            t.lag_s = max(0.0, time.time() - batch.ts)
        was_failed = t.parity.failed
        t.ledger.apply(batch.events, self.sink)
        t.batches += 1
        if t.parity.failed and not was_failed:
            log.error("target %s: hash parity failed, exact-KV routing off for it: %s", t.id, t.parity.reason)
            self.on_change()

    def _start_replay(self, from_seq: int) -> None:
        task = self._replay_task
        # A replay cut short asks for the rest from its own task, which is finishing: not cancelled.
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        if self.replay_endpoint is None:
            self.perform(self.target.sync.replay_done(complete=False))
            return
        self._replay_task = asyncio.create_task(self._replay(from_seq))

    async def _replay(self, from_seq: int) -> None:
        try:
            assert self.replay_endpoint is not None
            batches, complete = await replay(self.ctx, self.replay_endpoint, from_seq)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure must still end the replay, or the target stays waiting for it
            log.warning("target %s: replay failed: %s", self.target.id, exc)
            batches, complete = [], False
        for seq, payload in batches:
            self.perform(self.target.sync.replayed(seq, payload))
        self.perform(self.target.sync.replay_done(complete))
        self.on_change()


async def cancel_quietly(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
