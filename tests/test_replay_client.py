"""The replay client against a real ROUTER socket answering in both engine layouts."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq
import zmq.asyncio

from ingest.source import END_SEQ, replay
from tests.harness import free_ports


def serve_once(port: int, with_topic: bool, batches: list[tuple[int, bytes]], ready: threading.Event) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    ready.set()
    try:
        if not sock.poll(5000):
            return
        ident, empty, start = sock.recv_multipart()
        assert empty == b""
        first = int.from_bytes(start, "big")
        for seq, payload in batches:
            if seq >= first:
                head = [ident, b"", b"topic"] if with_topic else [ident, b""]
                sock.send_multipart([*head, seq.to_bytes(8, "big"), payload])
        tail = [ident, b"", b""] if with_topic else [ident, b""]
        sock.send_multipart([*tail, END_SEQ, b""])
    finally:
        sock.close(0)
        ctx.term()


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
