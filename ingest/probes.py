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

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import aiohttp

from cortex import engines
from cortex.config import WorkerConfig
from cortex.engines import RankLoad
from ingest import tokenizer_parity

_PLAIN: Mapping[str, Any] = MappingProxyType({})
"""No TLS arguments: an http worker (an https one gets cortex/upstream_tls.py WorkerTls.kwargs)."""

LoadByRank = dict[int, RankLoad]
"""(running, waiting, activity) per data-parallel rank; activity is the engine's cumulative work counter."""


@dataclass(frozen=True, slots=True)
class HealthReading:
    ok: bool
    """The probe passed (200 within the timeout)."""
    bootstrap_port: int | None = None
    """An SGLang prefill's bootstrap port, when it was asked for and read (None: not read this time)."""


async def read_load(session: aiohttp.ClientSession, cfg: WorkerConfig, timeout: float,
                    tls: Mapping[str, Any] = _PLAIN) -> LoadByRank:
    """One load reading of the worker, per rank, from its engine's load endpoint (cortex.engines: vLLM
    `/metrics`, SGLang `/v1/loads`). Raises on any failure (the caller counts it and goes on)."""
    engine = engines.adapter(cfg.engine)
    async with session.get(f"{cfg.url}{engine.load_path}", timeout=aiohttp.ClientTimeout(total=timeout),
                           **tls) as resp:
        resp.raise_for_status()
        return engine.parse_load(await resp.read())


async def probe_health(session: aiohttp.ClientSession, url: str, timeout: float, *,
                       bootstrap_port_info: tuple[str, str] | None = None,
                       tls: Mapping[str, Any] = _PLAIN) -> HealthReading:
    """One health probe; every expected failure (refused, timed out, non-200, a certificate that fails the
    upstream_tls check: aiohttp's ClientSSLError) is a failed reading."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout), **tls) as r:
            ok = r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        ok = False
    port = None
    if ok and bootstrap_port_info is not None:
        # Read, not assumed (engines.md §1.3): a decode told the wrong port waits for a KV that never comes.
        path, key = bootstrap_port_info
        try:
            async with session.get(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=timeout), **tls) as r:
                info = await r.json(content_type=None) if r.status == 200 else {}
            found = info.get(key) if isinstance(info, dict) else None
            if isinstance(found, int) and not isinstance(found, bool) and 0 < found < 65536:
                port = found
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            pass  # asked again at the next probe; until then the worker is not paired
    return HealthReading(ok=ok, bootstrap_port=port)


async def check_tokens(session: aiohttp.ClientSession, cfg: WorkerConfig,
                       expected: list[tuple[dict[str, Any], list[int]]], timeout: float,
                       tls: Mapping[str, Any] = _PLAIN) -> tuple[str, str]:
    """(status, reason) of one tokenizer parity check; a check that raised is `unknown` (asked again soon)."""
    try:
        return await tokenizer_parity.check(session, cfg.url, cfg.engine, cfg.model, expected, timeout, tls=tls)
    except Exception as exc:  # counted as unanswered; checked again in 10 s
        return tokenizer_parity.UNKNOWN, repr(exc)
