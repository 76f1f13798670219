"""/health/ready means a request sent now is routed by Cortex (issue 11, defect 2), through the real gateway."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cortex import grpc_health
from tests.harness import MODEL, PY, Gateway, Sim, free_ports, free_run, long_chat, start_sim, stop, wait_for


@pytest.mark.timeout(240)
def test_ready_only_once_every_extproc_serves_and_envoy_routes(tmp_path: Path) -> None:
    ports = free_ports(6)
    sim = Sim(id="sim-1", port=ports[0], kv_port=ports[1], replay_port=ports[2])
    gw = Gateway(root=tmp_path, sims=[sim], port=ports[3], admin_port=ports[4], ingest_port=ports[5],
                 extproc_port=free_run(2), extproc_processes=2)
    ready_url = f"{gw.ingest_url}/health/ready"
    answers: list[tuple[int, dict[str, Any]]] = []

    def ready() -> bool:
        assert gw.proc is not None
        if gw.proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {gw.log.read_text()[-2000:]}")
        try:
            r = httpx.get(ready_url, timeout=5)
        except httpx.TransportError:
            return False  # ingest not listening yet
        answers.append((r.status_code, r.json()))
        return r.status_code == 200

    try:
        start_sim(sim, tmp_path)
        cfg_path = tmp_path / "cortex.yaml"
        cfg_path.write_text(yaml.safe_dump(gw.config()))
        gw.proc = subprocess.Popen([*PY, "run", "-c", str(cfg_path)], stdout=gw.log.open("wb"),
                                   stderr=subprocess.STDOUT, start_new_session=True)
        # Poll as a readiness probe would, from the first moment; the first 200 is the moment that matters.
        wait_for(ready, timeout=180, interval=0.02, what="/health/ready 200")
        # Sent at once: each request is routed by Cortex (x-cortex-* headers), whichever extproc process
        # Envoy hands its stream to, never by Envoy's fail-open route.
        for i in range(6):
            r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "messages": long_chat(40, seed=i), "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.headers.get("x-cortex-match-mode"), dict(r.headers)
        models = httpx.get(f"{gw.url}/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"][0]["owned_by"] == "cortex"

        for status, body in answers[:-1]:  # before ready: 503 with the reason, never a premature 200
            assert status == 503 and body["status"] == "not_ready" and body["reason"], body
        body = answers[-1][1]
        assert body["status"] == "ready"
        assert [e["ok"] for e in body["checks"]["extproc"]] == [True, True]
        assert body["checks"]["envoy"]["ok"] and body["checks"]["ledger_view"]["ok"]
        sub = body["workers"][0]["targets"][0]["subscription"]
        assert sub["state"] in ("connecting", "replaying", "live") and sub["endpoint"] == f"tcp://127.0.0.1:{sim.kv_port}"
        assert sub["replay"] == f"tcp://127.0.0.1:{sim.replay_port}"
        wait_for(lambda: gw.targets()["sim-1"]["subscription"]["state"] == "live", what="subscription live")

        # One extproc process stops answering: not ready, naming it; ready again once it answers.
        (pid,) = gw.child_pids("--index 1")
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: (r := httpx.get(ready_url, timeout=5)).status_code == 503
                     and "extproc 1" in r.json()["reason"], what="not ready while extproc 1 is stopped")
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: httpx.get(ready_url, timeout=5).status_code == 200, what="ready again")
    finally:
        stop(gw.proc)
        stop(sim.proc)


@pytest.mark.parametrize(("service", "wire"), [
    ("", b""),  # proto3: the default value is not sent
    ("cortex.ledger_view", b"\x0a\x12cortex.ledger_view"),
    ("s" * 200, b"\x0a\xc8\x01" + b"s" * 200),  # a two-byte length
])
def test_health_request_vectors(service: str, wire: bytes) -> None:
    assert grpc_health.encode_request(service) == wire
    assert grpc_health.decode_request(wire) == service


def test_health_wire_edge_cases() -> None:
    # An unknown varint field before the service is skipped; garbage reads as the whole-server check.
    assert grpc_health.decode_request(b"\x10\x05\x0a\x01x") == "x"
    assert grpc_health.decode_request(b"\xff") == ""
    assert [grpc_health.encode_response(s) for s in (0, 1, 2)] == [b"", b"\x08\x01", b"\x08\x02"]
    assert [grpc_health.decode_response(b) for b in (b"", b"\x08\x01", b"\x08\x02")] == [0, 1, 2]
