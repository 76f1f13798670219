"""One event source: a target's ZMQ SUB and replay sockets, and what it owns: the sync state machine, the
ledger and its hash parity check, and the stream's counters.

transport (this file) -> decoder (ingest.events) -> sequence state (ingest.sync) -> ledger (ingest.ledger)
-> shared view. Replay uses a DEALER (a REQ socket would receive only the first frame set of the reply
stream) and accepts both reply layouts: `[b"", topic, seq, payload]` (vLLM >= 0.26, SGLang >= 0.5.22)
and `[b"", seq, payload]` (older), ending at seq 0xffffffffffffffff or an empty payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from cortex.kv_events import END_SEQ
from ingest import silence
from ingest.events import DecodeError, decode_batch
from ingest.hash_parity import ParityCheck
from ingest.lag import VIEW_LAG
from ingest.ledger import Ledger
from ingest.ledger_publish import KeySink, SlotAllocator
from ingest.loop_cpu import timed
from ingest.shard_wire import Assign
from ingest.sync import Action, Apply, Clear, RequestReplay, SourceSync, SyncState

log = logging.getLogger("cortex.ingest")

DRAIN_MAX = 64
TAIL_QUIET_S = 0.02
"""After this long without a new batch, ask the replay socket whether anything newer was lost."""
REPLAY_TIMEOUT_S = 3.0
"""A replay whose socket sends nothing for this long is given up (no publisher there, or no replay socket)."""
LAYOUT_GRACE_S = 0.5
"""How long a target stays hidden after the target list with its new KV-cache layout (a hybrid model's window
groups, a lower tier) was written to the view: extproc reads that list before routing when its copy is older than
0.1 s (extproc/server.py UPKEEP_S), so by then no request reads the new slots with the old layout."""
UNREACHABLE_S = 5.0
"""An event endpoint that has accepted no connection for this long is diagnosed (ingest.silence.unreachable): a
live engine's publisher accepts within ZMQ's 100 ms reconnect interval."""
DIAGNOSE_EVERY_S = 30.0
MAX_KINDS = 16
"""Distinct unknown event types counted by name per target (bounded metric labels); the rest count as `other`."""
REPLAY_MAX_S = 60.0
"""The longest a replay may stream. The limit above is for silence only: a replica started late replays the
engine's whole buffer (10 000 batches, tens of MB), which can take longer, and a replay cut short leaves a hole
before the live batches, so the ledger would start cold (docs/deployment.md)."""


MAX_SOCKETS = 65536
"""ZMQ sockets one context may hold (libzmq's default is 1023). A target holds up to six: its SUB, the two ends of its
connection monitor, its kept tail-check DEALER and, at times, a replay's and a diagnosis's; at the default, a replica
of a few hundred targets was refused sockets ("Too many open files") and those targets started without replay. The
slot table this sizes costs 8 bytes a socket."""


def streams_context() -> zmq.asyncio.Context:
    """The ZMQ context for a process's event streams, sized for MAX_SOCKETS, with the process's open-file limit
    raised to its hard limit (each socket and connection is a file descriptor)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
    return ctx


class LagSink(Protocol):
    def observe(self, lag_s: float) -> None: ...


def _dealer(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A kept socket whose publisher went away retries with backoff, not every 100 ms until it is next used.
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 10_000)
    sock.connect(endpoint)
    return sock


def _reply(frames: list[bytes]) -> tuple[int, bytes] | bool:
    """One frame set of a replay's answer: (seq, payload); True at the end marker; False when malformed."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:
        _, seq_b, payload = frames
    elif len(frames) == 2:
        seq_b, payload = frames
    else:
        return False
    if seq_b == END_SEQ or not payload:
        return True
    if len(seq_b) != 8:
        return False
    return int.from_bytes(seq_b, "big"), payload


async def _exchange(sock: zmq.asyncio.Socket, start_seq: int, timeout_s: float,
                    max_s: float) -> tuple[list[tuple[int, bytes]], bool]:
    """One request on a DEALER and its answer, up to the end marker: (batches, complete)."""
    out: list[tuple[int, bytes]] = []
    await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
    give_up = time.monotonic() + max_s
    while True:
        left = min(timeout_s, give_up - time.monotonic())
        if left <= 0 or not await sock.poll(int(left * 1000)):
            return out, False
        got = _reply(await sock.recv_multipart())
        if isinstance(got, bool):
            return out, got
        out.append(got)


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start_seq: int, timeout_s: float = REPLAY_TIMEOUT_S,
                 max_s: float = REPLAY_MAX_S) -> tuple[list[tuple[int, bytes]], bool]:
    """Ask a publisher's ROUTER for every buffered batch from start_seq, on a DEALER of its own. Returns
    (batches, complete); incomplete after `timeout_s` without a message or `max_s` in all."""
    sock = _dealer(ctx, endpoint)
    try:
        return await _exchange(sock, start_seq, timeout_s, max_s)
    finally:
        sock.close(0)


class ReplayLink:
    """The DEALER a source's tail checks ask through, kept connected from one check to the next.

    A tail check runs after every burst of batches and at every load reading of a busy worker: at 256 workers
    that is hundreds a second per replica, and a DEALER opened and closed for each (a TCP connection and a ZMTP
    handshake, on both ends) cost ~0.95 ms of ingest's CPU per check against 0.23-0.31 ms kept
    (docs/performance.md, "Tail checks on a kept connection"). The socket is kept only between exchanges that
    ended cleanly, at the publisher's end marker: one that timed out, failed or was cancelled (a fence) closes it,
    so an answer still on its way is never read as the next check's. Its I/O goes through a synchronous shadow
    whose FD the loop watches, as the event streams' does (`EventSource._watch`): no future per message."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._kept: _Kept | None = None
        self._lock = asyncio.Lock()
        self.opened = 0
        """Connections opened so far (`tail_connections` in /cortex/workers: one per publisher incarnation while
        every check is answered)."""

    async def ask(self, start_seq: int, timeout_s: float,
                  max_s: float = REPLAY_MAX_S) -> tuple[list[tuple[int, bytes]], bool]:
        async with self._lock:  # one exchange at a time: answers carry no request id
            if self._kept is None:
                self._kept = _Kept.open(self._ctx, self._endpoint)
                self.opened += 1
            kept = self._kept
            try:
                got = await kept.exchange(start_seq, timeout_s, max_s)
            except BaseException:
                self._drop(kept)
                raise
            if not got[1]:
                self._drop(kept)
            return got

    def close(self) -> None:
        """Closed now; the next exchange opens a new connection. A pending exchange on it ends in an error
        (its task is being cancelled: the callers fence with both)."""
        if self._kept is not None:
            self._drop(self._kept)

    def _drop(self, kept: _Kept) -> None:
        kept.close()
        if self._kept is kept:
            self._kept = None

    @property
    def open(self) -> bool:
        return self._kept is not None


class _Kept:
    """One kept DEALER: the asyncio socket that owns it, its synchronous shadow, and the loop watching its FD."""

    def __init__(self, sock: zmq.asyncio.Socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self.raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self.loop = loop
        self.fd = _fd(self.raw)
        self.ready = asyncio.Event()
        self.closed = False
        loop.add_reader(self.fd, self.ready.set)

    @classmethod
    def open(cls, ctx: zmq.asyncio.Context, endpoint: str) -> _Kept:
        return cls(_dealer(ctx, endpoint), asyncio.get_running_loop())

    async def exchange(self, start_seq: int, timeout_s: float, max_s: float) -> tuple[list[tuple[int, bytes]], bool]:
        """As `_exchange`, on the shadow. The request is queued at once: a connecting DEALER holds it until the
        connection is up (ZMQ_IMMEDIATE is off)."""
        out: list[tuple[int, bytes]] = []
        raw = self.raw
        raw.send_multipart([b"", start_seq.to_bytes(8, "big")], zmq.NOBLOCK)
        give_up = time.monotonic() + max_s
        while True:
            while _readable(raw):  # reading ZMQ_EVENTS also re-arms the edge-triggered FD
                got = _reply(raw.recv_multipart(zmq.NOBLOCK))
                if isinstance(got, bool):
                    return out, got
                out.append(got)
            left = min(timeout_s, give_up - time.monotonic())
            if left <= 0:
                return out, False
            self.ready.clear()
            if _readable(raw):
                continue  # arrived between the drain and the clear
            try:
                async with asyncio.timeout(left):
                    await self.ready.wait()
            except TimeoutError:
                return out, False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            unwatch_and_close(self.loop, self.fd, self.sock)


def unwatch_and_close(loop: asyncio.AbstractEventLoop, fd: int, sock: zmq.Socket[Any]) -> None:
    """Stop the loop watching a socket's FD, and close the socket. Once only per socket: after the close its FD's
    number may be another socket's (a stream's new SUB), whose reader a second remove_reader would take away."""
    with contextlib.suppress(ValueError, OSError, RuntimeError):  # RuntimeError: the loop is gone
        loop.remove_reader(fd)
    sock.close(0)


def rank_endpoint(base: str | None, rank: int | None) -> str | None:
    """A DP rank's ZMQ endpoint: the engines offset the port by the rank (kv-events.md §1.4)."""
    if base is None or rank in (None, 0):
        return base
    host, port = base.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


def _fd(sock: zmq.Socket[Any]) -> int:
    return cast(int, sock.getsockopt(zmq.FD))


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
"""As plain ints: pyzmq's enum members cost an Enum construction per `&` (~1 % of ingest's samples under traffic)."""


def _readable(sock: zmq.Socket[Any]) -> bool:
    """ZMQ_EVENTS has POLLIN (reading it also re-arms the socket's edge-triggered FD)."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)


class EventSource:
    """One target's KV-event stream and everything that follows from it: the subscription, the sequence state
    machine (`sync`), the ledger and its hash parity check, and the counters that describe the stream. Runs on
    the ingest loop; all ledger writes happen on that loop. Nothing else writes into it: the service asks
    (`check_tail`, `silent`), and reads."""

    def __init__(self, name: str, ledger: Ledger, parity: ParityCheck, sync: SourceSync, ctx: zmq.asyncio.Context,
                 sink: KeySink, *, endpoint: str | None, replay_endpoint: str | None, topic: str = "",
                 on_change: Callable[[], None] = lambda: None, on_events: Callable[[], None] | None = None,
                 lag: LagSink = VIEW_LAG) -> None:
        self.name = name
        """The target's id, for the log."""
        self.ledger = ledger
        self.parity = parity
        self.sync = sync
        self.ctx = ctx
        self.sink = sink
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.on_change = on_change
        self.on_events = on_events
        """Called after each group of live batches (the engine is working: ingest polls its load faster)."""
        self.lag = lag
        """Where each applied batch's lag goes: the process's histogram, or an event shard's report."""
        self.closed = False
        """Set when its target is removed: a callback still in flight for it is fenced off."""
        self._replay_task: asyncio.Task[None] | None = None
        self._tail_task: asyncio.Task[None] | None = None
        self._tail_link = None if replay_endpoint is None else ReplayLink(ctx, replay_endpoint)
        self._shown = False
        """Whether the view shows this target's keys: only while its stream is in sync (READY)."""
        self._told = sync.state
        """The sync state last logged: each change is one line, not one per batch."""
        self.last_event_at = 0.0
        self.batches = 0
        self.decode_errors = 0
        self.tail_checks = 0
        self.lag_s = 0.0
        """Age of the newest applied batch when it was applied (engine timestamp to ingest clock)."""
        self.link_up = False
        """The SUB socket is connected to the publisher (ZMQ's socket monitor)."""
        self.link_since = time.monotonic()
        """When the connection last came up or went down (or the source was created)."""
        self.diagnosis: tuple[str, str] | None = None
        """(code, reason) when the event endpoint accepts no connection (ingest.silence.unreachable); None once it
        does."""
        self._diagnosed_at = -DIAGNOSE_EVERY_S
        self._diagnose_task: asyncio.Task[None] | None = None
        self.unknown_events: Counter[str] = Counter()
        """Events of types Cortex does not know, by type (skipped; a newer engine's)."""
        self._layout = ledger.layout_version
        """The ledger's layout version last acted on."""
        self._layout_pending = False
        """A new layout's slots are not shown until extproc has read the target list that describes them."""

    @property
    def tail_connections(self) -> int:
        """Connections the tail checks opened to the replay socket (0 without one)."""
        return 0 if self._tail_link is None else self._tail_link.opened

    @property
    def received(self) -> int:
        """Batches that arrived (applied, undecodable or duplicate), live or replayed: counted, not timed."""
        return self.batches + self.decode_errors + self.sync.duplicates

    def close(self) -> None:
        self.closed = True
        if self._tail_task is not None:
            self._tail_task.cancel()
        if self._tail_link is not None:
            self._tail_link.close()

    def silent(self, reason: str, now: float) -> None:
        """The worker was busy but this stream stayed quiet too long: resync it, once per silent period."""
        self.perform(self.sync.silent(reason))
        self.last_event_at = now

    def lost(self, reason: str) -> None:
        """The connection to the publisher dropped: it may come back as another process."""
        self.perform(self.sync.disconnected(reason))

    def _fence(self) -> None:
        """Cancel the replay and tail check asked of a publisher that is gone (connection lost, or restarted).
        Each has a DEALER of its own, which re-creating the SUB socket does not fence; their answers (frames
        already queued, or what a dying socket sent before it fell silent) hold the old process's batches.
        Applied after the clear, or buffered into the new publisher's first replay, they listed blocks the
        restarted engine does not hold, and made its own low sequence numbers look like duplicates."""
        pending = [t for t in (self._replay_task, self._tail_task) if t is not None and not t.done()]
        if pending:  # tasks exist only on a running loop
            current = asyncio.current_task()
            for task in pending:
                if task is not current:
                    task.cancel()
        if self._tail_link is not None:
            self._tail_link.close()  # the next check starts on a new connection, to whoever publishes there now

    def _socket(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        assert self.endpoint is not None
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        # Notice a dead peer at the transport level too (engines never send heartbeats themselves).
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
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
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        sock, monitor = self._socket()
        raw, mraw = self._watch(loop, wake, sock, monitor)
        try:
            while True:
                # The sockets' ZMQ_FDs only say "something may have changed": ZMQ_EVENTS says what. Reading it
                # also re-arms the FD, so a batch that arrives after this check wakes the wait below.
                if _readable(mraw):
                    event = parse_monitor_message(mraw.recv_multipart(zmq.NOBLOCK))["event"]
                    if event in (zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED):
                        # ingest.silence tells a worker whose publisher never accepts us from an idle one.
                        self.link_up = event == zmq.EVENT_CONNECTED
                        self.link_since = time.monotonic()
                        if self.link_up and self.diagnosis is not None:
                            log.info("target %s: KV-event endpoint %s accepts connections now", self.name,
                                     self.endpoint)
                            self.diagnosis = None
                            self.on_change()
                    if event == zmq.EVENT_CONNECTED:
                        # Batches published before the SUB handshake completes are lost (slow joiner):
                        # exactly what the initial replay fills.
                        self.perform(self.sync.connected())
                    elif event == zmq.EVENT_DISCONNECTED:
                        self.lost("connection to the publisher lost")
                        self._unwatch(loop, sock, monitor)
                        self._close(sock, monitor)
                        sock, monitor = self._socket()
                        raw, mraw = self._watch(loop, wake, sock, monitor)
                    continue
                if _readable(raw):
                    self._receive(raw)
                    await asyncio.sleep(0)  # the rest of ingest runs between two groups of an event storm
                    continue
                wake.clear()
                await wake.wait()
        finally:
            for task in (self._replay_task, self._tail_task, self._diagnose_task):
                if task is not None:
                    task.cancel()
            if self._tail_link is not None:
                self._tail_link.close()
            self._unwatch(loop, sock, monitor)
            self._close(sock, monitor)

    @staticmethod
    def _watch(loop: asyncio.AbstractEventLoop, wake: asyncio.Event, sock: zmq.asyncio.Socket,
               monitor: zmq.asyncio.Socket) -> tuple[zmq.Socket, zmq.Socket]:
        """Synchronous shadows of the two sockets, their FDs watched by the event loop. Instead of pyzmq's
        asyncio poller (a future per socket per wake-up) and a future per received batch, which were a third
        of ingest's CPU under load (issue 14): every batch queued is then taken synchronously."""
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        mraw: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
        for s in (raw, mraw):
            loop.add_reader(_fd(s), wake.set)
        return raw, mraw

    @staticmethod
    def _unwatch(loop: asyncio.AbstractEventLoop, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        for s in (sock, monitor):
            with contextlib.suppress(zmq.ZMQError, ValueError, OSError):
                loop.remove_reader(_fd(s))

    def _receive(self, sock: zmq.Socket) -> None:
        """Take every batch already queued (up to DRAIN_MAX) and publish their net effect at once: under
        an event storm the view then sees a few large writes instead of many small ones."""
        got = 0
        with self.ledger.deferred(self.sink):
            for _ in range(DRAIN_MAX):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break  # the queue is empty (also after a spurious wake-up)
                got += 1
                self.last_event_at = time.monotonic()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.decode_errors += 1
                else:
                    self.perform(self.sync.live(int.from_bytes(frames[1], "big"), frames[2]))
        if not got:
            return
        if self.on_events is not None:
            self.on_events()
        self.check_tail()

    def check_link(self, now: float) -> None:
        """Called with each load reading: an event endpoint that has accepted no connection for UNREACHABLE_S is
        diagnosed (again every DIAGNOSE_EVERY_S while it stays so)."""
        if (self.link_up or self.endpoint is None or now - self.link_since < UNREACHABLE_S
                or now - self._diagnosed_at < DIAGNOSE_EVERY_S
                or (self._diagnose_task is not None and not self._diagnose_task.done())):
            return
        self._diagnosed_at = now
        self._diagnose_task = asyncio.create_task(timed("events", self._diagnose()))

    async def _diagnose(self) -> None:
        """Ask the replay socket, which the engines always bind, whether a publisher lives there."""
        assert self.endpoint is not None
        answered: bool | None = None
        if self.replay_endpoint is not None:
            try:
                # From past any sequence: a live publisher answers with the end marker alone, at once.
                _, answered = await replay(self.ctx, self.replay_endpoint, (1 << 63) - 1, timeout_s=1.0, max_s=2.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("target %s: replay probe failed: %s", self.name, exc)
                answered = False
        if self.link_up or self.closed:
            return
        got = silence.unreachable(self.endpoint, self.replay_endpoint, answered, time.monotonic() - self.link_since)
        if self.diagnosis is None or got[0] != self.diagnosis[0]:
            log.warning("target %s: KV events: %s", self.name, got[1])
        self.diagnosis = got
        self.on_change()

    def check_tail(self) -> None:
        """Ask replay for anything newer than the last applied batch once the stream is quiet. Called after
        each received group, and by the load poll when the engine did work (its whole output may have been
        lost, so no arrival would ever trigger the check)."""
        if self.replay_endpoint is not None and (self._tail_task is None or self._tail_task.done()):
            self._tail_task = asyncio.create_task(timed("events", self._tail_check()))

    async def _tail_check(self) -> None:
        while True:
            seen = self.last_event_at
            await asyncio.sleep(TAIL_QUIET_S)
            if self.last_event_at == seen:
                break  # the stream went quiet
        sync = self.sync
        if sync.state is not SyncState.READY or sync.replay_pending or sync.last_applied is None:
            return
        self.tail_checks += 1
        try:
            assert self._tail_link is not None
            batches, _ = await self._tail_link.ask(sync.last_applied + 1, timeout_s=1.0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("target %s: tail check failed: %s", self.name, exc)
            return
        if batches and not self.closed:
            with self.ledger.deferred(self.sink):
                self.perform(sync.tail_checked(batches))

    def perform(self, actions: list[Action]) -> None:
        if self.closed:  # a late callback from a removed incarnation: fenced off
            return
        cleared = False
        changed = False
        # One net view write for the whole list: a reader never sees a batch's additions without the
        # removals of the next one, nor a target shown again before its catch-up batches are in.
        with self.ledger.deferred(self.sink):
            for action in actions:
                if isinstance(action, Apply):
                    self._apply(action.payload)
                elif isinstance(action, Clear):
                    log.warning("target %s: %s", self.name, action.reason)
                    cleared = True
                    self.ledger.clear(self.sink)
                    if action.publisher_restart:
                        self.parity.reset()
                        self._fence()
                    changed = True
                elif isinstance(action, RequestReplay):
                    self._start_replay(action.from_seq)
                    changed = True
            ready = self.sync.state is SyncState.READY and not self._layout_pending
            if self._shown and not ready:
                # Out of sync: a batch held back behind a hole, or not received yet, may remove what the ledger
                # lists. Readers learn of the state a refresh (~100 ms) later, so the view hides the target now
                # (issue 11: a claim above cached_tokens right after a sequence gap).
                self.ledger.hide(self.sink)
                changed = True
            elif ready and not self._shown:
                self.ledger.reveal(self.sink)
            self._shown = ready
        if self.sync.state is not self._told:
            if not cleared:  # a clear already said why
                self._log_sync(self._told)
            self._told = self.sync.state
        if changed:
            self.on_change()

    @property
    def shown(self) -> bool:
        """Whether the view offers this target's blocks to readers now: not while its stream is out of sync, nor
        for LAYOUT_GRACE_S after a new KV-cache layout while extproc learns how to read its slots."""
        return self._shown

    def _log_sync(self, was: SyncState) -> None:
        """A person sees each stream come into sync once, and each time it falls out and back (a resync)."""
        now, why = self.sync.state, self.sync.reason
        if now is SyncState.STALE:
            log.warning("target %s: KV events out of sync: %s; routed by load until caught up", self.name, why)
        elif now is SyncState.READY:
            log.info("target %s: KV events in sync: %s", self.name, why)
        else:
            log.debug("target %s: KV events %s -> %s (%s)", self.name, was.value, now.value, why)

    def _apply(self, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            self.decode_errors += 1
            log.warning("target %s: undecodable batch: %s", self.name, exc)
            return
        self.decode_errors += len(batch.errors)
        for kind in batch.unknown:
            self.unknown_events[kind if len(self.unknown_events) < MAX_KINDS or kind in self.unknown_events
                                else "other"] += 1
        if batch.ts > 0:
            # Engine clock to ingest clock: includes publish queueing, the network and any replay delay.
            self.lag_s = max(0.0, time.time() - batch.ts)
            self.lag.observe(self.lag_s)
        was_failed = self.parity.failed
        self.ledger.apply(batch.events, self.sink)
        self.batches += 1
        if self.parity.failed and not was_failed:
            log.error("target %s: hash parity failed, exact-KV routing off for it: %s", self.name, self.parity.reason)
            self.on_change()
        if self.ledger.layout_version != self._layout:
            self._new_layout()

    def _new_layout(self) -> None:
        """The ledger met a KV-cache group or tier that needs a slot of its own (or a layout it cannot route): the
        target is hidden (perform's end) until the target list describing it has reached extproc."""
        self._layout = self.ledger.layout_version
        self._layout_pending = True
        groups, tiers = self.ledger.layout()
        if self.ledger.unsupported:
            log.warning("target %s: KV-cache layout not routable exactly: %s; routed by load", self.name,
                        self.ledger.unsupported)
        else:
            log.info("target %s: KV-cache layout: %s", self.name,
                     ", ".join([*(f"{g.kind}{f' (window {g.need} blocks)' if g.need else ''} -> slot {g.slot}"
                                  for g in groups), *(f"{t.medium} tier -> slot {t.slot}" for t in tiers)])
                     or "one full-attention group")
        self.on_change()

    def layout_published(self, version: int) -> None:
        """The target list written to the view describes layout `version`: show the target once extproc has
        read it (LAYOUT_GRACE_S)."""
        if not self._layout_pending or version != self._layout:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (tests driving the source by hand): nothing reads the view meanwhile
            self._layout_settled(version)
            return
        loop.call_later(LAYOUT_GRACE_S, self._layout_settled, version)

    def _layout_settled(self, version: int) -> None:
        if self.closed or not self._layout_pending or version != self._layout:
            return
        self._layout_pending = False
        self.perform([])

    def _start_replay(self, from_seq: int) -> None:
        task = self._replay_task
        # A replay cut short asks for the rest from its own task, which is finishing: not cancelled.
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        if self.replay_endpoint is None:
            self.perform(self.sync.replay_done(complete=False))
            return
        self._replay_task = asyncio.create_task(timed("events", self._replay(from_seq)))

    async def _replay(self, from_seq: int) -> None:
        try:
            assert self.replay_endpoint is not None
            batches, complete = await replay(self.ctx, self.replay_endpoint, from_seq)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure must still end the replay, or the target stays waiting for it
            log.warning("target %s: replay failed: %s", self.name, exc)
            batches, complete = [], False
        for seq, payload in batches:
            self.perform(self.sync.replayed(seq, payload))
        self.perform(self.sync.replay_done(complete))
        self.on_change()


def follow(a: Assign, ctx: zmq.asyncio.Context, sink: KeySink, *, alloc: SlotAllocator | None,
           on_change: Callable[[], None], on_events: Callable[[], None] | None, lag: LagSink = VIEW_LAG) -> EventSource:
    """The source of one assigned target, with its ledger and hash parity check: in ingest (`ingest.event_shards: 0`)
    and in an event shard alike."""
    parity = ParityCheck(engine=a.engine, page_size=a.page_size, hash_algo=a.hash_algo, hash_seed=a.hash_seed)
    return EventSource(
        a.tid, Ledger(slot=a.slot, engine=a.engine, block_size=a.block_size, parity=parity, alloc=alloc), parity,
        SourceSync(has_replay=a.replay_endpoint is not None), ctx, sink, endpoint=a.endpoint,
        replay_endpoint=a.replay_endpoint, topic=a.topic, on_change=on_change, on_events=on_events, lag=lag)


async def cancel_quietly(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
