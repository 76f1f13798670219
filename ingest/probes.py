"""Probes: each asks one worker one question over HTTP and returns a reading; none writes into a worker.

The readings land in one place, ingest/workers.py (`Worker.apply_health`, `apply_load`, `apply_tokens`), and
the service (ingest/service.py) decides when to ask and what a change means (publish, prune, log).

- health: `GET /health` (200 = passed); a prefill whose engine pairs by bootstrap port (SGLang) also reads
  that port where its adapter says (`bootstrap_port_info`: SGLang's `/server_info`).
- load: the engine adapter's load endpoint and parser (cortex/engines: vLLM `/metrics`, SGLang `/v1/loads`),
  running and waiting requests per DP rank plus a cumulative work counter.
- tokenizer parity: the engine's own tokenize endpoint against Cortex's ids (ingest/tokenizer_parity.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from cortex import engines
from cortex.config import WorkerConfig
from cortex.engines import RankLoad
from ingest import tokenizer_parity

LoadByRank = dict[int, RankLoad]
"""(running, waiting, activity) per data-parallel rank; activity is the engine's cumulative work counter."""


@dataclass(frozen=True, slots=True)
class HealthReading:
    ok: bool
    """The probe passed (200 within the timeout)."""
    bootstrap_port: int | None = None
    """An SGLang prefill's bootstrap port, when it was asked for and read (None: not read this time)."""


async def read_load(session: aiohttp.ClientSession, cfg: WorkerConfig, timeout: float) -> LoadByRank:
    """One load reading of the worker, per rank, from its engine's load endpoint (cortex.engines: vLLM
    `/metrics`, SGLang `/v1/loads`). Raises on any failure (the caller counts it and goes on)."""
    engine = engines.adapter(cfg.engine)
    async with session.get(f"{cfg.url}{engine.load_path}", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        resp.raise_for_status()
        return engine.parse_load(await resp.read())


class LoadReader:
    """A worker's load readings over one kept-alive HTTP/1.1 connection, with a pre-built request.

    The same GET as `read_load`, at a fraction of aiohttp's CPU per request (issue 14: the load poll was the
    largest part of ingest's CPU under load, up to 10 reads per second per worker per replica). Only the plain
    exchange is done here: `http://` URLs, a 2xx answer with a Content-Length or chunked body. Anything else (a
    TLS URL, a redirect, a compressed body, a header block over 64 KiB) hands this worker's reads to
    `read_load` for good, so an unusual server still gets aiohttp's full client."""

    MAX_BODY = 64 << 20
    """A larger load body is refused (a failed reading), as no engine's is anywhere near it."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.engine = engines.adapter(cfg.engine)
        url = urlsplit(f"{cfg.url}{self.engine.load_path}")
        self.plain = url.scheme == "http" and url.hostname is not None and not url.username
        self.host, self.port = url.hostname or "", url.port or 80
        target = url.path + (f"?{url.query}" if url.query else "")
        self.request = (f"GET {target} HTTP/1.1\r\nHost: {url.netloc}\r\nAccept: */*\r\n"
                        "User-Agent: cortex-ingest\r\n\r\n").encode("latin-1")
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None

    async def read(self, session: aiohttp.ClientSession, timeout: float) -> LoadByRank:
        if not self.plain:
            return await read_load(session, self.cfg, timeout)
        try:
            async with asyncio.timeout(timeout):
                status, body = await self._get()
        except _Unusual:
            self.close()
            self.plain = False
            return await read_load(session, self.cfg, timeout)
        except BaseException:
            self.close()  # a half-read answer must not be taken for the next one's
            raise
        if not 200 <= status < 300:  # the answer was read whole: the connection stays usable
            raise ValueError(f"{self.engine.load_path} answered {status}")
        return self.engine.parse_load(body)

    async def _get(self) -> tuple[int, bytes]:
        reused = self._conn is not None
        if self._conn is None:
            self._conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._conn
        try:
            writer.write(self.request)
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
            if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                raise
            # The server closed the idle connection (its keep-alive ran out) before answering: once more, on a
            # new connection (a GET of the load is safe to repeat).
            self.close()
            return await self._get()
        except asyncio.LimitOverrunError as exc:
            raise _Unusual("header block too long") from exc
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        status = int(rest[:3]) if rest[:3].isdigit() else 0
        if not version.startswith("HTTP/1.") or status < 100:
            raise ValueError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip().lower()
        if status < 200 or 300 <= status < 400 or headers.get("content-encoding", "identity") != "identity":
            raise _Unusual(f"status {status}, content-encoding {headers.get('content-encoding')}")
        if "chunked" in headers.get("transfer-encoding", ""):
            body = await self._chunked(reader)
        elif "content-length" in headers:
            length = int(headers["content-length"])
            if not 0 <= length <= self.MAX_BODY:
                raise ValueError(f"load body of {length} bytes")
            body = await reader.readexactly(length)
        else:
            raise _Unusual("neither a Content-Length nor a chunked body")
        if headers.get("connection") == "close" or version == "HTTP/1.0":
            self.close()
        return status, body

    async def _chunked(self, reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers
                return b"".join(parts)
            total += size
            if total > self.MAX_BODY:
                raise ValueError(f"load body over {self.MAX_BODY} bytes")
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)


class _Unusual(Exception):
    """The answer needs more than LoadReader does: aiohttp reads this worker's load from now on."""


async def probe_health(session: aiohttp.ClientSession, url: str, timeout: float, *,
                       bootstrap_port_info: tuple[str, str] | None = None) -> HealthReading:
    """One health probe; every expected failure (refused, timed out, non-200) is a failed reading."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            ok = r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        ok = False
    port = None
    if ok and bootstrap_port_info is not None:
        # Read, not assumed (engines.md §1.3): a decode told the wrong port waits for a KV that never comes.
        path, key = bootstrap_port_info
        try:
            async with session.get(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                info = await r.json(content_type=None) if r.status == 200 else {}
            found = info.get(key) if isinstance(info, dict) else None
            if isinstance(found, int) and not isinstance(found, bool) and 0 < found < 65536:
                port = found
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            pass  # asked again at the next probe; until then the worker is not paired
    return HealthReading(ok=ok, bootstrap_port=port)


async def check_tokens(session: aiohttp.ClientSession, cfg: WorkerConfig,
                       expected: list[tuple[dict[str, Any], list[int]]], timeout: float) -> tuple[str, str]:
    """(status, reason) of one tokenizer parity check; a check that raised is `unknown` (asked again soon)."""
    try:
        return await tokenizer_parity.check(session, cfg.url, cfg.engine, cfg.model, expected, timeout)
    except Exception as exc:  # counted as unanswered; checked again in 10 s
        return tokenizer_parity.UNKNOWN, repr(exc)
