"""What /health/ready answers: whether a request sent now is routed by Cortex.

Ready means all three hold (each is checked live, with sub-second timeouts, when the endpoint is asked):
- the ledger view is live: ingest's heartbeat stamped it within extproc's staleness limit;
- every extproc process serves and reads a live view (gRPC health, service `cortex.ledger_view`);
- Envoy is up: its admin `/ready` answers LIVE and its listener accepts connections.
Each worker's KV-event subscription is reported beside it, but does not decide readiness: one worker whose
publisher is unreachable must not take the whole gateway out of a load balancer (it is routed by load, and
says so in `degraded`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import grpc

from cortex import extproc_tls, grpc_health
from cortex.config import reachable_host
from ingest.subscription import subscription

if TYPE_CHECKING:
    from ingest.service import Ingest

TIMEOUT_S = 0.5

async def _not_ours() -> dict[str, Any]:
    return {"ok": True, "detail": "endpoint picker: the gateway's Envoy is not Cortex's"}


class Readiness:
    def __init__(self, ingest: Ingest, with_envoy: bool = True) -> None:
        self.ingest = ingest
        self.with_envoy = with_envoy
        """False under `cortex epp`: the gateway is someone else's, and its Envoy is not Cortex's to check."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        for ch in self._channels.values():
            with contextlib.suppress(Exception):
                await ch.close()
        if self._session is not None:
            await self._session.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc_health.channel(address)
        return ch

    async def _extproc(self, index: int) -> dict[str, Any]:
        ep = self.ingest.cfg.extproc
        address = extproc_tls.health_address(self.ingest.cfg, index, reachable_host(ep.host))
        ok, detail = await grpc_health.check(self._channel(address), grpc_health.LEDGER_VIEW, TIMEOUT_S)
        return {"index": index, "address": address, "ok": ok, "detail": detail}

    async def _envoy(self) -> dict[str, Any]:
        cfg = self.ingest.cfg
        if self._session is None:
            self._session = aiohttp.ClientSession()
        admin = f"http://{reachable_host(cfg.admin.host)}:{cfg.admin.port}/ready"
        try:
            async with self._session.get(admin, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as r:
                state = (await r.text()).strip()
                if r.status != 200:
                    return {"ok": False, "detail": f"envoy admin /ready: {r.status} {state}"}
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return {"ok": False, "detail": f"envoy admin {admin} not answering ({type(exc).__name__})"}
        host, port = reachable_host(cfg.listen.host), cfg.listen.port
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), TIMEOUT_S)
        except (TimeoutError, OSError) as exc:
            return {"ok": False, "detail": f"envoy listener {host}:{port} not accepting ({type(exc).__name__})"}
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        return {"ok": True, "detail": f"{state}, listener {host}:{port} accepting"}

    async def check(self) -> tuple[bool, dict[str, Any]]:
        ingest = self.ingest
        cfg = ingest.cfg
        age = time.monotonic() - ingest.heartbeat_at if ingest.heartbeat_at else None
        view_ok = age is not None and age <= cfg.extproc.view_stale_after_s
        view = {"ok": view_ok, "heartbeat_age_s": None if age is None else round(age, 3)}
        envoy, *extprocs = await asyncio.gather(self._envoy() if self.with_envoy else _not_ours(),
                                                *(self._extproc(i) for i in range(cfg.extproc.process_count())))
        problems = []
        if not view_ok:
            problems.append("ledger view not live (ingest heartbeat " +
                            ("not started)" if age is None else f"{age:.1f}s old)"))
        problems += [f"extproc {e['index']} ({e['address']}): {e['detail']}" for e in extprocs if not e["ok"]]
        if not envoy["ok"]:
            problems.append(envoy["detail"])
        targets = ingest.targets()
        exact = [t.id for t in targets if t.exact_kv and t.worker.healthy]
        degraded = len(exact) < len(targets)
        body: dict[str, Any] = {
            "status": "not_ready" if problems else "ready",
            **({"reason": "; ".join(problems)} if problems else {}),
            "checks": {"ledger_view": view, "extproc": extprocs, "envoy": envoy},
            "degraded": degraded,
            # Ready with degraded targets still routes safely (by load), and says which and why.
            "detail": ("targets routed by load only: " + ", ".join(
                f"{t.id} ({t.why_not_exact() if t.worker.healthy else 'unhealthy'})"
                for t in targets if t.id not in exact)) if degraded else "all targets on exact-KV routing",
            "targets": len(targets), "targets_exact_kv": len(exact),
            "workers": [{"id": w.id, "healthy": w.healthy,
                         "targets": [{"id": t.id, "exact_kv": t.exact_kv, "subscription": subscription(t)}
                                     for t in w.targets]} for w in ingest.workers.values()],
        }
        return not problems, body
