"""The decision over plain HTTP (extproc.transport: http): one POST per request from Envoy's Lua caller
(cortex/decide.lua), and its end (docs/architecture.md, "The decision over HTTP").

Each request's ext_proc machine runs here as on a gRPC stream (`ExtProc.process`, fed the messages Envoy would
have sent: extproc/http_exchange.py), so every limit, refusal, claim and body change is the same code. Python's
gRPC costs a stream per request (~1-3 ms of added latency on this host: docs/performance.md); one HTTP/1.1
exchange on a kept connection costs a third of it.

The request stays open, holding what it reserved (its in-flight count, its tenant's concurrency slot), until its
end: the Lua caller posts it once the answer's last byte passed, and Envoy's access log sends this process the entry
of every request it decided (cortex/envoy_config.py), which is how the end of a request whose client left arrives.
The first of the two is fed to the machine as the response's headers (the worker that served, its status: the
breakers, a retry's count) and the stream is closed, as a gRPC stream is when its request ends; the second is
ignored. An end that comes before its decision finished (the client left meanwhile) is kept a while and ends the
request as soon as it is decided. A request whose end never comes (an Envoy that died) is released after
`ORPHAN_AFTER_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from multidict import CIMultiDict

from cortex import headers as H
from cortex.api_paths import DECIDE_PATH, END_PATH, HEALTH_PATH
from extproc import http_exchange, isolation, metrics
from extproc.answers import claim_facts
from extproc.responses import claim_headers
from extproc.server import ExtProc
from extproc.stream_state import StreamState

log = logging.getLogger("cortex.extproc")

EARLY_ENDS = 4096
"""Ends kept that came before their decision (a client that left while it was decided), oldest dropped first."""
EARLY_END_TTL_S = 60.0
DONE_KEPT = 65536
"""Ends remembered (an id, ~100 bytes each): more than the access log's 50 ms flush ever trails the caller by."""
ORPHAN_AFTER_S = 3600.0
"""A decided request with no end this long is released: its Envoy's access-log entry was lost (Envoy died). No
request timeout bounds a generation (timeouts: none by default), so this is generous."""


@dataclass(slots=True)
class Open:
    """A decided request, waiting for its end."""

    feed: asyncio.Queue[pb.ProcessingRequest | None]
    drain: asyncio.Task[None]
    since: float = field(default_factory=time.monotonic)


