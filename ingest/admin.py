"""Ingest's HTTP surface on 127.0.0.1:9090: liveness, readiness, Prometheus metrics and worker state.

/health/ready is the gateway's readiness (ingest/readiness.py): 200 only once a request sent now is routed by
Cortex (Envoy listening, every extproc process serving, the ledger view live), else 503 with the reason.

/metrics serves ingest's own series (read live from its state by a collector, so nothing is kept twice)
plus every extproc process's series, which prometheus_client's multiprocess mode keeps in files under
PROMETHEUS_MULTIPROC_DIR; one scrape target covers the whole gateway.

/cortex/ui is the status page for a person (ingest/status_page.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import ValidationError

from cortex import admin_auth, gc_pauses
from cortex.api_paths import EXPLAIN_PATH, TENANT_VIEW_HEADER, explain_socket
from cortex.config import WorkerConfig
from cortex.errors import error_body
from cortex.shared_metrics import shared_registry
from ingest import loop_cpu
from ingest.lag import VIEW_LAG, WINDOW_S
from ingest.membership import MembershipError
from ingest.readiness import Readiness
from ingest.service import Ingest
from ingest.silence import SILENT
from ingest.status_page import add_routes as add_status_page
from ingest.sync import SyncState

STARTED_AT = time.time()
"""This process's start (module import, at ingest's start): a new value in /metrics is a restart."""


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=error_body(status, message), content_type="application/json")


class IngestCollector(Collector):
    """Ingest's series, read from its live state at scrape time (nothing is counted twice)."""

    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        labels = ["target", "worker"]
        state = GaugeMetricFamily("cortex_target_sync_state", "1 for the target's current ledger sync state",
                                  labels=[*labels, "state"])
        exact = GaugeMetricFamily("cortex_target_exact_kv", "1 if the target is eligible for exact-KV routing",
                                  labels=labels)
        parity = GaugeMetricFamily("cortex_target_hash_parity", "1 for the target's current hash parity status",
                                   labels=[*labels, "status"])
        healthy = GaugeMetricFamily("cortex_worker_healthy", "1 if the worker passes health probes",
                                    labels=["worker"])
        tokens = GaugeMetricFamily("cortex_worker_tokenizer_parity",
                                   "1 for the worker's tokenizer parity status (ok, failed, unknown)",
                                   labels=["worker", "status"])
        silent = GaugeMetricFamily("cortex_target_events_silent",
                                   "1 if the target serves requests but publishes no KV events (ingest.silence)",
                                   labels=labels)
        blocks = GaugeMetricFamily("cortex_ledger_blocks", "Cortex blocks the ledger lists for the target",
                                   labels=labels)
        running = GaugeMetricFamily("cortex_target_running_requests", "engine-reported running requests",
                                    labels=labels)
        waiting = GaugeMetricFamily("cortex_target_waiting_requests", "engine-reported waiting requests",
                                    labels=labels)
        kv_usage = GaugeMetricFamily("cortex_target_kv_usage_ratio", "engine-reported share of the KV-cache pool in "
                                     "use, 0..1 (vLLM kv_cache_usage_perc, SGLang token_usage)", labels=labels)
        event_age = GaugeMetricFamily("cortex_target_last_event_age_seconds", "time since the last event batch",
                                      labels=labels)
        lag = GaugeMetricFamily("cortex_ingest_lag_seconds",
                                "engine timestamp of the newest applied batch to the time it was applied",
                                labels=labels)
        counters = {name: CounterMetricFamily(f"cortex_ingest_{name}", help_, labels=labels) for name, help_ in (
            ("batches", "event batches applied"),
            ("gaps", "sequence gaps detected"),
            ("replays", "replays requested from the engine's replay socket"),
            ("resyncs", "holes given up on: ledger cleared and rebuilt from live events"),
            ("publisher_restarts", "publisher restarts detected (sequence went back)"),
            ("duplicate_batches", "duplicate or already-applied batches dropped"),
            ("decode_errors", "undecodable batches or events"),
            ("parity_failures", "hash parity failures"),
            ("tail_recoveries", "lost newest batches recovered by a tail check through replay"),
            ("events", "events applied to the ledger"),
        )}
        evicted = CounterMetricFamily("cortex_target_evicted_tokens", "tokens the engine evicted from its KV pool "
                                      "(its BlockRemoved, as the ledger applied them)", labels=labels)
        regretted = CounterMetricFamily("cortex_target_regretted_tokens", "tokens the engine evicted that an engine "
                                        "stored again within 5 min (computed again: ingest/regret.py)", labels=labels)
        dropped = CounterMetricFamily("cortex_ingest_dropped_events", "events not applied, by reason",
                                      labels=[*labels, "reason"])
        unknown = CounterMetricFamily("cortex_ingest_unknown_events", "events of a type Cortex does not know (a newer "
                                      "engine's), skipped", labels=[*labels, "kind"])
        media = CounterMetricFamily("cortex_ingest_unknown_media", "stores and removals on a medium Cortex does not "
                                    "know, skipped", labels=[*labels, "medium"])
        lanes = GaugeMetricFamily("cortex_ledger_lane_blocks", "Cortex blocks a target holds per copy set: "
                                  "<tier>/<KV-cache group>[/<locality>][/<ownership>] (GPU/0: the first group on the "
                                  "GPU; CPU/..., STORAGE/...: offloaded copies)", labels=[*labels, "lane"])
        for w in self.ingest.workers.values():
            healthy.add_metric([w.id], 1.0 if w.healthy else 0.0)
            tokens.add_metric([w.id, w.token_parity.status], 1.0)
            for t in w.targets:
                key = [t.id, w.id]
                ev = t.events
                for s in SyncState:
                    state.add_metric([*key, s.value], 1.0 if ev.sync.state is s else 0.0)
                exact.add_metric(key, 1.0 if t.exact_kv else 0.0)
                if w.events_usable:
                    silent.add_metric(key, 1.0 if t.events_status == SILENT else 0.0)
                parity.add_metric([*key, ev.parity.status], 1.0)
                blocks.add_metric(key, ev.ledger.blocks)
                running.add_metric(key, t.load.running)
                waiting.add_metric(key, t.load.waiting)
                if t.kv_usage is not None:
                    kv_usage.add_metric(key, t.kv_usage)
                if ev.last_event_at:
                    event_age.add_metric(key, now - ev.last_event_at)
                    lag.add_metric(key, ev.lag_s)
                for name, value in (("batches", ev.batches), ("gaps", ev.sync.gaps), ("replays", ev.sync.replays),
                                    ("resyncs", ev.sync.resyncs), ("publisher_restarts", ev.sync.restarts),
                                    ("duplicate_batches", ev.sync.duplicates), ("decode_errors", ev.decode_errors),
                                    ("parity_failures", ev.parity.failures), ("events", ev.ledger.events_applied),
                                    ("tail_recoveries", ev.sync.tail_recoveries)):
                    counters[name].add_metric(key, value)
                evicted.add_metric(key, t.evicted_tokens)
                regretted.add_metric(key, self.ingest.regret.regretted(t.slot))
                for reason, n in ev.ledger.dropped.items():
                    dropped.add_metric([*key, reason], n)
                for kind, n in ev.unknown_events.items():
                    unknown.add_metric([*key, kind], n)
                for medium, n in ev.ledger.unknown_media.items():
                    media.add_metric([*key, medium], n)
                for lane, n in ev.ledger.lanes().items():
                    lanes.add_metric([*key, lane], n)
        yield from (state, exact, silent, parity, healthy, tokens, blocks, running, waiting, kv_usage, event_age, lag,
                    *counters.values(), evicted, regretted, dropped, unknown, media, lanes)
        yield GaugeMetricFamily("cortex_ingest_start_time_seconds", "unix time this ingest process started",
                                value=STARTED_AT)
        yield GaugeMetricFamily("cortex_ledger_view_keys", "keys in the shared ledger view",
                                value=self.ingest.view.size)
        # Per process (one ingest per replica), not per target: bounded series at any fleet size.
        yield HistogramMetricFamily("cortex_ingest_view_lag_seconds",
                                    "engine timestamp of each applied event batch to its application to the view",
                                    buckets=VIEW_LAG.buckets(), sum_value=VIEW_LAG.sum)
        yield GaugeMetricFamily("cortex_ingest_view_lag_max_seconds",
                                f"largest lag of the batches applied in the last {WINDOW_S:g}-{2 * WINDOW_S:g} s "
                                "(0 when none)", value=VIEW_LAG.recent_max())
        if self.ingest.shards is not None:
            restarts = CounterMetricFamily("cortex_ingest_event_shard_restarts", "times an event shard's process "
                                           "exited or hung and was replaced (ingest/shards.py)", labels=["shard"])
            followed = GaugeMetricFamily("cortex_ingest_event_shard_targets", "targets each event shard follows",
                                         labels=["shard"])
            for shard in self.ingest.shards.shards:
                restarts.add_metric([str(shard.index)], shard.restarts)
                followed.add_metric([str(shard.index)], len(shard.sources))
            yield from (restarts, followed)
        pauses = HistogramMetricFamily("cortex_ingest_gc_pause_seconds", "garbage-collector pauses of this ingest "
                                       "process, by generation (2: a full collection; cortex/gc_pauses.py)",
                                       labels=["generation"])
        for generation in range(gc_pauses.GENERATIONS):
            pauses.add_metric([str(generation)], gc_pauses.PAUSES.buckets(generation),
                              gc_pauses.PAUSES.sums[generation])
        yield pauses
        yield GaugeMetricFamily("cortex_ingest_gc_frozen_objects", "objects this ingest process keeps out of the "
                                "collector's walk since start-up or the last reload (0: not settled yet)",
                                value=self.ingest.frozen_objects)
        cpu = CounterMetricFamily("cortex_ingest_loop_cpu_seconds",
                                  "CPU seconds spent in each ingest loop's tasks (other: the rest of the process)",
                                  labels=["loop"])
        for loop, seconds in loop_cpu.snapshot().items():
            cpu.add_metric([loop], seconds)
        yield cpu


