"""One end of an event shard's PAIR connection on the asyncio loop (ingest/shards.py, ingest/event_shard.py).

A ZMQ socket's FD is edge-triggered, and any operation on the socket (a send too) may take the edge that says a
message arrived: a reader that waits on the FD after its own end sent something can then sleep with messages queued
(a pyzmq asyncio receive beside synchronous sends did, holding reports for seconds). So the pipe owns its socket:
sends are synchronous, every send is followed by a drain, and a drain reads until ZMQ_EVENTS says nothing is left
(reading it re-arms the FD), as the event streams do (ingest/source.py `EventSource._watch`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

import zmq

from ingest.source import unwatch_and_close

log = logging.getLogger("cortex.ingest")

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
DRAIN_MAX = 256
"""Frames handled per turn of the loop; the rest wait for the next turn, so a flood never starves the loop."""


class Pipe:
    def __init__(self, sock: zmq.Socket[Any], on_frame: Callable[[bytes], None]) -> None:
        self.sock = sock
        self.on_frame = on_frame
        self.loop = asyncio.get_running_loop()
        self.fd = cast(int, sock.getsockopt(zmq.FD))
        self._soon = False
        self.closed = False
        self.loop.add_reader(self.fd, self.drain)
        self._schedule()

    def send(self, frame: bytes, flags: int = 0) -> None:
        """Raises zmq.Again when the frame cannot go (no peer yet with NOBLOCK, or the send timed out)."""
        try:
            self.sock.send(frame, flags)
        finally:
            self._schedule()

    def _schedule(self) -> None:
        if not self._soon and not self.closed:
            self._soon = True
            self.loop.call_soon(self.drain)

    def drain(self) -> None:
        self._soon = False
        for _ in range(DRAIN_MAX):
            if self.closed or not cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN:
                return
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.on_frame(frame)
            except Exception:  # one bad frame is logged; the ones behind it are still read
                log.exception("event shard pipe: a frame could not be handled")
        self._schedule()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            unwatch_and_close(self.loop, self.fd, self.sock)
