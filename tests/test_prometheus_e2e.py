"""A real Prometheus (Debian's `prometheus` binary, scripts/install-prometheus.sh) scrapes a real gateway every
second with the alert rules loaded, while the test sends traffic and injects faults; then every dashboard panel's
query and every rule's expression is evaluated through Prometheus's HTTP API.

- Baseline: JSON and SSE chats (repeated prompts, so hits), concurrent long answers (load), a bad request, a
  refused model, a tenant over its rate. Every query not listed in NEEDS_FAULT returns data over this window,
  with the dashboard's variables as the real model and worker names and as `.*`: a filter on a label the
  exporter lacks, a name that is not exported, or a panel that never fills would show here.
- Each query in NEEDS_FAULT returns nothing over the baseline window (the list holds only what needs it), and
  returns data once its fault is injected: claims above the engine's cached tokens (KV events lost while the
  engine's cache was reset), sequence gaps, a replay endpoint that does not answer (a STALE ledger, then a
  resync), a worker added with a wrong KV-event port (not ready, then silent), workers whose load cannot be read
  (fallback decisions), a planted routing bug, a collapse of the hit ratio and the TTFT after a baseline (its
  rules compare with the past, so they are evaluated at the instant whose windows hold the collapse and the
  baseline), a worker answering 500 to everything (its breaker opens and reopens), an ingest and an extproc
  restart, and the gateway gone.

Bounded: one gateway, three simulated workers, one Prometheus, about two minutes.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from cortexbench.launch import free_ports
from extproc.tenants import digest
from tests.harness import MODEL, Gateway, Sim, long_chat, serving, start_sim, stop, wait_for
from tests.test_dashboard import RULES, dashboard, panels, prometheus_tool

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent
ROUTE_FAULT = ROOT / "tests" / "fixtures" / "route_fault"
PLANTED = "trip-the-planted-routing-fault"
RATE_KEY = "sk-prom-rate-1"
SCRAPE_S = 1.0

# Query id -> the fault it needs. A query is "alert:<name>", "record:<name>" or "panel:<title>/<refId>".
NEEDS_FAULT: dict[str, str] = {
    "alert:CortexClaimAboveEngineHit": "over_claim",
    "alert:CortexLedgerStale": "stale",
    "alert:CortexKVEventGapsRising": "gaps",
    "alert:CortexKVEventReplaysRising": "gaps",
    "alert:CortexLedgerResyncs": "gaps",
    "alert:CortexLedgerNotReady": "wrong_kv_port",
    "alert:CortexWorkerPublishesNoKVEvents": "wrong_kv_port",
    "alert:CortexFallbackRateHigh": "load_unknown",
    "alert:CortexExtprocInternalErrors": "routing_bug",
    "alert:CortexWorkerBreakerOpen": "breaker",
    "alert:CortexTTFTP90Up": "collapse",
    "alert:CortexHitRatioCollapsed": "collapse",
    "alert:CortexIngestRestarting": "ingest_restart",
    "alert:CortexExtprocRestarting": "extproc_restart",
    "alert:CortexGatewayMetricsDown": "gateway_down",
}
# Rules that compare with the past (`offset`): evaluated once, at the instant whose windows put the baseline in
# the offset window and the collapse in the current one (the split plus the current window's length).
LOOKBACK_S = {"alert:CortexTTFTP90Up": 600.0, "alert:CortexHitRatioCollapsed": 900.0}
# What each of them compares, shown when it comes out empty.
DIAGNOSE = {"alert:CortexHitRatioCollapsed": {
    "now": "sum(rate(cortex_engine_cached_tokens_total[15m])) / sum(rate(cortex_prompt_tokens_total[15m]))",
    "before": "sum(rate(cortex_engine_cached_tokens_total[6h] offset 15m))"
              " / sum(rate(cortex_prompt_tokens_total[6h] offset 15m))",
    "requests/s": "sum(rate(cortex_requests_total[15m]))",
    "cached tokens first seen before": "sum(min_over_time(cortex_engine_cached_tokens_total[6h] offset 15m))",
    "cached tokens last seen before": "sum(max_over_time(cortex_engine_cached_tokens_total[6h] offset 15m))",
    "prompt tokens before": "sum(max_over_time(cortex_prompt_tokens_total[6h] offset 15m))"}}


# --- Grafana's variables -------------------------------------------------------------------------------------

_GRAFANA_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")


def grafana_regex(value: str) -> str:
    """A selected value of a multi-value variable as Grafana's Prometheus data source writes it into a query
    (prometheusSpecialRegexEscape, then the list in parentheses): escaped for the regex and for the PromQL
    string it sits in."""
    return "(" + _GRAFANA_SPECIAL.sub(lambda m: "\\\\" + m.group(), value.replace("\\", "\\\\\\\\")) + ")"


def substitute(expr: str, model: str, worker: str, range_s: float) -> str:
    """Grafana's variables replaced: $model and $worker (already regexes), $__range the window evaluated,
    $__rate_interval what Grafana takes with a 1 s scrape interval (4 x the interval; 10 s here, to hold a few
    samples on a loaded machine)."""
    out = (expr.replace("$__rate_interval", "10s").replace("$__range", f"{math.ceil(range_s)}s")
           .replace("$model", model).replace("$worker", worker))
    assert "$" not in out, out
    return out


# --- The queries ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    id: str
    expr: str
    instant: bool = False
    """A table of the state now (Grafana's instant query), evaluated at the window's end."""
    dashboard: bool = False


def all_queries() -> list[Query]:
    out = []
    for p in panels(dashboard()):
        for t in p.get("targets", []):
            out.append(Query(f"panel:{p['title']}/{t['refId']}", t["expr"], bool(t.get("instant")), True))
    for g in yaml.safe_load(RULES.read_text())["groups"]:
        for r in g["rules"]:
            out.append(Query(f"alert:{r['alert']}" if "alert" in r else f"record:{r['record']}", r["expr"]))
    return out


def test_the_fault_list_names_real_queries() -> None:
    ids = {q.id for q in all_queries()}
    assert set(NEEDS_FAULT) <= ids, sorted(set(NEEDS_FAULT) - ids)
    assert set(LOOKBACK_S) <= set(NEEDS_FAULT)


@pytest.mark.parametrize(("value", "written"), [
    ("Qwen/Qwen2.5-7B-Instruct", r"(Qwen/Qwen2\\.5-7B-Instruct)"),
    ("sim-1", "(sim-1)"),
    ("a+b(c)", r"(a\\+b\\(c\\))"),
])
def test_grafana_regex(value: str, written: str) -> None:
    assert grafana_regex(value) == written


# --- Prometheus ----------------------------------------------------------------------------------------------


class Prometheus:
    def __init__(self, root: Path, targets: list[str]) -> None:
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": f"{SCRAPE_S:g}s", "evaluation_interval": f"{SCRAPE_S:g}s",
                             "scrape_timeout": f"{SCRAPE_S:g}s"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": "cortex", "static_configs": [{"targets": targets}]}]}
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = root / "prometheus.log"
        self.proc = subprocess.Popen(
            [prometheus_tool("prometheus"), f"--config.file={root / 'prometheus.yml'}",
             f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def _get(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}{path}", params=params, timeout=30)
        assert r.status_code == 200, (path, params, r.text[:500])
        doc = r.json()
        assert doc["status"] == "success", doc
        return doc["data"]

    def instant(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return list(self._get("/api/v1/query", **params)["result"])

    def over(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                              step=f"{SCRAPE_S:g}s")["result"])

    def has(self, expr: str) -> bool:
        return has_data(self.instant(expr))

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self._get("/api/v1/rules")["groups"] for r in g["rules"]]

    def stop(self) -> None:
        stop(self.proc)


def has_data(result: list[dict[str, Any]]) -> bool:
    """At least one number (a NaN is what Grafana shows as no value)."""
    values = [v for s in result for _, v in ([s["value"]] if "value" in s else s["values"])]
    return any(not math.isnan(float(v)) for v in values)


# --- The stack and its timeline ------------------------------------------------------------------------------


@dataclass
class Stack:
    gw: Gateway
    prom: Prometheus
    spare: Sim
    """Started, not in the fleet: added later with a wrong KV-event port."""
    dead_port: int
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Name -> (start, end) in unix seconds: `baseline` and one per fault."""
    split: float = 0.0
    """The instant between the baseline traffic and the collapse."""


def chat(gw: Gateway, messages: list[dict[str, str]], stream: bool = False, max_tokens: int = 4,
         **headers: str) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    if stream and r.status_code == 200:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
    return r


def short(seed: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {seed}: name a colour."}]


def direct(sim: Sim, messages: list[dict[str, str]]) -> None:
    """A request sent to the worker itself (Cortex does not route it; the engine's KV events still flow)."""
    httpx.post(f"{sim.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
               timeout=60).raise_for_status()


def faults(sims: list[Sim], **kw: object) -> None:
    for s in sims:
        httpx.post(f"{s.url}/sim/faults", json=kw, timeout=10).raise_for_status()


def explain(gw: Gateway, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = httpx.post(gw.explain_url, json={"model": MODEL, "messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def scraped_requests(prom: Prometheus) -> float:
    result = prom.instant("sum(cortex_requests_total)")
    return float(result[0]["value"][1]) if result else 0.0


def settle(stack: Stack, name: str, start: float, probe: str, timeout: float = 30.0) -> None:
    """Close a fault's window once Prometheus shows its effect (`probe` returns data), two scrapes later."""
    wait_for(lambda: stack.prom.has(probe), timeout=timeout, interval=0.5, what=f"{name}: {probe}")
    time.sleep(2 * SCRAPE_S)  # the window's end holds two scrapes of the effect
    stack.windows[name] = (start, time.time())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("prometheus")
    ports = free_ports(14)
    sims = [Sim(id="sim-1", port=ports[0], kv_port=ports[1], replay_port=ports[2]),
            Sim(id="sim-2", port=ports[3], kv_port=ports[4])]
    spare = Sim(id="sim-3", port=ports[5], kv_port=ports[6], args=("--kv-events-port", "0"))
    dead_port = ports[7]  # nothing listens here
    # sim-2's replay endpoint answers nothing (a wrong port or a firewall): a hole in its stream stays STALE until
    # ingest gives up on the replay.
    workers = [sims[0].worker_config(), {**sims[1].worker_config(), "kv_replay": f"tcp://127.0.0.1:{dead_port}"}]
    gw = Gateway(root=root, sims=sims, port=ports[8], admin_port=ports[9], ingest_port=ports[10],
                 extproc_port=ports[11], observe_port=ports[12], observe_http_port=ports[13], extra_config={
                     "workers": workers,
                     "ingest": {"event_silence_s": 4.0},
                     # One limited tenant beside the default one, which sees Cortex's headers; no cache salts, so
                     # a prompt sent to a worker directly is the prompt Cortex routes.
                     "tenants": [{"id": "default", "trusted": True},
                                 {"id": "rate", "api_keys": [digest(RATE_KEY)],
                                  "limits": {"requests_per_s": 0.01, "burst": 1}}],
                     "admission": {"isolate_caches": False},
                     # A breaker that opens after two failed answers and tries again after a second, so the
                     # breaker phase sees it reopen within seconds (the defaults: 10 failures, 60 s).
                     "breaker": {"failure_threshold": 2, "open_s": 1.0, "half_open_trials": 3,
                                 "success_threshold": 1}})
    with contextlib.ExitStack() as running:
        with pytest.MonkeyPatch.context() as env:
            # The gateway's processes inherit the planted routing fault (and keep it across restarts).
            env.setenv("CORTEX_TEST_ROUTE_RAISES", PLANTED)
            env.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(ROUTE_FAULT), os.environ.get("PYTHONPATH")))))
            g = running.enter_context(serving(gw))
        start_sim(spare, root)
        running.callback(stop, spare.proc)
        prom = Prometheus(root, [f"127.0.0.1:{gw.ingest_port}"])
        running.callback(prom.stop)
        wait_for(lambda: prom.has('up{job="cortex"} == 1'), timeout=60, interval=0.5,
                 what="Prometheus's first scrape of the gateway")
        s = Stack(g, prom, spare, dead_port)
        run_timeline(s)
        t0 = s.windows["baseline"][0]
        print("timeline (s from start):",
              orjson.dumps({k: [round(a - t0, 1), round(b - t0, 1)] for k, (a, b) in s.windows.items()}))
        yield s


def run_timeline(s: Stack) -> None:
    baseline(s)
    over_claim(s)
    stale(s)
    gaps(s)
    wrong_kv_port(s)
    load_unknown(s)
    routing_bug(s)
    collapse(s)
    breaker(s)
    restarts(s)
    gateway_down(s)


def baseline(s: Stack) -> None:
    gw, start = s.gw, time.time()
    sent = 0
    # A counter's first scraped value is never part of a rate(): the engines' cached-token series is born with the
    # first hit, and on an idle machine the whole baseline's hits reached the first scrape of it (the collapse alert
    # then saw a baseline ratio of 0). So one hit makes the series, and the baseline's hits come after its scrape.
    for _ in range(2):
        assert chat(gw, long_chat(100, seed=0)).status_code == 200
        sent += 1
    wait_for(lambda: s.prom.has("cortex_engine_cached_tokens_total"), timeout=30, interval=0.5,
             what="the first cached tokens scraped")
    for seed in (1, 2):  # each prompt twice per kind: a miss, then a hit on the worker that cached it
        for stream in (False, True, False, True):
            assert chat(gw, long_chat(300, seed=seed), stream=stream).status_code == 200
            sent += 1
    big = long_chat(1500, seed=9)  # most of the baseline's prompt tokens, nearly all hits after the first
    for _ in range(4):
        assert chat(gw, big).status_code == 200
        sent += 1
    # Long answers at once: the workers' running requests show in their load readings.
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: chat(gw, short(1000 + i), stream=True, max_tokens=300), range(8)))
    assert all(r.status_code == 200 for r in answers)
    sent += 8
    bad = httpx.post(f"{gw.url}/v1/chat/completions", content=b"{not json", timeout=30,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400
    unknown = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "no-such-model", "messages": short(2)},
                         timeout=30)
    assert unknown.status_code == 404
    auth = f"Bearer {RATE_KEY}"
    assert chat(gw, short(3), authorization=auth).status_code == 200
    assert chat(gw, short(4), authorization=auth).status_code == 429
    sent += 2
    wait_for(lambda: scraped_requests(s.prom) >= sent, timeout=30, interval=0.5, what="the baseline scraped")
    time.sleep(2 * SCRAPE_S)
    s.windows["baseline"] = (start, time.time())