def build_app(ingest: Ingest, picker: bool = False) -> web.Application:
    own = CollectorRegistry()
    own.register(IngestCollector(ingest))
    shared = shared_registry()

    async def live(_: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    readiness = Readiness(ingest, with_envoy=not picker)

    async def ready(_: web.Request) -> web.Response:
        # Ready means "a request sent now is routed by Cortex" (ingest/readiness.py); 503 names what is missing.
        ok, body = await readiness.check()
        return web.json_response(body, status=200 if ok else 503)

    async def close_readiness(_: web.Application) -> None:
        await readiness.close()

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(own)
        # ?scope=ingest: ingest's own series only, for a set-up that scrapes extproc's and the observer's from
        # the observer's port, where they stay available while ingest restarts (docs/observability.md).
        if shared is not None and request.query.get("scope") != "ingest":
            body += generate_latest(shared)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def workers(_: web.Request) -> web.Response:
        return web.json_response(ingest.status())

    async def add_worker(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            wcfg = WorkerConfig.model_validate(body)
            ingest.add_worker(wcfg)
        except ValidationError as exc:
            msg = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
            return _error(400, f"invalid worker: {msg}")
        except ValueError as exc:  # bad JSON, or MembershipError
            return _error(getattr(exc, "status", 400), str(exc))
        return web.json_response(ingest.status(), status=201)

    async def remove_worker(request: web.Request) -> web.Response:
        try:
            await ingest.remove_worker(request.match_info["worker_id"])
        except MembershipError as exc:
            return _error(exc.status, str(exc))
        return web.json_response(ingest.status())

    async def explain(request: web.Request) -> web.Response:
        """Route explain, decided by extproc process 0 (it holds the router) through its socket."""
        if not ingest.cfg.extproc.route_explain:
            return _error(404, "route explain is off (extproc.route_explain)")
        sock = explain_socket(ingest.cfg.runtime_path())
        forward = {k: v for k, v in request.headers.items()
                   if k.lower() in (TENANT_VIEW_HEADER, "content-type", *ingest.cfg.session.headers)}
        try:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as session, \
                    session.post(f"http://extproc{EXPLAIN_PATH}", data=await request.read(), params=request.query,
                                 headers=forward, timeout=aiohttp.ClientTimeout(total=30)) as r:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
        except (aiohttp.ClientError, OSError, TimeoutError):
            return _error(503, "extproc process 0 is not answering route explain (starting or restarting)")

    # Worker changes and the status page need the admin token when one is configured; health and metrics do not.
    app = web.Application(middlewares=[admin_auth.middleware(
        admin_auth.admin_token(ingest.cfg), {*admin_auth.OPEN_PATHS, "/metrics"})])
    app.on_cleanup.append(close_readiness)
    app.router.add_get("/health/live", live)
    app.router.add_get("/health/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/cortex/workers", workers)
    app.router.add_post("/cortex/workers", add_worker)
    app.router.add_delete("/cortex/workers/{worker_id}", remove_worker)
    app.router.add_post(EXPLAIN_PATH, explain)
    add_status_page(app, ingest)  # /cortex/ui: the status page for a person (ingest/status_page.py)
    return app
