"""Upstream mutual TLS end to end: simulated workers that serve HTTPS and require a client certificate, behind the
real Envoy with ingest and extproc. Cortex reaches the trusted ones on every path (Envoy's requests and health
checks, ingest's health, load and tokenizer-parity probes) and routes by KV; a worker whose certificate is not
trusted is marked down by both and never gets a request, in TLS or in plaintext."""

from __future__ import annotations

import re
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex.config import load_config
from cortex.envoy_config import pool_cluster
from tests.harness import MODEL, Gateway, Sim, free_ports, long_chat, serving, wait_for
from tests.test_gateway import chat
from tests.tlskit import Pki, make_pki

pytestmark = pytest.mark.timeout(180)


def client_ctx(ca: Path, pki: Pki) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return ctx


def tls_sim(wid: str, port: int, kv: int, pki: Pki, *, rogue: bool = False) -> Sim:
    cert, key, ca = (pki.rogue_cert, pki.rogue_key, pki.ca.parent / "rogue-ca.crt") if rogue else (
        pki.server_cert, pki.server_key, pki.ca)
    # Every worker requires a client certificate signed by the gateway's CA (--ssl-cert-reqs 2, as vLLM takes it).
    args = ("--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ca-certs", str(pki.ca),
            "--ssl-cert-reqs", "2")
    # The untrusted worker publishes no events: the gateway is ready without it.
    return Sim(id=wid, port=port, kv_port=kv, args=args, events=not rogue, tls_client={"verify": client_ctx(ca, pki)})


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Gateway]:
    ports = free_ports(10)
    sims = [tls_sim("sim-1", ports[0], ports[1], pki), tls_sim("sim-2", ports[2], ports[3], pki),
            tls_sim("rogue", ports[4], ports[5], pki, rogue=True)]
    gw = Gateway(root=tmp_path_factory.mktemp("tls"), sims=sims, port=ports[6], admin_port=ports[7],
                 ingest_port=ports[8], extproc_port=ports[9], extra_config={
                     "upstream_tls": {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert),
                                      "key_file": str(pki.client_key)},
                     "ingest": {"health_failures": 1}})
    with serving(gw):
        yield gw


def envoy_health(gw: Gateway) -> dict[str, str]:
    """Envoy's health flags of the model's pool, by worker port."""
    text = httpx.get(f"http://127.0.0.1:{gw.admin_port}/clusters", timeout=5).text
    pool = pool_cluster(MODEL)
    return {m[1]: m[2] for m in re.finditer(rf"^{pool}::127\.0\.0\.1:(\d+)::health_flags::(\S+)$", text, re.M)}


def sim_requests(sim: Sim) -> dict[str, Any]:
    return httpx.get(f"{sim.url}/sim/requests", timeout=5, **(sim.tls_client or {})).json()["paths"]


def test_the_workers_require_a_client_certificate(gw: Gateway, pki: Pki) -> None:
    # What makes the rest mean something: a client without Cortex's certificate is refused by the workers.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{gw.sims[0].url}/health", timeout=5, verify=ssl.create_default_context(cafile=str(pki.ca)))
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{gw.sims[0].port}/health", timeout=5)  # and plaintext is not spoken


