"""Peered replicas through the real stack (docs/replicas.md): two `cortex run` gateways over the same two
simulated vLLM workers, each publishing its own work to the other (`peers`). What one replica sends a worker is
in the other's queue for that worker at once, before any engine count could say so, and it routes around it;
when the peer dies its work leaves the survivor's view within `peers.stale_after_s`. Each worker's load is read by
one of them and shared with the other, until that one goes. Assertions are on what was
decided and reported, never on how fast."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cortex import peering
from tests.harness import MODEL, Gateway, Sim, free_ports, long_chat, start_gateway, start_sim, stop, wait_for

pytestmark = pytest.mark.timeout(300)

# The model prices a prompt token at 20 ms (no step or attention term, no calibration): a 1 000-token prompt is
# 20 s of predicted prefill, far longer than the test needs to look at it, however loaded the machine.
SCHEDULER = {"alpha_ms_per_token": 20.0, "attention_ms_per_token2": 0.0, "step_ms": 0.0, "calibrate": False,
             "running_ms_per_request": 0.0, "cold_start_s": 0, "replicas": 2}


def gateway(root: Path, name: str, sims: list[Sim], port: int, peer_port: int) -> Gateway:
    home = root / name
    home.mkdir()
    gw_port, admin, ingest, extproc = free_ports(4)
    peers = {"host": "127.0.0.1", "port": port, "connect": [f"127.0.0.1:{peer_port}"], "replica_id": name,
             "heartbeat_s": 0.2, "stale_after_s": 1.0}
    return Gateway(root=home, sims=sims, port=gw_port, admin_port=admin, ingest_port=ingest, extproc_port=extproc,
                   extra_config={"scheduler": SCHEDULER, "peers": peers})


@contextlib.contextmanager
def fleet(root: Path) -> Iterator[tuple[Gateway, Gateway]]:
    ports = free_ports(6)
    sims = [Sim(id=f"sim-{i + 1}", port=ports[2 * i], kv_port=ports[2 * i + 1]) for i in range(2)]
    pa, pb = ports[4], ports[5]
    a, b = gateway(root, "a", sims, pa, pb), gateway(root, "b", sims, pb, pa)
    try:
        for s in sims:
            start_sim(s, root)
        start_gateway(a)
        start_gateway(b)
        yield a, b
    finally:
        stop(a.proc)
        stop(b.proc)
        for s in sims:
            stop(s.proc)


def faults(sims: list[Sim], **kw: object) -> None:
    for s in sims:
        httpx.post(f"{s.url}/sim/faults", json=kw, timeout=5).raise_for_status()


def metric(gw: Gateway, name: str, **labels: str) -> float:
    text = httpx.get(f"{gw.ingest_url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def explain(gw: Gateway, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = httpx.post(gw.explain_url, json={"model": MODEL, "messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def queues(d: dict[str, Any]) -> dict[str, float]:
    return {w["id"]: float(w["time_model"]["queue_ms"]) for w in d["workers"]}


def explain_timed(gw: Gateway, messages: list[dict[str, str]]) -> dict[str, Any]:
    """Route explain once every worker's load is known, so each has its time model: while peers hand the reading
    of a worker's load over (one joined, or went silent), the worker's last reading may age out first, and the
    decision is then made on load unknown, without the model."""
    def timed() -> dict[str, Any] | None:
        d = explain(gw, messages)
        return d if all("time_model" in w for w in d["workers"]) else None
    return wait_for(timed, timeout=15, what="every worker's load known to the replica")


def test_a_peers_work_is_in_the_queue_at_once_and_leaves_with_the_peer(tmp_path: Path) -> None:
    with fleet(tmp_path) as (a, b):
        wait_for(lambda: metric(a, "cortex_peers") == 1 and metric(b, "cortex_peers") == 1, timeout=30,
                 what="each replica hearing the other")
        assert queues(explain_timed(b, long_chat(1000, seed=2))) == {"sim-1": 0.0, "sim-2": 0.0}
        # A sends one ~1 000-token chat whose first token its worker holds back for a minute: while it is in flight,
        # only A's report can tell B of the 20 s of prefill A predicts it queued there (a request that has ended
        # settles its queue, extproc/backlog.py).
        faults(a.sims, slow_first_token_ms=60_000)

        def send() -> None:
            with contextlib.suppress(httpx.HTTPError):  # cut short when A stops below
                httpx.post(f"{a.url}/v1/chat/completions", json={"model": MODEL, "messages": long_chat(1000, seed=1),
                                                                  "max_tokens": 1}, timeout=120)
        threading.Thread(target=send, daemon=True).start()

        def carried() -> dict[str, Any] | None:
            d = explain(b, long_chat(1000, seed=3))
            return d if max(queues(d).values()) > 5000 else None
        d = wait_for(carried, timeout=15, what="B's queue for A's worker to carry A's work")
        faults(a.sims, slow_first_token_ms=0)
        busy = max(queues(d), key=queues(d).__getitem__)
        idle = ({"sim-1", "sim-2"} - {busy}).pop()
        assert queues(d)[idle] == 0.0 and d["chosen"] == idle, d
        assert metric(b, "cortex_peer_reports_total", outcome="applied") > 0
        # A goes away: B drops what A said once A is silent, long before A's predicted work would have drained.
        stop(a.proc)
        wait_for(lambda: metric(b, "cortex_peers") == 0, timeout=15, what="B noticing A gone")
        assert queues(explain_timed(b, long_chat(1000, seed=3)))[busy] == 0.0
        # And B still routes.
        r = httpx.post(f"{b.url}/v1/chat/completions", json={"model": MODEL, "messages": long_chat(50, seed=4),
                                                              "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text


def test_each_workers_load_is_read_by_one_replica_until_it_goes(tmp_path: Path) -> None:
    """Shared load readings (docs/replicas.md, "Load readings, read once"): each worker's `/metrics` is read by its
    reader among the live replicas, whose readings the other applies instead of reading it; when the reader goes,
    the survivor reads every worker itself again."""
    with fleet(tmp_path) as (a, b):
        wait_for(lambda: metric(a, "cortex_peers") == 1 and metric(b, "cortex_peers") == 1, timeout=30,
                 what="each replica hearing the other")
        reader = {w: peering.reader_of(w, ["a", "b"]) for w in ("sim-1", "sim-2")}
        gateways = {"a": a, "b": b}

        def read_by(gw: Gateway) -> dict[str, str]:
            return {tid: t["load"]["read_by"] for tid, t in gw.targets().items()}

        def shared() -> bool:
            return all(read_by(gateways[r])[w] == "self" and read_by(gateways[({"a", "b"} - {r}).pop()])[w] == r
                       for w, r in reader.items())
        wait_for(shared, timeout=30, what=f"each worker read by its reader only ({reader})")
        for name, gw in gateways.items():
            mine = sum(1 for r in reader.values() if r == name)
            assert metric(gw, "cortex_ingest_load_readings_total", source="peer") > 0 or mine == 2, name
        # b goes: a reads every worker itself again once b's readings stop (patience, then b's silence).
        stop(b.proc)
        wait_for(lambda: metric(a, "cortex_peers") == 0, timeout=15, what="a noticing b gone")
        wait_for(lambda: set(read_by(a).values()) == {"self"}, timeout=15, what="a reading every worker itself")
        before = metric(a, "cortex_ingest_load_readings_total", source="read")
        wait_for(lambda: metric(a, "cortex_ingest_load_readings_total", source="read") >= before + 2, timeout=15,
                 what="a's own reads going on")
