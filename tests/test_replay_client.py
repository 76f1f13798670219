"""The replay client against a real ROUTER socket answering in both engine layouts."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio

from ingest.source import END_SEQ, replay
from tests.harness import free_ports


@contextlib.contextmanager
def replay_request(port: int, ready: threading.Event) -> Iterator[tuple[zmq.Socket, list[bytes]] | None]:
    """A ROUTER on `port` and the first replay request it receives (None after 5 s without one)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    ready.set()
    try:
        yield (sock, sock.recv_multipart()) if sock.poll(5000) else None
    finally:
        sock.close(0)
        ctx.term()


def serve_once(port: int, with_topic: bool, batches: list[tuple[int, bytes]], ready: threading.Event) -> None:
    with replay_request(port, ready) as got:
        if got is None:
            return
        sock, (ident, empty, start) = got
        assert empty == b""
        first = int.from_bytes(start, "big")
        for seq, payload in batches:
            if seq >= first:
                head = [ident, b"", b"topic"] if with_topic else [ident, b""]
                sock.send_multipart([*head, seq.to_bytes(8, "big"), payload])
        tail = [ident, b"", b""] if with_topic else [ident, b""]
        sock.send_multipart([*tail, END_SEQ, b""])


@pytest.mark.parametrize("with_topic", [True, False], ids=["vllm>=0.26", "older"])
def test_both_reply_layouts(with_topic: bool) -> None:
    (port,) = free_ports(1)
    ready = threading.Event()
    batches = [(3, b"c"), (4, b"d"), (5, b"e")]
    t = threading.Thread(target=serve_once, args=(port, with_topic, batches, ready))
    t.start()
    ready.wait(5)
    got, complete = asyncio.run(replay(zmq.asyncio.Context.instance(), f"tcp://127.0.0.1:{port}", 4))
    t.join(5)
    assert complete and got == [(4, b"d"), (5, b"e")]


def test_silent_replay_socket_times_out() -> None:
    (port,) = free_ports(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    try:
        got, complete = asyncio.run(replay(zmq.asyncio.Context.instance(), f"tcp://127.0.0.1:{port}", 0,
                                           timeout_s=0.3))
        assert got == [] and not complete
    finally:
        sock.close(0)
        ctx.term()


def serve_slowly(port: int, batches: int, gap_s: float, ready: threading.Event) -> None:
    """A ROUTER answering a replay from 0 with `batches` batches, `gap_s` apart: a large buffer on a slow link."""
    with replay_request(port, ready) as got:
        if got is None:
            return
        sock, (ident, _, _) = got
        for seq in range(batches):
            sock.send_multipart([ident, b"", b"topic", seq.to_bytes(8, "big"), b"x"])
            time.sleep(gap_s)
        sock.send_multipart([ident, b"", b"", END_SEQ, b""])


def test_a_replay_that_keeps_streaming_is_not_cut() -> None:
    """A replica started late replays the engine's whole buffer (10 000 batches, tens of MB by default), which
    can take longer than the replay timeout. The timeout is for a silent socket: a replay that keeps sending
    must be read to its end, or the late replica drops everything it received and starts cold."""
    (port,) = free_ports(1)
    ready = threading.Event()
    t = threading.Thread(target=serve_slowly, args=(port, 60, 0.025, ready))  # ~1.5 s in all, never 1 s silent
    t.start()
    ready.wait(5)
    got, complete = asyncio.run(replay(zmq.asyncio.Context.instance(), f"tcp://127.0.0.1:{port}", 0,
                                       timeout_s=1.0))
    t.join(10)
    assert complete and [seq for seq, _ in got] == list(range(60))