def test_trusted_workers_are_healthy_and_kv_routed_the_untrusted_one_is_refused(gw: Gateway) -> None:
    trusted, rogue = gw.sims[:2], gw.sims[2]
    assert gw.config()["workers"][0]["url"].startswith("https://")
    assert load_config(gw.root / "cortex.yaml").workers[0].tls
    # The gateway came up with both trusted workers in exact-KV standing: ingest's probes (health, load,
    # tokenizer parity through /tokenize) reached them over mutual TLS.
    workers = wait_for(lambda: (lambda ws: ws if not ws["rogue"]["healthy"] else None)(gw.workers()),
                       timeout=30, what="the untrusted worker marked down by ingest")
    for s in trusted:
        assert workers[s.id]["healthy"] and not workers[s.id]["suspect"], workers[s.id]
        assert workers[s.id]["token_parity"]["status"] == "ok", workers[s.id]
    assert workers["rogue"]["health_failures"] >= 1
    # Envoy's own health checks use the same TLS socket per endpoint: the trusted pass, the untrusted fails.
    flags = wait_for(lambda: (lambda f: f if f.get(str(rogue.port), "healthy") != "healthy"
                              and all(f.get(str(s.port)) == "healthy" for s in trusted) else None)(envoy_health(gw)),
                     timeout=30, what="Envoy's health checks over TLS")
    assert "failed_active_hc" in flags[str(rogue.port)], flags

    messages = long_chat(300, seed=17)
    h1, _ = chat(gw, messages)
    assert h1["x-cortex-assigned-worker"] in {s.id for s in trusted}
    # Once the holder's KV events are in, the repeat is routed to it by the ledger and served from its cache.
    wait_for(lambda: httpx.post(gw.explain_url, json={"model": MODEL, "messages": messages},
                                timeout=10).json()["mode"] == "exact_kv_events", what="prompt in the ledger")
    h2, usage = chat(gw, messages)
    assert h2["x-cortex-assigned-worker"] == h1["x-cortex-assigned-worker"]
    assert int(h2["x-cortex-cache-hit-tokens"]) > 0
    assert int(h2["x-cortex-cache-hit-tokens"]) == usage["prompt_tokens_details"]["cached_tokens"]

    # The untrusted worker never answered a single HTTP request from the gateway: every handshake failed on the
    # certificate, before a byte of a request was sent (no plaintext fallback, no request over a bad channel).
    # Only this test's own reads (/health while starting it, /sim/requests) reached it.
    seen = sim_requests(rogue)
    assert set(seen) <= {"/health", "/sim/requests"}, seen
    before = seen.get("/health", 0)
    failures = gw.workers()["rogue"]["health_failures"]
    wait_for(lambda: gw.workers()["rogue"]["health_failures"] >= failures + 2, timeout=30,
             what="two more probes of the untrusted worker")
    assert sim_requests(rogue).get("/health", 0) == before


# -- extproc's own requests: a vLLM PD pair's prefill leg, and the fallback it sends itself ---------------------

@pytest.fixture(scope="module")
def pd_gw(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Gateway]:
    ports = free_ports(8)
    sims = [tls_sim("vp1", ports[0], ports[1], pki), tls_sim("vd1", ports[2], ports[3], pki)]
    sims[0].role, sims[1].role = "prefill", "decode"
    sims[1].args += ("--kv-load-failure-policy", "fail")
    gw = Gateway(root=tmp_path_factory.mktemp("tls-pd"), sims=sims, port=ports[4], admin_port=ports[5],
                 ingest_port=ports[6], extproc_port=ports[7], extra_config={
                     "upstream_tls": {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert),
                                      "key_file": str(pki.client_key)}})
    with serving(gw):
        yield gw


def pd_chat(gw: Gateway, seed: int) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": long_chat(400, seed),
                                                             "max_tokens": 4}, timeout=60)


def test_pd_legs_that_extproc_sends_itself_go_over_mutual_tls(pd_gw: Gateway) -> None:
    vp1 = pd_gw.sims[0]
    before = sim_requests(vp1).get("/v1/chat/completions", 0)
    resp = pd_chat(pd_gw, seed=31)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-cortex-pd"] == "pair"
    assert resp.headers["x-cortex-assigned-worker"] == "prefill=vp1,decode=vd1"
    # The prefill leg is extproc's own request (aiohttp), the decode Envoy's: both reached workers that require
    # Cortex's client certificate.
    assert sim_requests(vp1).get("/v1/chat/completions", 0) == before + 1
    httpx.post(f"{vp1.url}/sim/faults", json={"pd_transfer_fail": True}, timeout=5,
               **(vp1.tls_client or {})).raise_for_status()
    try:
        # The decoder rejects the transfer: extproc sends the request to the prefill worker itself, over TLS.
        resp = pd_chat(pd_gw, seed=32)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-cortex-pd"] == "fallback:decode_failed"
        assert resp.headers["x-cortex-assigned-worker"] == "vp1"
    finally:
        httpx.post(f"{vp1.url}/sim/faults", json={"pd_transfer_fail": False}, timeout=5, **(vp1.tls_client or {}))