def over_claim(s: Stack) -> None:
    """KV events lost while the engine's cache was reset: the ledger still lists the prompt on sim-2, Cortex claims
    it, the engine has nothing cached."""
    gw, sim2, start = s.gw, s.gw.sims[1], time.time()
    prompt = long_chat(200, seed=77)
    direct(sim2, prompt)
    wait_for(lambda: next(w for w in explain(gw, prompt)["workers"] if w["id"] == "sim-2")["matched_tokens"],
             what="sim-2's blocks of the prompt in the ledger")
    faults([sim2], drop_events=1.0)
    try:
        for _ in range(5):
            httpx.post(f"{sim2.url}/reset_prefix_cache", timeout=10).raise_for_status()
            r = chat(gw, prompt)
            assert r.status_code == 200 and r.headers["x-cortex-assigned-worker"] == "sim-2", r.headers
            claimed = int(r.headers["x-cortex-cache-hit-tokens"])
            cached = (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            assert claimed > cached == 0  # the fault took: an over-claim
    finally:
        faults([sim2], drop_events=0.0)
    settle(s, "over_claim", start, 'sum(cortex_claim_check_total{outcome="over"}) >= 5')


def stale(s: Stack) -> None:
    """The next batch from sim-2 shows the hole; its replay endpoint does not answer, so the ledger stays STALE
    until ingest gives up on the replay and clears it (a resync)."""
    gw, sim2, start = s.gw, s.gw.sims[1], time.time()
    direct(sim2, short(2001))
    settle(s, "stale", start, 'max_over_time(cortex_target_sync_state{target="sim-2", state="STALE"}[1m]) == 1')
    wait_for(lambda: gw.targets()["sim-2"]["state"] == "READY", timeout=30, what="sim-2 rebuilt after the resync")


def gaps(s: Stack) -> None:
    """Sequence numbers skipped on sim-1, whose replay answers but cannot supply batches that were never sent:
    a gap, a replay and a resync each time."""
    gw, sim1, start = s.gw, s.gw.sims[0], time.time()
    before = gw.targets()["sim-1"]["gaps"]
    for i in range(11):
        faults([sim1], seq_gap=1)
        direct(sim1, short(3000 + i))
        wait_for(lambda i=i: gw.targets()["sim-1"]["gaps"] > before + i, timeout=20,
                 what=f"gap {i + 1} seen by ingest")
        # The next gap only counts as one once this one's replay and resync are over (on a loaded machine the
        # next batch arrived mid-resync, and its hole was the resync's, not a new gap).
        wait_for(lambda: gw.targets()["sim-1"]["state"] == "READY", timeout=30,
                 what=f"sim-1 resynced after gap {i + 1}")
    settle(s, "gaps", start, 'increase(cortex_ingest_replays_total{target="sim-1"}[15m]) > 10')


def wrong_kv_port(s: Stack) -> None:
    """A worker added with a KV-event port nothing listens on: its ledger never leaves CONNECTING (not ready);
    once it has served requests for ingest.event_silence_s, it is a worker that publishes no events."""
    gw, spare, start = s.gw, s.spare, time.time()
    cfg = {**spare.worker_config(), "kv_events": f"tcp://127.0.0.1:{s.dead_port}"}
    r = httpx.post(f"{gw.ingest_url}/cortex/workers", json=cfg, timeout=10)
    assert r.status_code in (200, 201), r.text
    wait_for(lambda: s.prom.has('cortex_target_sync_state{target="sim-3", state="CONNECTING"} == 1'),
             timeout=30, interval=0.5, what="sim-3 scraped while connecting")
    time.sleep(2 * SCRAPE_S)

    def silent() -> bool:
        direct(spare, short(4000 + int(time.time())))  # it works, yet no batch arrives
        return bool(gw.targets()["sim-3"]["events"] == "silent")

    wait_for(silent, timeout=30, interval=0.5, what="sim-3 named silent")
    settle(s, "wrong_kv_port", start, 'cortex_target_events_silent{target="sim-3"} == 1')
    assert httpx.delete(f"{gw.ingest_url}/cortex/workers/sim-3", timeout=10).status_code == 200


def load_unknown(s: Stack) -> None:
    """The workers' load endpoints answer 503: extproc routes by its fallback (p2c on its own counts)."""
    gw, start = s.gw, time.time()
    faults(gw.sims, load_endpoint_down=True)
    try:
        wait_for(lambda: explain(gw, short(5000))["mode"].startswith("fallback_"), timeout=30, interval=0.5,
                 what="load readings expired")
        assert chat(gw, short(5001), max_tokens=1).status_code == 200
        # The series is born with the first fallback: the rest count in rate().
        wait_for(lambda: s.prom.has('cortex_route_decisions_total{mode=~"fallback_.*"}'), timeout=30, interval=0.5,
                 what="the first fallback decision scraped")
        for i in range(100):
            assert chat(gw, short(5002 + i), max_tokens=1).status_code == 200
    finally:
        faults(gw.sims, load_endpoint_down=False)
    settle(s, "load_unknown", start, 'sum(cortex_route_decisions_total{mode=~"fallback_.*"}) >= 100')


def routing_bug(s: Stack) -> None:
    gw, start = s.gw, time.time()
    for i in range(2):
        r = chat(gw, [{"role": "user", "content": f"{PLANTED} {i}"}])
        assert r.status_code == 200  # served on Envoy's own balancing
        assert r.headers["x-cortex-route-reason"] == "extproc_error"
    settle(s, "routing_bug", start, "sum(cortex_extproc_internal_errors_total) >= 2")


def collapse(s: Stack) -> None:
    """After the baseline: every answer's first token 0.7 s late, no prompt cached (80 requests: the rules ask
    for at least 3 a minute over their window)."""
    gw = s.gw
    s.split = start = time.time()
    time.sleep(SCRAPE_S)
    before = scraped_requests(s.prom)
    faults(gw.sims, slow_first_token_ms=700)
    try:
        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(lambda i: chat(gw, long_chat(40, seed=6000 + i), stream=True), range(80)))
        assert all(r.status_code == 200 for r in answers)
    finally:
        faults(gw.sims, slow_first_token_ms=0)
    wait_for(lambda: scraped_requests(s.prom) >= before + 80, timeout=30, interval=0.5, what="the collapse scraped")
    time.sleep(2 * SCRAPE_S)
    s.windows["collapse"] = (start, time.time())


