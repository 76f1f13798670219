"""Probes: each asks one worker one question over HTTP and returns a reading; none writes into a worker.

The readings land in one place, ingest/workers.py (`Worker.apply_health`, `apply_load`, `apply_tokens`), and
the service (ingest/service.py) decides when to ask and what a change means (publish, prune, log).

- health: `GET /health` (200 = passed); an SGLang prefill also reads its bootstrap port from `/server_info`.
- load: vLLM `/metrics` (`vllm:num_requests_running` / `_waiting`, per `engine` label = DP rank) and SGLang
  `/v1/loads` (`num_running_reqs` / `num_waiting_reqs` per `dp_rank`), plus a cumulative work counter each.
- tokenizer parity: the engine's own tokenize endpoint against Cortex's ids (ingest/tokenizer_parity.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import aiohttp

from cortex.config import WorkerConfig
from ingest import tokenizer_parity

LoadByRank = dict[int, tuple[float, float, float]]
"""(running, waiting, activity) per data-parallel rank; activity is the engine's cumulative work counter."""


@dataclass(frozen=True, slots=True)
class HealthReading:
    ok: bool
    """The probe passed (200 within the timeout)."""
    bootstrap_port: int | None = None
    """An SGLang prefill's bootstrap port, when it was asked for and read (None: not read this time)."""


_VLLM_SERIES = re.compile(
    rb'^vllm:(num_requests_running|num_requests_waiting|prefix_cache_queries_total)(?:\{([^}]*)\})?\s+(\S+)', re.M)
_ENGINE_LABEL = re.compile(rb'engine="(\d+)"')
_VLLM_INDEX = {b"num_requests_running": 0, b"num_requests_waiting": 1, b"prefix_cache_queries_total": 2}


def parse_vllm_metrics(text: bytes) -> LoadByRank:
    """(running, waiting, activity) per DP rank (vLLM's `engine` label; 0 when absent). Activity is a
    cumulative counter (prompt tokens looked up in the prefix cache) that moves whenever a request ran."""
    out: dict[int, list[float]] = {}
    for name, labels, value in _VLLM_SERIES.findall(text):
        m = _ENGINE_LABEL.search(labels or b"")
        rank = int(m.group(1)) if m else 0
        out.setdefault(rank, [0.0, 0.0, 0.0])[_VLLM_INDEX[name]] += float(value)
    return {r: (v[0], v[1], v[2]) for r, v in out.items()}


def parse_sglang_loads(doc: Any) -> LoadByRank:
    """Same shape from SGLang's /v1/loads; activity is its cumulative prefill-token count."""
    loads = doc.get("loads", []) if isinstance(doc, dict) else []
    out: LoadByRank = {}
    for e in loads:
        if isinstance(e, dict):
            rank = int(e.get("dp_rank") or 0)
            prev = out.get(rank, (0.0, 0.0, 0.0))
            out[rank] = (prev[0] + float(e.get("num_running_reqs", 0)), prev[1] + float(e.get("num_waiting_reqs", 0)),
                         prev[2] + float(e.get("total_prefill_uncached_tokens", 0)))
    return out


async def read_load(session: aiohttp.ClientSession, cfg: WorkerConfig, timeout: float) -> LoadByRank:
    """One load reading of the worker, per rank. Raises on any failure (the caller counts and goes on)."""
    t = aiohttp.ClientTimeout(total=timeout)
    if cfg.engine == "sglang":
        async with session.get(f"{cfg.url}/v1/loads", timeout=t) as resp:
            resp.raise_for_status()
            return parse_sglang_loads(await resp.json(content_type=None))
    async with session.get(f"{cfg.url}/metrics", timeout=t) as resp:
        resp.raise_for_status()
        return parse_vllm_metrics(await resp.read())


async def probe_health(session: aiohttp.ClientSession, url: str, timeout: float, *,
                       want_bootstrap_port: bool = False) -> HealthReading:
    """One health probe; every expected failure (refused, timed out, non-200) is a failed reading."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            ok = r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        ok = False
    port = None
    if ok and want_bootstrap_port:
        # Read, not assumed (engines.md §1.3): a decode told the wrong port waits for a KV that never comes.
        try:
            async with session.get(f"{url}/server_info", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                info = await r.json(content_type=None) if r.status == 200 else {}
            found = info.get("disaggregation_bootstrap_port") if isinstance(info, dict) else None
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
