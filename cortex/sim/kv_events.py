"""vLLM 0.33 KV-cache events: the wire schema and a ZMQ publisher that behaves like vLLM's.

Schema first, because it is the contract (kv-events.md §2): events are msgspec Structs with
``tag=True, omit_defaults=True`` (msgpack maps tagged ``"type"``, required fields always present, defaulted
fields omitted when default) and the batch is ``array_like=True`` (``[ts, events, data_parallel_rank]``,
msgspec 0.23 keeps the trailing rank). Field order and defaults match ``vllm/distributed/kv_events.py`` so
the encoded bytes are identical to the engine's.

Transport (§1): a PUB socket sends ``[topic, seq (8 B big-endian, from 0), payload]`` per batch; an optional
ROUTER answers ``[identity, b"", start_seq]`` with every buffered batch ``seq >= start_seq`` as
``[identity, b"", topic, seq, payload]`` and then the end marker ``[identity, b"", b"", ff*8, b""]``.

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
from itertools import count
from typing import Any, Protocol

import msgspec
import zmq

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- schema ---------------------------------------------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Strict decode into this schema (for tests and tools; a gateway should decode leniently)."""
    return _decoder.decode(payload)


# --- publishers -----------------------------------------------------------------------------------


class EventPublisher(Protocol):
    """Delivery contract: batches go out in publish() order with seq 0, 1, 2, ... per publisher
    lifetime; live delivery is best effort (PUB drops for slow joiners), replay covers the last
    `buffer_steps` batches."""

    endpoint: str | None
    replay_endpoint: str | None

    def publish(self, batch: KVEventBatch) -> None: ...

    def flush(self, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...


class NullEventPublisher:
    """Events disabled: the engine still produces them and nobody sends them (no ``if enabled`` checks)."""

    endpoint: str | None = None
    replay_endpoint: str | None = None

    def publish(self, batch: KVEventBatch) -> None:
        return None

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        return None


def _bind(sock: zmq.Socket[bytes], host: str, port: int) -> str:
    # Port 0 asks the OS for a port; zmq spells that "*" and reports the result in LAST_ENDPOINT.
    sock.bind(f"tcp://{host}:{port if port else '*'}")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class ZmqEventPublisher:
    """vLLM's ``ZmqEventPublisher``: PUB + optional replay ROUTER, served by one background thread."""

    def __init__(self, port: int, *, host: str = "127.0.0.1", replay_port: int | None = None,
                 topic: str = "", buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, data_parallel_rank: int = 0,
                 poll_interval: float = 0.1) -> None:
        self._topic = topic.encode()
        self._dp_rank = data_parallel_rank
        # vLLM blocks up to 0.1 s for the next batch, which bounds replay latency; kept configurable.
        self._poll_interval = poll_interval
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.endpoint: str | None = _bind(self._pub, host, port)
            self.replay_endpoint: str | None = None
            if replay_port is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self.replay_endpoint = _bind(self._replay, host, replay_port)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._closed = False
        # Counts let flush() wait for a signal instead of a sleep.
        self._progress = threading.Condition()
        self._published = 0
        self._handled = 0
        self._thread = threading.Thread(target=self._run, name="zmq-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if self._closed:
            raise RuntimeError("publisher is closed")
        with self._progress:
            self._published += 1
        self._queue.put(batch)

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
        self._ctx.term()

    def _run(self) -> None:
        seq_gen = count()
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay(self._replay)
                except zmq.ZMQError:
                    log.exception("kv-events replay failed")
            try:
                batch = self._queue.get(timeout=self._poll_interval)
            except queue.Empty:
                continue
            if batch is None:
                return
            if batch.data_parallel_rank is None:
                batch.data_parallel_rank = self._dp_rank
            try:
                payload = encoder.encode(batch)
                seq = next(seq_gen)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
                self._buffer.append((seq, payload))
            except Exception:
                # One bad batch must not kill the stream; vLLM logs and carries on too.
                log.exception("kv-events publish failed")
            with self._progress:
                self._handled += 1
                self._progress.notify_all()

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


def now_batch(events: list[BlockStored | BlockRemoved | AllBlocksCleared],
              data_parallel_rank: int | None = None) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=data_parallel_rank)
