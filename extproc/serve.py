"""One ext_proc process: its gRPC server (the ext_proc service and gRPC health), the upkeep task (view refresh,
the router's upkeep, the waiting room's wake-up, config reloads), route explain's admin socket, and the
breaker status file. `cortex run` starts one per extproc.process_count; `cortex epp` one in picker mode."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from pathlib import Path

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from cortex import breaker_status, extproc_tls, gc_pauses, grpc_health
from cortex.api_paths import EXPLAIN_PATH, explain_socket
from cortex.config import CortexConfig
from cortex.config_watch import ConfigWatcher
from cortex.model_bundle import BundleCache
from cortex.piecewise.segment_encoder import SegmentEncoder
from cortex.tenancy.board import TenancyBoard
from extproc import metrics
from extproc.admission import Admission
from extproc.breaker import State as BreakerState
from extproc.cluster_view import ClusterView
from extproc.http_transport import HttpDecisions
from extproc.registry import ModelRegistry
from extproc.router import Router
from extproc.server import UPKEEP_S, ExtProc
from extproc.snapshot import Source

log = logging.getLogger("cortex.extproc")

IDLE_UPKEEP_S = 1.0
"""Upkeep cadence once no request came for IDLE_AFTER_S: the first request after a pause refreshes the view
itself if the last refresh is older than UPKEEP_S (docs/performance.md, "What an idle replica costs")."""
IDLE_AFTER_S = 2.0


async def serve(cfg: CortexConfig, index: int, config_path: Path | None = None, picker: bool = False) -> None:
    pauses = gc_pauses.watch()
    cluster = ClusterView(cfg, cfg.view_path(), index)
    cluster.refresh()
    bundles = BundleCache()
    registry = ModelRegistry(cfg, bundles)
    source = Source(cfg, registry)
    status_file = breaker_status.path(cfg.runtime_path(), index)

    def on_breaker(address: str, old: BreakerState, new: BreakerState) -> None:
        info = cluster.by_address.get(address)
        worker = info.worker if info is not None else address
        (log.warning if new is BreakerState.OPEN else log.info)(
            "worker %s (%s): circuit breaker %s -> %s", worker, address, old.value, new.value)
        metrics.breaker_transition(worker, old, new)
        try:
            breaker_status.write(status_file, router.breakers.snapshot(time.monotonic()))
        except OSError:
            log.exception("writing the breaker status file failed")

    router = Router(cfg, cluster, registry, source, on_breaker=on_breaker)
    try:
        breaker_status.write(status_file, {})  # a restarted process starts with every breaker closed: say so
    except OSError:
        log.exception("writing the breaker status file failed")
    board = TenancyBoard(cfg.runtime_path() / "tenancy", f"x{index}", cfg.extproc.process_count())
    app = ExtProc(source, cluster, router, Admission(cfg, board), picker=picker)
    # A bad edit is logged and ignored; listener, port and process-count changes need a restart.
    def prepare(c: CortexConfig) -> tuple[CortexConfig, ModelRegistry, dict[int, SegmentEncoder]]:
        # In the watcher's thread: new tokenizers load and new encoders prove themselves off the event loop.
        registry = ModelRegistry(c, bundles)
        return c, registry, router.segments.build(registry.bundles.values())

    watcher = ConfigWatcher(config_path, prepare, bundles)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", cfg.extproc.max_body_bytes + (1 << 20)),
        ("grpc.max_send_message_length", cfg.extproc.max_body_bytes + (1 << 20)),
    ])
    handler = grpc.method_handlers_generic_handler("envoy.service.ext_proc.v3.ExternalProcessor", {
        "Process": grpc.stream_stream_rpc_method_handler(
            app.process, request_deserializer=pb.ProcessingRequest.FromString,
            response_serializer=pb.ProcessingResponse.SerializeToString),
    })
    # Latched once this process has read ingest's target list: from then on it routes (by load while ingest
    # restarts), so Envoy keeps sending it streams; before, Envoy must not (cortex/grpc_health.py).
    served = cluster.synced

    def health(service: str) -> int | None:
        if service in ("", grpc_health.EXT_PROC):
            return grpc_health.SERVING if served else grpc_health.NOT_SERVING
        if service == grpc_health.LEDGER_VIEW:
            return grpc_health.SERVING if cluster.synced else grpc_health.NOT_SERVING
        return None

    handlers = [handler, grpc_health.handler(health)]
    decisions = HttpDecisions(app) if cfg.extproc.transport == "http" and not picker else None
    if decisions is not None:
        # The ends of the requests this process decided over HTTP: Envoy's access log (extproc/http_transport.py).
        handlers.append(grpc.method_handlers_generic_handler("envoy.service.accesslog.v3.AccessLogService", {
            "StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
                decisions.access_log, request_deserializer=als_pb2.StreamAccessLogsMessage.FromString,
                response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString)}))
    server.add_generic_rpc_handlers(tuple(handlers))
    port = cfg.extproc.base_port + index
    if cfg.extproc.tls is None:
        server.add_insecure_port(f"{cfg.extproc.host}:{port}")
    else:
        cert, key = extproc_tls.files(cfg)
        server.add_secure_port(f"{cfg.extproc.host}:{port}",
                               grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())]))
        # Local health checks (ingest's readiness, the supervisor's start gate) come here, not through the
        # certificate the gateway does not check either (cortex/extproc_tls.py).
        local = extproc_tls.local_socket(cfg.runtime_path(), index)
        local.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        local.unlink(missing_ok=True)
        server.add_insecure_port(f"unix:{local}")
    # What start-up loaded, out of every full collection's walk (cortex/gc_pauses.py).
    metrics.GC_FROZEN_OBJECTS.set(gc_pauses.settle())
    await server.start()
    decide_site = None
    if decisions is not None:
        decide_site = decisions.runner(lambda: served)
        await decide_site.setup()
        await web.TCPSite(decide_site, cfg.extproc.host, cfg.extproc.http_base_port + index).start()
    # A restarted process finds ingest's view at once: it serves from here, and says so as a first start does.
    (log.info if served else log.debug)("extproc %d %s on %s:%d (%d models)", index,
                                        "serving" if served else "listening", cfg.extproc.host, port,
                                        len(registry.bundles))

    async def upkeep() -> None:
        nonlocal served
        polled_at = time.monotonic()
        while True:
            # Until it serves, and while requests flow, every UPKEEP_S; an idle process wakes less often.
            idle = served and time.monotonic() - app.last_stream_at > IDLE_AFTER_S and not app.room
            await asyncio.sleep(IDLE_UPKEEP_S if idle else UPKEEP_S)
            try:
                cluster.refresh()
                if not served and cluster.synced:
                    served = True
                    log.info("extproc %d serving on %s:%d (%d models)", index, cfg.extproc.host, port,
                             len(registry.bundles))
                router.upkeep()
                if decisions is not None:
                    decisions.upkeep()
                app.wake()  # released as loads fall; expired at their time-to-live
                if time.monotonic() - polled_at >= 1.0:
                    polled_at = time.monotonic()
                    change = await watcher.poll()
                    if change is not None:
                        app.reload(*change)
                        metrics.GC_FROZEN_OBJECTS.set(gc_pauses.settle())
                metrics.gc_pauses(pauses.drain())
            except Exception:
                log.exception("extproc upkeep failed")

    task = asyncio.create_task(upkeep())
    explain_site = None
    if index == 0 and cfg.extproc.route_explain:
        # Route explain for ingest's admin port: a socket only this host's processes (of this user) reach.
        explain_app = web.Application()
        explain_app.add_routes([web.post(EXPLAIN_PATH, app.explain_http)])
        explain_site = web.AppRunner(explain_app, access_log=None)
        await explain_site.setup()
        sock = explain_socket(cfg.runtime_path())
        sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        sock.unlink(missing_ok=True)
        await web.UnixSite(explain_site, str(sock)).start()
        sock.chmod(0o600)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await server.stop(grace=2)
    if decide_site is not None:
        await decide_site.cleanup()
    if explain_site is not None:
        await explain_site.cleanup()
    await app.pd.close()


def run(cfg: CortexConfig, index: int, config_path: Path | None = None, picker: bool = False) -> int:
    if index > 0:
        # Every extproc process loads the same tokenizers and applies (or refuses) the same config edits: process
        # 0 tells the person once. The others keep their warnings (and, but for config refusals, errors).
        for name in ("cortex.piecewise_tokenize", "cortex.fast_bpe"):
            logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger("cortex.config").setLevel(logging.CRITICAL)
    metrics.START_TIME.labels(str(index)).set_to_current_time()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(cfg, index, config_path, picker))
    return 0
