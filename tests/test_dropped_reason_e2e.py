"""Every answer Cortex or its Envoy gives instead of a worker's says why, under both header names
(`x-cortex-dropped-reason`, llm-d's `x-llm-d-request-dropped-reason`), with an OpenAI error body: a refused body,
an unknown model, a path not served, a body over the limit, a refused tenant, a tenant over its rate, a worker
that takes too long to answer, workers that cannot be reached, no healthy worker at all (Envoy's and extproc's
answers). The PD refusals are checked in tests/test_pd_e2e.py, the waiting room's in
tests/test_waiting_room_e2e.py, the token limits' in tests/test_tenancy_e2e.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from extproc.tenants import digest
from tests.harness import MODEL, Gateway, Sim, cluster, stop, wait_for

pytestmark = pytest.mark.timeout(240)

KEY = "sk-dropped-rate-1"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, transport: str) -> Iterator[Gateway]:
    extra = {
        # No waiting room: a model without a healthy worker is refused at once rather than held for a worker.
        "admission": {"waiting_room": {"enabled": False}},
        "auth": {"tenant_header": "x-tenant"},
        "tenants": [{"id": "slow", "api_keys": [digest(KEY)], "limits": {"requests_per_s": 0.01, "burst": 1}}],
        "extproc": {"max_body_bytes": 4096},
        # A worker silent for 2 s before its first byte is given up on (Envoy's route idle timeout).
        "timeouts": {"routed_idle_s": 2.0},
    }
    with cluster(tmp_path_factory.mktemp("dropped"), extra_config=extra) as g:
        yield g


def refused(r: httpx.Response, status: int, reason: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers.get("x-cortex-dropped-reason") == reason, dict(r.headers)
    assert r.headers.get("x-llm-d-request-dropped-reason") == reason
    assert "x-cortex-assigned-worker" not in r.headers
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    return dict(err)


def chat(gw: Gateway, timeout: float = 30, **kw: Any) -> httpx.Response:
    body = kw.pop("json", {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=timeout, **kw)


def faults(sims: list[Sim], **kw: object) -> None:
    for s in sims:
        httpx.post(f"{s.url}/sim/faults", json=kw, timeout=5).raise_for_status()


def test_a_served_request_carries_no_dropped_reason(gw: Gateway) -> None:
    r = chat(gw)
    assert r.status_code == 200 and "x-cortex-dropped-reason" not in r.headers


@pytest.mark.parametrize(("body", "status", "reason"), [
    (b"{not json", 400, "invalid_request"),
    (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', 404, "model_not_found"),
    (b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "' + b"x" * 8000 + b'"}]}',
     413, "body_too_large"),
])
def test_refused_bodies(gw: Gateway, body: bytes, status: int, reason: str) -> None:
    r = httpx.post(f"{gw.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    refused(r, status, reason)


def test_a_path_the_gateway_does_not_serve(gw: Gateway) -> None:
    refused(httpx.post(f"{gw.url}/flush_cache", timeout=10), 404, "path_not_served")


def test_an_unknown_tenant_and_a_tenant_over_its_rate(gw: Gateway) -> None:
    err = refused(chat(gw, headers={"x-tenant": "nobody"}), 401, "unauthenticated")
    assert err["type"] == "authentication_error"
    auth = {"authorization": f"Bearer {KEY}"}
    assert chat(gw, headers=auth).status_code == 200  # the burst of one
    r = chat(gw, headers=auth)
    refused(r, 429, "rate_limited")
    assert int(r.headers["retry-after"]) >= 1


def test_a_worker_silent_past_the_idle_timeout(gw: Gateway) -> None:
    """Envoy's own 504 (its route idle timeout, before the worker's first byte)."""
    faults(gw.sims, slow_first_token_ms=30_000)
    try:
        err = refused(chat(gw, timeout=60), 504, "upstream_timeout")
        assert err["type"] == "upstream_error"
    finally:
        faults(gw.sims, slow_first_token_ms=0)


def test_workers_gone(gw: Gateway) -> None:
    """Last (it stops the workers): Envoy cannot reach the workers extproc chose; once ingest has marked them
    down extproc refuses the model itself; once they are removed from the fleet Envoy has no upstream at all for
    a request it balances itself (a worker's /health)."""
    for s in gw.sims:
        stop(s.proc)
    # Routed before any probe noticed (3 failed probes a second apart): both connects fail, Envoy answers.
    refused(chat(gw), 503, "upstream_connect_failure")
    wait_for(lambda: not any(w["healthy"] for w in gw.workers().values()), timeout=30, what="ingest to mark both down")
    # Ingest's list says so before extproc has read the view that says so (published at most every 0.1 s, read by
    # extproc on its next request): a request in between is still routed, and Envoy's connect fails.
    wait_for(lambda: chat(gw).headers.get("x-cortex-dropped-reason") == "no_worker", timeout=30,
             what="extproc to read the view that marks both down")
    err = refused(chat(gw), 503, "no_worker")
    assert err["param"] == "model"
    for s in gw.sims:
        assert httpx.delete(f"{gw.ingest_url}/cortex/workers/{s.id}", timeout=10).status_code == 200
    wait_for(lambda: httpx.get(f"{gw.url}/health", timeout=10).headers.get("x-cortex-dropped-reason")
             == "no_healthy_upstream", timeout=30, what="Envoy's pools to be empty")
    refused(httpx.get(f"{gw.url}/health", timeout=10), 503, "no_healthy_upstream")
