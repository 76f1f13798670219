"""ingest.probes.LoadReader: the load poll's kept-alive HTTP/1.1 GET reads what aiohttp would, and hands anything
unusual to aiohttp (issue 14). Real sockets on loopback: a scripted asyncio server for each answer shape, and
the simulator's own /metrics."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from cortex.config import WorkerConfig
from ingest.probes import LoadReader
from tests.sim import simkit

BODY = b'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_waiting{engine="0"} 1.0\n'
Answer = Callable[[int, str], bytes]


def wcfg(port: int) -> WorkerConfig:
    return WorkerConfig(id="w", url=f"http://127.0.0.1:{port}", model="m", engine="vllm")


async def serve(answer: Answer, *, close_after: bool = False) -> tuple[asyncio.Server, dict[str, Any]]:
    """A server answering request n (counted over all connections) for `path` with answer(n, path)."""
    seen: dict[str, Any] = {"connections": 0, "requests": 0, "paths": []}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["connections"] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1].decode()
                seen["paths"].append(path)
                n = seen["requests"]
                seen["requests"] += 1
                writer.write(answer(n, path))
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, seen


def ok(body: bytes = BODY, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def run(answer: Answer, scenario: Callable[[LoadReader, aiohttp.ClientSession, dict[str, Any]], Awaitable[None]],
        **kw: Any) -> None:
    async def main() -> None:
        server, seen = await serve(answer, **kw)
        port = server.sockets[0].getsockname()[1]
        reader = LoadReader(wcfg(port))
        try:
            async with aiohttp.ClientSession() as session:
                await scenario(reader, session, seen)
        finally:
            reader.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_readings_reuse_one_connection() -> None:
    async def scenario(reader: LoadReader, session: aiohttp.ClientSession, seen: dict[str, Any]) -> None:
        for _ in range(5):
            assert await reader.read(session, 2.0) == {0: (2.0, 1.0, 0.0)}
        assert seen["connections"] == 1 and seen["requests"] == 5 and seen["paths"] == ["/metrics"] * 5
        assert reader.plain

    run(lambda n, path: ok(), scenario)


def test_chunked_body_and_connection_close() -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               b"10\r\n" + BODY[:16] + b"\r\n" + f"{len(BODY) - 16:x}".encode() + b";ext=1\r\n" + BODY[16:]
               + b"\r\n0\r\n\r\n")

    async def scenario(reader: LoadReader, session: aiohttp.ClientSession, seen: dict[str, Any]) -> None:
        for _ in range(3):
            assert await reader.read(session, 2.0) == {0: (2.0, 1.0, 0.0)}
        assert seen["connections"] == 3  # the server said close: a new connection each time

    run(lambda n, path: chunked, scenario, close_after=True)


def test_a_server_that_drops_the_idle_connection_is_read_again_on_a_new_one() -> None:
    async def scenario(reader: LoadReader, session: aiohttp.ClientSession, seen: dict[str, Any]) -> None:
        for _ in range(3):
            assert await reader.read(session, 2.0) == {0: (2.0, 1.0, 0.0)}
        assert seen["requests"] == 3 and seen["connections"] == 3

    # Closes after each answer without saying so (an idle keep-alive timeout): the next read meets EOF first.
    run(lambda n, path: ok(), scenario, close_after=True)


def test_an_error_status_is_a_failed_reading_and_the_next_one_works() -> None:
    def answer(n: int, path: str) -> bytes:
        return ok() if n else b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\ndown!"

    async def scenario(reader: LoadReader, session: aiohttp.ClientSession, seen: dict[str, Any]) -> None:
        with pytest.raises(ValueError, match="503"):
            await reader.read(session, 2.0)
        assert await reader.read(session, 2.0) == {0: (2.0, 1.0, 0.0)}
        assert seen["connections"] == 1

    run(answer, scenario)


def test_a_hung_answer_times_out_and_is_not_taken_for_the_next() -> None:
    def answer(n: int, path: str) -> bytes:
        # The first answer stops mid-body (the server then waits for the next request on the connection).
        return ok()[:-10] if n == 0 else ok()

    async def scenario(reader: LoadReader, session: aiohttp.ClientSession, seen: dict[str, Any]) -> None:
        with pytest.raises(TimeoutError):
            await reader.read(session, 0.3)
        assert await reader.read(session, 2.0) == {0: (2.0, 1.0, 0.0)}
        assert seen["connections"] == 2

    run(answer, scenario)


def test_a_redirect_hands_the_worker_to_aiohttp() -> None:
    def answer(n: int, path: str) -> bytes:
        if path == "/metrics":  # vLLM's Prometheus app mounted at /metrics/, as some versions serve it
            return b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /metrics/\r\nContent-Length: 0\r\n\r\n"
        return ok()

    async def scenario(reader: LoadReader, session: aiohttp.ClientSession, seen: dict[str, Any]) -> None:
        assert await reader.read(session, 2.0) == {0: (2.0, 1.0, 0.0)}  # aiohttp followed it
        assert not reader.plain
        assert seen["paths"] == ["/metrics", "/metrics", "/metrics/"]

    run(answer, scenario)


def test_a_compressed_body_hands_the_worker_to_aiohttp() -> None:
    packed = gzip.compress(BODY)

    async def scenario(reader: LoadReader, session: aiohttp.ClientSession, seen: dict[str, Any]) -> None:
        assert await reader.read(session, 2.0) == {0: (2.0, 1.0, 0.0)}
        assert not reader.plain

    run(lambda n, path: ok(packed, "Content-Encoding: gzip\r\n"), scenario)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_simulators_load_endpoint(engine: str) -> None:
    async def scenario(server: Any, http: aiohttp.ClientSession) -> None:
        reader = LoadReader(WorkerConfig(id="w", url=server.base_url, model=simkit.MODEL, engine=engine))
        try:
            for _ in range(3):
                assert await reader.read(http, 2.0) == {0: (0.0, 0.0, 0.0), 1: (0.0, 0.0, 0.0)}
            assert reader.plain
        finally:
            reader.close()

    simkit.serve(scenario, simkit.config(engine=engine, dp_size=2))