class HttpDecisions:
    def __init__(self, app: ExtProc) -> None:
        self.app = app
        self.open: dict[str, Open] = {}
        self.early: OrderedDict[str, float] = OrderedDict()
        self.done: OrderedDict[str, None] = OrderedDict()
        """Requests ended lately: the access log's word after the Lua caller's is not an early end."""

    # -- the decision --------------------------------------------------------------------------------------

    async def decide(self, request: web.Request) -> web.Response:
        body = await request.read()
        rid = request.headers.get("x-request-id", "")
        head, body_message = http_exchange.messages(request.headers.items(), body)
        feed: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        feed.put_nowait(head)
        st = StreamState(gen=self.app.source.current)

        async def requests() -> AsyncIterator[pb.ProcessingRequest]:
            while (message := await feed.get()) is not None:
                yield message

        answers = self.app.process(requests(), None, st)
        got: list[pb.ProcessingResponse] = []
        try:
            first = await anext(answers)
            got.append(first)
            if not first.HasField("immediate_response") and not head.request_headers.end_of_stream:
                feed.put_nowait(body_message)
                while True:
                    a = await anext(answers)
                    got.append(a)
                    if a.WhichOneof("response") in ("request_body", "immediate_response"):
                        break
        except BaseException:
            await _close(feed, answers)
            raise
        out = http_exchange.answer(got, **self._claims(st))
        if got[-1].HasField("immediate_response"):
            await _close(feed, answers)  # refused: nothing is held past the answer (a gRPC stream ends there too)
        else:
            self._hold(rid, feed, answers)
        return web.Response(status=out.status, headers=CIMultiDict(out.headers), body=out.body)

    def _claims(self, st: StreamState) -> dict[str, Any]:
        """What the caller puts on the client's response: the claim headers if the chosen worker serves, those if
        another does (Envoy retried: no hit), that worker's address, and the claim's facts for the observation; or,
        for a client that may not see routing, nothing."""
        d = st.decision
        if st.pd is not None:
            return {}
        chosen = d.chosen.address if d is not None else ""
        headers = claim_headers(self.app.act, st, chosen)
        facts = claim_facts(headers)
        if not (self.app.act.cfg_of(st).extproc.routing_headers and isolation.sees_routing(st.tenant)):
            return {"facts": facts, "hide": True}
        retried = []
        if d is not None and len(d.order) > 1:
            # As extproc/responses.py claims for the next listed worker; the caller puts the served one's id in.
            retried = _pairs(claim_headers(self.app.act, st, d.order[1].address))
        return {"client": _pairs(headers), "chosen": chosen or None, "facts": facts, "retried": retried}

    def _hold(self, rid: str, feed: asyncio.Queue[pb.ProcessingRequest | None], answers: Any) -> None:
        async def drain() -> None:
            with contextlib.suppress(StopAsyncIteration):
                async for _ in answers:
                    pass

        task = asyncio.get_running_loop().create_task(drain())
        if rid in self.early:
            del self.early[rid]
            feed.put_nowait(None)  # it ended while it was decided
            return
        if rid in self.open or not rid:
            # No id (or one seen twice): its end cannot be told apart; release it now, as a failed exchange would.
            log.warning("decided a request without a unique x-request-id: its reservation is released at once")
            feed.put_nowait(None)
            return
        self.open[rid] = Open(feed, task)

    # -- the end -------------------------------------------------------------------------------------------

    async def end_http(self, request: web.Request) -> web.Response:
        """The Lua caller's word that a request's answer ended."""
        status = request.headers.get(http_exchange.STATUS, "0")
        self.end(request.headers.get("x-request-id", ""), int(status) if status.isdigit() else 0,
                 request.headers.get(H.SERVED, ""), "caller")
        return web.Response(status=204)

    def end(self, rid: str, status: int, served: str, source: str) -> None:
        """Request `rid` ended with `status`, served by `served` ('' if no worker): the Lua caller says so once its
        answer's end passed, Envoy's access log for every request (so twice for most)."""
        held = self.open.pop(rid, None)
        if held is None:
            if rid in self.done:
                return
            metrics.HTTP_ENDS.labels("early").inc()
            self.early[rid] = time.monotonic()
            while len(self.early) > EARLY_ENDS:
                self.early.popitem(last=False)
            return
        if status:
            # As Envoy's response-headers message would say it: the breakers, a retry's count.
            message = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap(headers=[
                HeaderValue(key=":status", raw_value=str(status).encode())])))
            if served:
                message.attributes["envoy.filters.http.ext_proc"].CopyFrom(struct_pb2.Struct(
                    fields={"upstream.address": struct_pb2.Value(string_value=served)}))
            held.feed.put_nowait(message)
        # No status: no answer came (the client left first, or the end was lost); a gRPC stream then closes with no
        # response phase either.
        held.feed.put_nowait(None)
        metrics.HTTP_ENDS.labels(source).inc()
        self.done[rid] = None
        while len(self.done) > DONE_KEPT:
            self.done.popitem(last=False)

    async def access_log(self, requests: AsyncIterator[als_pb2.StreamAccessLogsMessage],
                         _context: grpc.aio.ServicerContext) -> als_pb2.StreamAccessLogsResponse:
        async for message in requests:
            for entry in message.http_logs.log_entry:
                status = entry.response.response_code.value if entry.response.HasField("response_code") else 0
                up = entry.common_properties.upstream_remote_address
                served = (f"{up.socket_address.address}:{up.socket_address.port_value}"
                          if up.HasField("socket_address") else "")
                self.end(entry.request.request_id, status, served, "access_log")
        return als_pb2.StreamAccessLogsResponse()

    def upkeep(self, longest_s: float = ORPHAN_AFTER_S) -> None:
        """Forget early ends past their time; close requests with no end after `longest_s`."""
        now = time.monotonic()
        while self.early and next(iter(self.early.values())) < now - EARLY_END_TTL_S:
            self.early.popitem(last=False)
        for rid in [r for r, o in self.open.items() if now - o.since > longest_s]:
            log.warning("no end came for a request decided %.0f s ago: its reservation is released", longest_s)
            self.end(rid, 0, "", "orphaned")

    def runner(self, serving: Callable[[], bool] = lambda: True) -> web.AppRunner:
        """The decision endpoint's runner. A caller that goes away (the client left, Envoy reset the call) cancels
        its handler, as a reset gRPC stream does: a request waiting in the room gives its seat back. `serving`: the
        process's health, which Envoy's check of the endpoint reads (out until it has read ingest's view)."""
        return web.AppRunner(self.app_routes(serving), access_log=None, handler_cancellation=True)

    def app_routes(self, serving: Callable[[], bool] = lambda: True) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            return web.Response(status=200 if serving() else 503)

        app = web.Application(client_max_size=self.app.cfg.extproc.max_body_bytes + (1 << 20))
        app.router.add_post(DECIDE_PATH, self.decide)
        app.router.add_post(END_PATH, self.end_http)
        app.router.add_get(HEALTH_PATH, health)
        return app


def _pairs(headers: list[HeaderValueOption]) -> list[tuple[str, str]]:
    return [(h.header.key, h.header.raw_value.decode("latin-1")) for h in headers]


async def _close(feed: asyncio.Queue[pb.ProcessingRequest | None], answers: Any) -> None:
    """End a request's stream now: its machine sees the stream close and releases what it held."""
    feed.put_nowait(None)
    with contextlib.suppress(StopAsyncIteration, Exception):
        await anext(answers)
    await answers.aclose()
