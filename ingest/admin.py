"""Ingest's HTTP surface on 127.0.0.1:9090: liveness, readiness, Prometheus metrics and worker state.

/metrics serves ingest's own series (read live from its state by a collector, so nothing is kept twice)
plus every extproc process's series, which prometheus_client's multiprocess mode keeps in files under
PROMETHEUS_MULTIPROC_DIR; one scrape target covers the whole gateway.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from ingest.service import Ingest
from ingest.workers import SyncState


class IngestCollector(Collector):
    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest

    def collect(self) -> Iterator[Metric]:
        ing = self.ingest
        now = time.monotonic()
        state = GaugeMetricFamily("cortex_worker_state", "1 for the worker's current ledger sync state",
                                  labels=["worker", "state"])
        healthy = GaugeMetricFamily("cortex_worker_healthy", "1 if the worker passes health probes",
                                    labels=["worker"])
        blocks = GaugeMetricFamily("cortex_ledger_blocks", "Cortex blocks the ledger lists for the worker",
                                   labels=["worker"])
        running = GaugeMetricFamily("cortex_worker_running_requests", "engine-reported running requests",
                                    labels=["worker"])
        waiting = GaugeMetricFamily("cortex_worker_waiting_requests", "engine-reported waiting requests",
                                    labels=["worker"])
        event_age = GaugeMetricFamily("cortex_worker_last_event_age_seconds", "time since the last event batch",
                                      labels=["worker"])
        batches = CounterMetricFamily("cortex_ingest_batches", "event batches applied", labels=["worker"])
        gaps = CounterMetricFamily("cortex_ingest_gaps", "sequence gaps detected", labels=["worker"])
        restarts = CounterMetricFamily("cortex_ingest_publisher_restarts", "publisher restarts detected",
                                       labels=["worker"])
        dups = CounterMetricFamily("cortex_ingest_duplicate_batches", "duplicate batches dropped",
                                   labels=["worker"])
        errors = CounterMetricFamily("cortex_ingest_decode_errors", "undecodable batches or events",
                                     labels=["worker"])
        dropped = CounterMetricFamily("cortex_ingest_dropped_events", "events not applied, by reason",
                                      labels=["worker", "reason"])
        for w in ing.workers.values():
            for s in SyncState:
                state.add_metric([w.id, s.value], 1.0 if w.state is s else 0.0)
            healthy.add_metric([w.id], 1.0 if w.healthy else 0.0)
            blocks.add_metric([w.id], w.ledger.blocks)
            running.add_metric([w.id], w.load.running)
            waiting.add_metric([w.id], w.load.waiting)
            if w.last_event_at:
                event_age.add_metric([w.id], now - w.last_event_at)
            batches.add_metric([w.id], w.batches)
            gaps.add_metric([w.id], w.gaps)
            restarts.add_metric([w.id], w.restarts)
            dups.add_metric([w.id], w.duplicates)
            errors.add_metric([w.id], w.decode_errors)
            for reason, n in w.ledger.dropped.items():
                dropped.add_metric([w.id, reason], n)
        yield from (state, healthy, blocks, running, waiting, event_age, batches, gaps, restarts, dups, errors,
                    dropped)
        yield GaugeMetricFamily("cortex_ledger_view_keys", "keys in the shared ledger view", value=ing.view.size)
        yield GaugeMetricFamily("cortex_ingest_lag_seconds",
                                "age of the newest applied batch when it was applied (engine ts to apply)",
                                value=ing.last_apply_lag_s)
        yield CounterMetricFamily("cortex_ingest_events", "events applied", value=ing.events_applied)


def build_app(ingest: Ingest) -> web.Application:
    own = CollectorRegistry()
    own.register(IngestCollector(ingest))
    shared: CollectorRegistry | None = None
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        shared = CollectorRegistry()
        MultiProcessCollector(shared)

    async def live(_: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    async def ready(_: web.Request) -> web.Response:
        ws = list(ingest.workers.values())
        exact = [w.id for w in ws if w.state is SyncState.READY and w.healthy]
        degraded = len(exact) < len(ws)
        return web.json_response({
            "status": "ready", "degraded": degraded,
            "detail": "some workers are routed by load only" if degraded else "all workers on exact-KV routing",
            "workers": len(ws), "workers_exact_kv": len(exact),
        })

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(own)
        if shared is not None:
            body += generate_latest(shared)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def workers(_: web.Request) -> web.Response:
        return web.json_response(ingest.status())

    app = web.Application()
    app.router.add_get("/health/live", live)
    app.router.add_get("/health/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/cortex/workers", workers)
    return app
