"""`cortex observe`: Envoy's gRPC access-log service in, metrics, the request log and the recent past out.

Envoy batches finished requests on one long-lived stream per worker thread (cortex/envoy_config.py,
`observe_access_log`); each entry is read (observe/entry.py), counted (observe/metrics.py), kept for the
status page (observe/recent.py) and, sampled by request id, written as one JSON line. Nothing here is on a
request's path: when this process is down Envoy drops the entries and requests flow as before."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
import zlib
from collections.abc import AsyncIterator, Callable
from typing import IO, Any
from urllib.parse import urlsplit

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cortex import admin_auth, logs
from cortex.api_paths import HEALTH_PATH
from cortex.calibration import CALIBRATION_FILE, Learner
from cortex.config import CortexConfig
from cortex.shared_metrics import shared_registry
from cortex.tenancy import limits
from cortex.tenancy.board import TenancyBoard
from observe import metrics
from observe.entry import Observation, read
from observe.recent import Recent

log = logging.getLogger("cortex.observe")
CALIBRATION_EVERY_S = 1.0

SERVICE = "envoy.service.accesslog.v3.AccessLogService"


def worker_addresses(cfg: CortexConfig) -> dict[str, str]:
    """ip:port -> worker id for the configured workers, for entries extproc did not name a worker in (its
    fallback route). Names are resolved once at start; a worker added later is named by extproc."""
    out: dict[str, str] = {}
    for w in cfg.workers:
        parts = urlsplit(w.url)
        if parts.hostname is None:
            continue
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with contextlib.suppress(OSError):
            for info in socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM):
                out[f"{info[4][0]}:{port}"] = w.id
    return out


def sampled(request_id: str, ratio: float) -> bool:
    """The same answer for the same request id, wherever it is asked."""
    if ratio >= 1.0:
        return True
    return zlib.crc32(request_id.encode()) / 2**32 < ratio


def log_line(o: Observation) -> bytes:
    """One request, never its text (seed 004 §5.3)."""
    doc: dict[str, Any] = {
        "request_id": o.request_id, "method": o.method, "path": o.path, "status": o.status, "cause": o.cause,
        "model": o.model, "worker": o.worker, "mode": o.mode, "reason": o.reason,
        "claimed_hit_tokens": o.claimed, "engine_cached_tokens": o.cached_tokens,
        "prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens, "stream": o.stream,
        "ttft_ms": None if o.ttft_s is None else round(o.ttft_s * 1000, 2),
        "itl_ms": None if o.itl_s is None else round(o.itl_s * 1000, 3),
        "e2e_ms": None if o.e2e_s is None else round(o.e2e_s * 1000, 2),
        # The prompt, identified but unreadable: its fingerprint, its first token ids, its length (the engine's
        # count, else Cortex's own, which is an estimate when routing stopped early).
        "prompt_hash": o.prompt_hash, "first_ids": list(o.first_ids),
        "token_count": o.prompt_tokens if o.prompt_tokens is not None else o.routed_prompt_tokens,
    }
    if o.prefill:
        doc["prefill_worker"] = o.prefill
    if o.alias:
        doc["alias"] = o.alias
    # Tenancy, when it applies: whose request, how long it waited for a worker, why admission refused it.
    if o.tenant:
        doc["tenant"] = o.tenant
    if o.queued_ms is not None:
        doc["queued_ms"] = o.queued_ms
    if o.dropped_reason:
        doc["dropped_reason"] = o.dropped_reason
    # The shape of every Cortex JSON log line (ts, level, logger, process, msg, fields): cortex/logs.py.
    return logs.json_line("request", logger="cortex.request", process=logs.process_name("observe"), ts=o.start_s,
                          **doc).encode() + b"\n"


class Observer:
    def __init__(self, cfg: CortexConfig, out: IO[bytes] | None = None,
                 clock: Callable[[], float] = time.time, board: TenancyBoard | None = None) -> None:
        self.cfg = cfg
        self.board = board
        """Where requests that reserved tokens are settled (None: not settled here)."""
        self.by_address = worker_addresses(cfg)
        self.labels = metrics.Labels()
        metrics.prime([m.name for m in cfg.models], [w.id for w in cfg.workers], self.labels,
                      [(a.name, t.model) for a in cfg.aliases for t in a.targets])
        self.recent = Recent()
        self.out = out if out is not None else sys.stdout.buffer
        self.clock = clock
        self.learner = Learner()
        self.calibration_path = cfg.runtime_path() / CALIBRATION_FILE
        self._calibrated_at = 0.0

    def take(self, entry: Any) -> Observation | None:
        try:
            o = read(entry, self.by_address)
        except Exception:
            metrics.ENTRIES.labels("malformed").inc()
            log.exception("an access-log entry could not be read; it is skipped")
            return None
        if o.path == HEALTH_PATH:  # a balancer's probe, every few seconds: not traffic
            metrics.ENTRIES.labels("health").inc()
            return o
        metrics.ENTRIES.labels("ok" if o.routed else "not_routed").inc()
        metrics.record(o, self.labels)
        if o.reserved_tokens is not None and self.board is not None:
            self.settle(o)
        now = self.clock()
        self.recent.add(o, now)
        self.calibrate(o, now)
        oc = self.cfg.observe
        if oc.request_log and sampled(o.request_id, oc.request_log_sample):
            self.out.write(log_line(o))
        return o

    def calibrate(self, o: Observation, now: float) -> None:
        """Learn the serving worker's observed / predicted TTFT (a successful stream the time model predicted, its
        waiting-room time taken out) and publish the ratios about once a second."""
        if o.predicted_ttft_ms is None or o.ttft_s is None or o.status != 200 or not o.worker:
            return
        self.learner.add(o.worker, o.predicted_ttft_ms, o.ttft_s * 1000 - (o.queued_ms or 0.0))
        if now - self._calibrated_at >= CALIBRATION_EVERY_S:
            self._calibrated_at = now
            try:
                self.learner.write(self.calibration_path)
            except OSError as exc:
                log.warning("calibration not written to %s: %s", self.calibration_path, exc)

    def settle(self, o: Observation) -> None:
        """Charge the tenant what the request really cost (its reservation was released by extproc when it
        ended); the windows are those of the request's start, as its admission saw them. A worker's 4xx computed
        nothing and costs nothing."""
        assert self.board is not None
        amount = limits.settled(self.cfg.admission.charge, prompt_tokens=o.prompt_tokens,
                                cached_tokens=o.cached_tokens, completion_tokens=o.completion_tokens,
                                reached_worker=bool(o.worker) and not 400 <= o.status < 500,
                                routed_prompt_tokens=o.routed_prompt_tokens, claimed_hit_tokens=o.claimed,
                                chunks=o.chunks)
        if amount > 0:
            self.board.charge(self.board.slot(o.tenant), amount, limits.window(o.start_s, 60),
                              limits.window(o.start_s, o.quota_period_s or 86400))
        metrics.TENANT_CHARGED.labels(o.tenant).inc(amount)

    async def stream(self, requests: AsyncIterator[als_pb2.StreamAccessLogsMessage],
                     _context: grpc.aio.ServicerContext) -> als_pb2.StreamAccessLogsResponse:
        async for message in requests:
            for entry in message.http_logs.log_entry:
                self.take(entry)
            with contextlib.suppress(Exception):
                self.out.flush()
        return als_pb2.StreamAccessLogsResponse()

    def http_app(self) -> web.Application:
        async def decisions(request: web.Request) -> web.Response:
            try:
                limit = int(request.query.get("limit", "50"))
            except ValueError:
                return web.json_response({"error": "limit must be an integer"}, status=400)
            now = self.clock()
            return web.json_response({"decisions": self.recent.last(limit), "workers": self.recent.workers(now)})

        async def hit_ratio(request: web.Request) -> web.Response:
            try:
                window = float(request.query.get("window_s", "600"))
            except ValueError:
                return web.json_response({"error": "window_s must be a number"}, status=400)
            return web.json_response(self.recent.hit_ratio(self.clock(), window))

        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        async def prometheus(_: web.Request) -> web.Response:
            # extproc's and this process's series (the shared multi-process files), not ingest's: a scrape
            # target that stays up while ingest restarts (ingest serves them too, unless ?scope=ingest).
            body = generate_latest(shared) if shared is not None else b""
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        shared = shared_registry()

        # The recent decisions carry prompt fingerprints and first token ids: admin routes.
        app = web.Application(middlewares=[admin_auth.middleware(
            admin_auth.admin_token(self.cfg), {*admin_auth.OPEN_PATHS, "/metrics"})])
        app.router.add_get("/cortex/decisions", decisions)
        app.router.add_get("/cortex/hit-ratio", hit_ratio)
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", prometheus)
        return app


async def serve(cfg: CortexConfig) -> None:
    metrics.START_TIME.set_to_current_time()
    path = cfg.observe.request_log_path
    # Line-buffered appends: each request's line is whole in the file even if the process stops mid-batch.
    out = open(path, "ab", buffering=0) if path else None  # noqa: SIM115 (held for the process's life)
    board = TenancyBoard(cfg.runtime_path() / "tenancy", "observer", cfg.extproc.process_count())
    observer = Observer(cfg, out, board=board)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
            observer.stream, request_deserializer=als_pb2.StreamAccessLogsMessage.FromString,
            response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString)}),))
    o = cfg.observe
    server.add_insecure_port(f"{o.host}:{o.port}")
    await server.start()
    runner = web.AppRunner(observer.http_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, o.host, o.http_port).start()
    log.info("observer listening on %s:%d (access log) and %s:%d (recent decisions)", o.host, o.port, o.host,
             o.http_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)
    await runner.cleanup()


def run(cfg: CortexConfig) -> int:
    asyncio.run(serve(cfg))
    return 0