def breaker(s: Stack) -> None:
    """sim-2 answers 500 to every request while its health probe passes: Envoy retries each on sim-1 (every answer
    is a 200), sim-2's breaker opens, and each trial after `open_s` opens it again.

    A half-open worker gets a trial only when the policy picks it on its merits, so each request carries a prompt
    planted on sim-2 alone (sent to it directly): its cached prefix makes sim-2 the first choice whenever its
    breaker lets it be one, whatever the two workers' learned rates (the retry then plants it on sim-1 too)."""
    gw, sim2, start = s.gw, s.gw.sims[1], time.time()
    planted = [long_chat(200, seed=9100 + i) for i in range(8)]
    for prompt in planted:
        direct(sim2, prompt)
    wait_for(lambda: all(next(w for w in explain(gw, p)["workers"] if w["id"] == "sim-2")["matched_tokens"]
                         for p in planted), what="sim-2's blocks of every planted prompt in the ledger")
    probe = 'sum(increase(cortex_breaker_transitions_total{worker="sim-2", to_state="open"}[15m])) >= 3'
    faults([sim2], http_5xx_rate=1.0)
    try:
        # Two failures open it; each later request comes after `open_s`, when its breaker is half-open: 4 opens.
        for prompt in planted[:6]:
            r = chat(gw, prompt)
            assert r.status_code == 200, r.text
            time.sleep(1.3)
        settle(s, "breaker", start, probe)
    finally:
        faults([sim2], http_5xx_rate=0.0)


