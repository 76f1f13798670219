"""A ZMQ KV-event publisher that behaves like vLLM 0.33's and SGLang 0.5.23's.

The wire schemas and framing it sends are written once in cortex/kv_events.py (shared with ingest's
decoder); this module is the publisher's behaviour: sequence numbers, the replay ROUTER, faults, threads.

Faults (``cortexsim.faults``) act in the publisher thread, where the sequence numbers are assigned: a dropped
batch still consumes its seq and stays replayable (as when PUB drops at its high-water mark), a duplicate is
sent twice with one seq, a reordered batch is held back and sent right after the next one, a seq gap skips
numbers that never existed, and a restart closes and re-binds both sockets with seq back at 0 and an empty
replay buffer, as after an engine restart.

Threading model, as in vLLM: ``publish()`` only puts the batch on a ``queue.Queue``; one daemon thread owns
both sockets, encodes, assigns ``seq``, sends, keeps the replay ring buffer and serves replay requests between
sends. The sockets are created and bound in the constructor (so a busy port fails at startup, not later)
and used only by that thread from then on; the thread start is the memory barrier zmq requires for that
hand-over. Callers on an asyncio loop therefore never touch zmq.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import zmq

from cortex.kv_events import END_SEQ, AnyBatch, KVEventBatch, SglKVCacheEvent, SglKVEventBatch
from cortexsim.faults import Faults

log = logging.getLogger("cortex.sim.kv_events")  # its name in log lines, kept across the move

def _fill_rank(batch: AnyBatch, rank: int) -> None:
    # Both engines' publishers stamp their own rank on batches that arrive without one.
    if isinstance(batch, SglKVEventBatch):
        if batch.attn_dp_rank is None:
            batch.attn_dp_rank = rank
    elif batch.data_parallel_rank is None:
        batch.data_parallel_rank = rank


# --- publishers -----------------------------------------------------------------------------------


class EventPublisher(Protocol):
    """Delivery contract: batches go out in publish() order with seq 0, 1, 2, ... per publisher
    lifetime; live delivery is best effort (PUB drops for slow joiners), replay covers the last
    `buffer_steps` batches."""

    endpoint: str | None
    replay_endpoint: str | None

    def publish(self, batch: AnyBatch) -> None: ...

    def restart(self) -> None: ...

    def flush(self, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...

    @property
    def last_seq(self) -> int | None: ...


class NullEventPublisher:
    """Events disabled: the engine still produces them and nobody sends them (no ``if enabled`` checks)."""

    endpoint: str | None = None
    replay_endpoint: str | None = None
    last_seq: int | None = None

    def publish(self, batch: AnyBatch) -> None:
        return None

    def restart(self) -> None:
        return None

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        return None


def _bind(sock: zmq.Socket[bytes], host: str, port: int, *, retry_s: float = 0.0) -> str:
    # Port 0 asks the OS for a port; zmq spells that "*" and reports the result in LAST_ENDPOINT.
    deadline = time.monotonic() + retry_s
    while True:
        try:
            sock.bind(f"tcp://{host}:{port if port else '*'}")
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            # A re-bind right after close can race zmq's I/O thread releasing the port.
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


class _Restart:
    """Queue marker: re-create the sockets (an engine restart as a subscriber sees it)."""


_RESTART = _Restart()


class ZmqEventPublisher:
    """vLLM's ``ZmqEventPublisher``: PUB + optional replay ROUTER, served by one background thread."""

    def __init__(self, port: int, *, host: str = "127.0.0.1", replay_port: int | None = None,
                 topic: str = "", buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, data_parallel_rank: int = 0,
                 poll_interval: float = 0.1, faults: Faults | None = None,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self._topic = topic.encode()
        self._dp_rank = data_parallel_rank
        self._host = host
        self._hwm = hwm
        self._buffer_steps = buffer_steps
        # vLLM blocks up to 0.1 s for the next batch, which bounds replay latency; kept configurable.
        self._poll_interval = poll_interval
        self._faults = faults or Faults()
        self._faults.register_publisher(id(self))
        self._queue: queue.Queue[AnyBatch | _Restart | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # A fleet of simulated workers in one process shares one context (one zmq I/O thread, not one each);
        # the owner of a shared context terminates it.
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub, self._replay = self._open_sockets(port, replay_port)
        except zmq.ZMQError:
            if self._own_ctx:
                self._ctx.term()
            raise
        self._closed = False
        self._next_seq = 0
        self._held: tuple[int, bytes] | None = None
        self.restarts = 0
        # Counts let flush() wait for a signal instead of a sleep.
        self._progress = threading.Condition()
        self._published = 0
        self._handled = 0
        self._thread = threading.Thread(target=self._run, name="zmq-publisher", daemon=True)
        self._thread.start()

    def _open_sockets(self, port: int, replay_port: int | None,
                      retry_s: float = 0.0) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        replay: zmq.Socket[bytes] | None = None
        try:
            pub.set_hwm(self._hwm)
            pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = _bind(pub, self._host, port, retry_s=retry_s)
            if replay_port is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.SNDHWM, 2 * (self._buffer_steps + 1))
                self.replay_endpoint = _bind(replay, self._host, replay_port, retry_s=retry_s)
        except zmq.ZMQError:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        return pub, replay

    def publish(self, batch: AnyBatch) -> None:
        if self._closed:
            raise RuntimeError("publisher is closed")
        with self._progress:
            self._published += 1
        self._queue.put(batch)

    def restart(self) -> None:
        """Close and re-bind both sockets on the same ports after what is queued; seq restarts at 0."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        with self._progress:
            self._published += 1
        self._queue.put(_RESTART)

    @property
    def last_seq(self) -> int | None:
        """The number of the newest batch sent since the last (re)start, None before the first; after flush()
        it covers every batch published so far."""
        return self._next_seq - 1 if self._next_seq else None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch published so far is sent and replayable; False on timeout."""
        with self._progress:
            target = self._published
            return self._progress.wait_for(lambda: self._handled >= target, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Send everything already published, then stop the thread and release the ports."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            # Closing sockets under a live thread is undefined behaviour in zmq; leaking them is not.
            log.warning("kv-events publisher thread did not stop within %.1fs", timeout)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay(self._replay)
                except zmq.ZMQError:
                    log.exception("kv-events replay failed")
            try:
                item = self._queue.get(timeout=self._poll_interval)
            except queue.Empty:
                continue
            if item is None:
                if self._held is not None:
                    self._send(*self._held)
                    self._held = None
                return
            try:
                if isinstance(item, _Restart):
                    self._do_restart()
                else:
                    _fill_rank(item, self._dp_rank)
                    self._publish_one(encoder.encode(item))
            except Exception:
                # One bad batch must not kill the stream; vLLM logs and carries on too.
                log.exception("kv-events publish failed")
            with self._progress:
                self._handled += 1
                self._progress.notify_all()

    def _publish_one(self, payload: bytes) -> None:
        self._next_seq += self._faults.take_seq_gap(id(self))
        seq = self._next_seq
        self._next_seq += 1
        # The ring buffer gets every batch in seq order, whatever happens to the live send.
        self._buffer.append((seq, payload))
        held, self._held = self._held, None
        if self._faults.roll("drop_events"):
            pass
        elif held is None and self._faults.roll("reorder_events"):
            self._held = (seq, payload)
        else:
            self._send(seq, payload)
            if self._faults.roll("duplicate_events"):
                self._send(seq, payload)
        if held is not None:
            self._send(*held)

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)

    def _do_restart(self) -> None:
        assert self.endpoint is not None
        port = _port_of(self.endpoint)
        replay_port = _port_of(self.replay_endpoint) if self.replay_endpoint else None
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._held = None
        self._buffer.clear()
        self._next_seq = 0
        self._pub, self._replay = self._open_sockets(port, replay_port, retry_s=5.0)
        self.restarts += 1

    def _serve_replay(self, sock: zmq.Socket[bytes]) -> None:
        frames: Sequence[bytes] = sock.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid kv-events replay request with %d frames", len(frames))
            return
        client_id, _, start_raw = frames
        start_seq = int.from_bytes(start_raw, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                sock.send_multipart((client_id, b"", self._topic, seq.to_bytes(8, "big"), payload))
        sock.send_multipart((client_id, b"", b"", END_SEQ, b""))


def now_batch(events: list[Any], data_parallel_rank: int | None = None) -> AnyBatch:
    """A batch of the engine family of `events` (all of one family), stamped now."""
    if events and isinstance(events[0], SglKVCacheEvent):
        return SglKVEventBatch(ts=time.time(), events=events, attn_dp_rank=data_parallel_rank)
    return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=data_parallel_rank)
