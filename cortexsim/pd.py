"""SGLang PD disaggregation for the simulator: the prefill's bootstrap server and the room rendezvous.

Real SGLang (engines.md §1): a router sends the same body, carrying ``bootstrap_host``/``bootstrap_port``/
``bootstrap_room``, to a prefill and a decode server at once. The prefill keeps the request in its bootstrap
queue until the decode for that room has connected through the bootstrap server, then prefills and pushes
the KV; the decode waits for "transfer done" and then decodes. A prefill whose decode never comes fails
after ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``; a decode whose KV never arrives fails after
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, both with HTTP 500.

Here the prefill worker serves the real bootstrap routes (``/health``, ``/route``, ``/register_dp_rank``,
``/query_dp_ranks``) on its bootstrap port plus one simulator route standing in for the KV transfer:
``POST /sim/pd/transfer {"room": R, "timeout": s}`` registers the decode for room R and answers once that
room's prefill finished, with what the decode needs to continue (prompt length, the prefill's cached-token
count). ``Rooms`` is the rendezvous table behind it; either leg may arrive first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from cortexsim.openai_api import json_response

log = logging.getLogger("cortex.sim.pd")  # its name in log lines, kept across the move

# SGLang's health probes on PD servers use this host with room 0 and a fake transfer.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


class TransferError(RuntimeError):
    """The decode leg did not get its KV; `phase` is "handshake" or "transfer", as SGLang names them."""

    def __init__(self, phase: str, message: str) -> None:
        super().__init__(message)
        self.phase = phase


@dataclass
class _Room:
    decode_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future[dict[str, Any]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class Rooms:
    """Rendezvous of the prefill and decode legs of each bootstrap room, on the prefill worker."""

    def __init__(self) -> None:
        self._rooms: dict[int, _Room] = {}

    def __len__(self) -> int:
        return len(self._rooms)

    def _room(self, room: int) -> _Room:
        entry = self._rooms.get(room)
        if entry is None:
            entry = self._rooms[room] = _Room()
        return entry

    async def wait_for_decode(self, room: int, timeout: float) -> bool:
        """Prefill leg: block in the bootstrap queue until the decode connected; False on timeout."""
        entry = self._room(room)
        try:
            await asyncio.wait_for(entry.decode_arrived.wait(), timeout)
            return True
        except TimeoutError:
            self.fail(room, "the prefill request timed out waiting for its decode (bootstrap timeout)")
            return False

    def complete(self, room: int, info: dict[str, Any]) -> None:
        entry = self._rooms.get(room)
        if entry is not None and not entry.result.done():
            entry.result.set_result(info)

    def fail(self, room: int, reason: str) -> None:
        entry = self._rooms.pop(room, None)
        if entry is not None and not entry.result.done():
            entry.result.set_exception(TransferError("transfer", reason))
            entry.result.exception()  # mark retrieved: a decode may never ask

    async def transfer(self, room: int, timeout: float) -> dict[str, Any]:
        """Decode leg (via the bootstrap route): announce, then wait for the prefill's KV."""
        entry = self._room(room)
        entry.decode_arrived.set()
        try:
            return await asyncio.wait_for(asyncio.shield(entry.result), timeout)
        finally:
            # Done or given up: either way nobody will ask for this room again.
            if self._rooms.get(room) is entry:
                del self._rooms[room]


class BootstrapServer:
    """The prefill's bootstrap HTTP server (``CommonKVBootstrapServer`` routes plus the simulated transfer)."""

    def __init__(self, rooms: Rooms, host: str, port: int) -> None:
        self.rooms = rooms
        self.host = host
        self._requested_port = port
        self.port = 0
        self._routes_table: dict[str, Any] = {}
        self._dp_ranks: dict[str, Any] = {}
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        sock = socket.create_server((self.host, self._requested_port))
        self.port = sock.getsockname()[1]
        app = web.Application()
        app.add_routes([
            web.get("/health", self._health),
            web.get("/route", self._get_route),
            web.put("/route", self._put_route),
            web.post("/register_dp_rank", self._register_dp_rank),
            web.post("/query_dp_ranks", self._query_dp_ranks),
            web.post("/sim/pd/transfer", self._transfer),
        ])
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        try:
            await web.SockSite(self._runner, sock).start()
        except BaseException:
            sock.close()
            raise

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _get_route(self, request: web.Request) -> web.Response:
        return json_response(self._routes_table)

    async def _put_route(self, request: web.Request) -> web.Response:
        with contextlib.suppress(ValueError):
            self._routes_table.update(await request.json())
        return web.Response(text="OK")

    async def _register_dp_rank(self, request: web.Request) -> web.Response:
        with contextlib.suppress(ValueError):
            self._dp_ranks.update(await request.json())
        return web.Response(text="OK")

    async def _query_dp_ranks(self, request: web.Request) -> web.Response:
        return json_response(self._dp_ranks)

    async def _transfer(self, request: web.Request) -> web.Response:
        body = await request.json()
        room, timeout = body.get("room"), body.get("timeout", 300.0)
        if isinstance(room, bool) or not isinstance(room, int):
            return json_response({"error": "room must be an integer"}, status=400)
        try:
            info = await self.rooms.transfer(room, float(timeout))
        except TimeoutError:
            return json_response({"error": f"no prefill for room {room} within {timeout}s"}, status=504)
        except TransferError as exc:
            return json_response({"error": str(exc)}, status=502)
        return json_response(info)


async def fetch_kv(host: str, port: int, room: int, timeout: float) -> dict[str, Any]:
    """Decode leg: connect to the prefill's bootstrap server and wait up to `timeout` for the room's KV."""
    url = f"http://{host}:{port}/sim/pd/transfer"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout + 5.0)) as http, \
                http.post(url, json={"room": room, "timeout": timeout}) as resp:
            data = await resp.json(content_type=None)
            if resp.status == 200:
                return dict(data)
            if resp.status == 504:
                raise TransferError("transfer", f"KV transfer for bootstrap_room={room} timed out "
                                                f"after {timeout}s (waiting timeout)")
            raise TransferError("transfer", f"prefill for bootstrap_room={room} failed: {data.get('error')}")
    except aiohttp.ClientConnectionError as exc:
        raise TransferError("handshake", f"cannot reach the bootstrap server {host}:{port}: {exc}") from None
    except TimeoutError:
        raise TransferError("transfer", f"KV transfer for bootstrap_room={room} timed out "
                                        f"after {timeout}s (waiting timeout)") from None