def restarts(s: Stack) -> None:
    for child, name, probe in (
            ("ingest", "ingest_restart", "changes(cortex_ingest_start_time_seconds[15m]) > 0"),
            ("extproc", "extproc_restart", "changes(cortex_extproc_start_time_seconds[15m]) > 0")):
        start = time.time()
        (pid,) = s.gw.child_pids(f"cortexctl.cli {child}")
        os.kill(pid, signal.SIGKILL)
        settle(s, name, start, probe, timeout=60)


def gateway_down(s: Stack) -> None:
    start = time.time()
    stop(s.gw.proc)
    settle(s, "gateway_down", start, 'up{job="cortex"} == 0')


# --- The checks ----------------------------------------------------------------------------------------------


def variants(q: Query) -> list[tuple[str, list[tuple[str, str]]]]:
    """(what, [(model, worker) choices]) to evaluate: a dashboard query with every value `.*`, and with the real
    model and a real worker (data for one of the workers is enough: a fault hits one worker)."""
    if not q.dashboard:
        return [("", [(".*", ".*")])]
    real = [(grafana_regex(MODEL), grafana_regex(w)) for w in ("sim-1", "sim-2")]
    return [("all", [(".*", ".*")]), ("one model, one worker", real)]


def evaluate(prom: Prometheus, q: Query, window: tuple[float, float], model: str, worker: str) -> bool:
    start, end = window
    expr = substitute(q.expr, model, worker, end - start)
    if q.id in LOOKBACK_S:
        return False  # only at its own instant (below)
    if q.instant:
        return has_data(prom.instant(expr, end))
    return has_data(prom.over(expr, start, end))


