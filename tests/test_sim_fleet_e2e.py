"""Many simulated workers in one process (`cortex sim --workers N`), behind a real `cortex run`, and the view-lag
metric that fleet-scale measurements read (issue 28).

Each worker of the fleet process must be, to Cortex, a separate engine: its own ports, cache and event stream,
so a repeat goes exactly to the worker that cached the prompt and the claim equals what that worker reports.
Every wait is a condition with a deadline; nothing is timed.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortexsim.config import SimConfig
from cortexsim.fleet import base_port_layout, fleet_configs
from ingest.lag import BUCKETS, WINDOW_S, ViewLag
from tests.harness import (
    MODEL,
    PY,
    Gateway,
    Sim,
    chat_once,
    free_ports,
    free_run,
    long_chat,
    routed_to,
    start_gateway,
    stop,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)

N = 4


def test_fleet_port_layout() -> None:
    cfgs = fleet_configs(SimConfig(port=9000, kv_events_port=9100, kv_replay_port=9200, dp_size=2), 3)
    assert [(c.worker_id, c.port, c.kv_events_port, c.kv_replay_port) for c in cfgs] == [
        ("sim-1", 9000, 9100, 9200), ("sim-2", 9001, 9102, 9202), ("sim-3", 9002, 9104, 9204)]
    # OS-chosen stays OS-chosen, off stays off; one worker is the configuration as given.
    cfgs = fleet_configs(SimConfig(port=0, kv_events_port=None, kv_replay_port=0, worker_id="w"), 2)
    assert [(c.worker_id, c.port, c.kv_events_port, c.kv_replay_port) for c in cfgs] == [
        ("w-1", 0, None, 0), ("w-2", 0, None, 0)]
    one = SimConfig(port=8000, worker_id="solo")
    assert fleet_configs(one, 1) == [one]
    assert base_port_layout(20000, 4, 1) == (20000, 20004, 20008)
    with pytest.raises(ValueError, match="runs past port 65535"):
        fleet_configs(SimConfig(port=65530), 8)
    with pytest.raises(ValueError, match="need ports up to"):
        base_port_layout(65000, 256, 1)


def test_view_lag_histogram_and_window() -> None:
    lag = ViewLag(start=100.0)
    lag.observe(0.002, now=100.0)
    lag.observe(0.3, now=101.0)
    lag.observe(100.0, now=102.0)  # beyond the last bound: counted in +Inf
    cumulative = dict(lag.buckets())
    assert cumulative["0.0025"] == 1 and cumulative["0.5"] == 2 and cumulative[str(BUCKETS[-1])] == 2
    assert cumulative["+Inf"] == 3 and lag.sum == pytest.approx(100.302)
    assert lag.recent_max(now=102.0) == 100.0
    # The previous window still counts for one more window, then is forgotten.
    assert lag.recent_max(now=100.0 + WINDOW_S + 1) == 100.0
    lag.observe(0.01, now=100.0 + WINDOW_S + 2)
    assert lag.recent_max(now=100.0 + 2 * WINDOW_S + 3) == 0.01
    assert lag.recent_max(now=100.0 + 5 * WINDOW_S) == 0.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, subprocess.Popen[bytes], Path]]:
    root = tmp_path_factory.mktemp("sim-fleet")
    base = free_run(3 * N)
    log = root / "fleet.log"
    proc = subprocess.Popen([*PY, "sim", "--workers", str(N), "--base-port", str(base), "--model", MODEL],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: f"sim fleet workers={N}".encode() in log.read_bytes() or proc.poll() is not None,
                 timeout=60, what="the fleet's ready line")
        assert proc.poll() is None, log.read_text()
        sims = [Sim(id=f"sim-{i + 1}", port=base + i, kv_port=base + N + i, replay_port=base + 2 * N + i)
                for i in range(N)]
        ports = free_ports(4)
        gw = Gateway(root=root, sims=sims, port=ports[0], admin_port=ports[1], ingest_port=ports[2],
                     extproc_port=ports[3])
        try:
            start_gateway(gw)
            yield gw, proc, log
        finally:
            stop(gw.proc)
    finally:
        stop(proc)


def test_one_process_announces_every_worker_with_its_own_ports(
        fleet: tuple[Gateway, subprocess.Popen[bytes], Path]) -> None:
    gw, _, log = fleet
    lines = re.findall(r"sim ready worker=(\S+) http=(\S+) kv_events=(\S+) kv_replay=(\S+)", log.read_text())
    assert [(w, h) for w, h, _, _ in lines] == [(s.id, f"127.0.0.1:{s.port}") for s in gw.sims]
    assert [e for _, _, e, _ in lines] == [f"tcp://127.0.0.1:{s.kv_port}" for s in gw.sims]
    assert [r for _, _, _, r in lines] == [f"tcp://127.0.0.1:{s.replay_port}" for s in gw.sims]
    for s in gw.sims:
        r = httpx.get(f"{s.url}/v1/models", timeout=5)
        assert r.status_code == 200 and r.headers["x-sim-worker"] == s.id
    assert set(gw.targets()) == {s.id for s in gw.sims}
    assert all(t["exact_kv"] for t in gw.targets().values())


def test_fleet_workers_are_routed_exactly(fleet: tuple[Gateway, subprocess.Popen[bytes], Path]) -> None:
    """Each worker's cache and event stream are its own: a repeat goes to the worker that cached the prompt,
    and Cortex claims exactly the tokens that worker then reports cached."""
    gw, _, _ = fleet
    holders = set()
    for seed in range(6):
        messages = long_chat(300, seed=100 + seed)
        holder, mode, claimed, cached = chat_once(gw, messages)
        assert (mode, claimed, cached) == ("load_aware", 0, 0)
        wait_for(lambda: routed_to(gw, messages, holder), timeout=30,  # noqa: B023
                 what=f"the ledger to show {holder} holding the prompt")
        worker, mode, claimed, cached = chat_once(gw, messages)
        assert (worker, mode) == (holder, "exact_kv_events")
        assert claimed == cached > 0
        holders.add(holder)
    assert len(holders) > 1  # load spread new prompts over several of the fleet's workers


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m[1]) if m else None


def test_view_lag_metric_after_events(fleet: tuple[Gateway, subprocess.Popen[bytes], Path]) -> None:
    gw, _, _ = fleet
    before = metric(httpx.get(f"{gw.ingest_url}/metrics", timeout=10).text, "cortex_ingest_view_lag_seconds_count")
    # Synthetic load submitted to each worker's engine (no HTTP chat): every request stores blocks.
    for s in gw.sims:
        r = httpx.post(f"{s.url}/sim/drive", json={"once": True, "prompt_tokens": 64}, timeout=10)
        assert r.status_code == 200 and r.json()["submitted"] >= 1

    def grown() -> str | None:
        text = httpx.get(f"{gw.ingest_url}/metrics", timeout=10).text
        count = metric(text, "cortex_ingest_view_lag_seconds_count")
        return text if count is not None and count >= (before or 0) + N else None

    text = wait_for(grown, timeout=30, what="ingest to apply the driven batches")
    assert metric(text, 'cortex_ingest_view_lag_seconds_bucket{le="+Inf"}') == \
        metric(text, "cortex_ingest_view_lag_seconds_count")
    lag_max = metric(text, "cortex_ingest_view_lag_max_seconds")
    assert lag_max is not None and lag_max >= 0
    # One series per process, not one per worker.
    assert len(re.findall(r"^cortex_ingest_view_lag_max_seconds", text, re.M)) == 1


def test_drive_rejects_bad_input(fleet: tuple[Gateway, subprocess.Popen[bytes], Path]) -> None:
    gw, _, _ = fleet
    url = f"{gw.sims[0].url}/sim/drive"
    for body, message in (({"rate": -1}, "rate must be within"), ({"prompt_tokens": 0}, "prompt_tokens"),
                          ({"prompt_tokens": 8, "prefix_tokens": 9}, "prefix_tokens"),
                          ({"rate": "fast"}, "rate must be a number")):
        r = httpx.post(url, json=body, timeout=5)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    started: dict[str, Any] = httpx.post(url, json={"rate": 5, "prompt_tokens": 32}, timeout=5).json()
    try:
        wait_for(lambda: httpx.get(url, timeout=5).json()["submitted"] > started["submitted"], timeout=30,
                 what="the drive to submit")
    finally:
        assert httpx.post(url, json={"rate": 0}, timeout=5).status_code == 200


def test_ingest_and_extproc_settle_their_heaps_and_report_their_pauses(
        fleet: tuple[Gateway, subprocess.Popen[bytes], Path]) -> None:
    """Both settled the heap start-up left (cortex/gc_pauses.py: kept out of every full collection's walk) and
    export their collector's pauses by generation; extproc's arrive with its upkeep."""
    gw, _, _ = fleet

    def exported() -> str | None:
        text = httpx.get(f"{gw.ingest_url}/metrics", timeout=10).text
        count = metric(text, 'cortex_extproc_gc_pause_seconds_count{generation="2"}')
        return text if count is not None and count >= 1 else None

    text = wait_for(exported, timeout=30, what="extproc's pauses in /metrics")
    for process in ("ingest", "extproc"):
        frozen = metric(text, f"cortex_{process}_gc_frozen_objects")
        assert frozen is not None and frozen > 10_000, (process, frozen)  # the modules, tokenizers and config
        for generation in "012":
            labels = f'generation="{generation}"'
            count = metric(text, f"cortex_{process}_gc_pause_seconds_count{{{labels}}}")
            assert count is not None, (process, generation)
            assert metric(text, f'cortex_{process}_gc_pause_seconds_bucket{{{labels},le="+Inf"}}') == count
        # The settle's own full collection at least.
        assert (metric(text, f'cortex_{process}_gc_pause_seconds_count{{generation="2"}}') or 0) >= 1