def test_every_rule_evaluates_without_error(stack: Stack) -> None:
    rules = stack.prom.rules()
    assert len(rules) == len([q for q in all_queries() if not q.dashboard])
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


def test_every_query_returns_data_without_a_fault(stack: Stack) -> None:
    empty = []
    for q in all_queries():
        if q.id in NEEDS_FAULT:
            continue
        for what, choices in variants(q):
            if not any(evaluate(stack.prom, q, stack.windows["baseline"], m, w) for m, w in choices):
                empty.append(f"{q.id} ({what}): {q.expr}" if what else f"{q.id}: {q.expr}")
    assert not empty, "no data over the baseline:\n" + "\n".join(empty)


def test_the_listed_queries_need_their_fault(stack: Stack) -> None:
    """Nothing over the baseline: a query that does not need its fault does not belong on the list."""
    filled = [q.id for q in all_queries() if q.id in NEEDS_FAULT
              for _, choices in variants(q)
              if any(evaluate(stack.prom, q, stack.windows["baseline"], m, w) for m, w in choices)]
    assert not filled, f"data without their fault: {sorted(set(filled))}"


def test_each_fault_fills_its_queries(stack: Stack) -> None:
    empty = []
    for q in all_queries():
        fault = NEEDS_FAULT.get(q.id)
        if fault is None:
            continue
        if q.id in LOOKBACK_S:
            # The collapse in the current window, the baseline in the offset one.
            at = stack.split + LOOKBACK_S[q.id]
            if not has_data(stack.prom.instant(q.expr, at)):
                parts = {name: stack.prom.instant(expr, at) for name, expr in DIAGNOSE.get(q.id, {}).items()}
                empty.append(f"{q.id} at split + {LOOKBACK_S[q.id]:.0f}s: "
                             + "; ".join(f"{n} = {[r['value'][1] for r in v]}" for n, v in parts.items()))
            continue
        for what, choices in variants(q):
            if not any(evaluate(stack.prom, q, stack.windows[fault], m, w) for m, w in choices):
                empty.append(f"{q.id} ({what}) over {fault}" if what else f"{q.id} over {fault}")
    assert not empty, "no data once the fault was injected:\n" + "\n".join(empty)


def test_the_alerts_went_pending_in_prometheus_itself(stack: Stack) -> None:
    """Prometheus's own rule evaluation (every second) made each alert pending during its fault, but the ones that
    compare with hours of history (never true in a two-minute run)."""
    start = stack.windows["baseline"][0]
    end = stack.windows["gateway_down"][1]
    pending = {s["metric"]["alertname"] for s in stack.prom.over("ALERTS", start, end)}
    expected = {q.id.split(":", 1)[1] for q in all_queries()
                if q.id.startswith("alert:") and q.id not in LOOKBACK_S}
    assert expected <= pending, sorted(expected - pending)


def test_recorded_series_exist(stack: Stack) -> None:
    start, end = stack.windows["baseline"]
    for name in ("cortex:worker_ttft_seconds:avg1m", "cortex:hit_ratio:rate5m"):
        assert has_data(stack.prom.over(name, start, end)), name
