"""Tenants' caches kept apart, end to end for both engines: one simulated worker (so every request meets every
other's blocks unless the salt keeps them apart), the real Envoy, ingest, extproc and the observer.

Tenant A's prompt is never a hit for tenant B (the engine's own cached_tokens is 0 for B's identical prompt, and
Cortex claims 0), while A's repeat hits and two tenants of one shared_prefix_group share hits; a client's own
cache_salt still separates inside a tenant. Untrusted tenants get no x-cortex-* routing headers and 403 from
route explain; trusted ones get both."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from extproc.tenants import digest
from tests.harness import MODEL, Gateway, cluster, long_chat, pd_cluster, wait_for

pytestmark = pytest.mark.timeout(300)

TENANTS = [
    {"id": "alice", "api_keys": [digest("key-alice")], "trusted": True},
    {"id": "bob", "api_keys": [digest("key-bob")]},
    {"id": "carol", "api_keys": [digest("key-carol")], "trusted": True, "shared_prefix_group": "team"},
    {"id": "dave", "api_keys": [digest("key-dave")], "shared_prefix_group": "team"},
    # Each test's "cold" check is a tenant's first request in its namespace: SGLang caches single tokens, so the
    # chat template's few leading tokens of an earlier prompt of the same tenant would be a (legitimate) hit.
    {"id": "erin", "api_keys": [digest("key-erin")], "trusted": True},
    {"id": "frank", "api_keys": [digest("key-frank")], "trusted": True},
]
ROUTING = ("x-cortex-assigned-worker", "x-cortex-cache-hit-tokens", "x-cortex-match-mode", "x-cortex-route-reason")
_ids = itertools.count()


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, transport: str) -> Iterator[Gateway]:
    engine = request.param
    # Route explain on the public listener too (for trusted tenants only): what is checked here.
    # A pool the module's chats never fill: what is checked here is the salts, not claims under eviction pressure
    # (a pool that evicts makes the claim rule hold back claims on prefixes sent a while ago, rightly).
    with cluster(tmp_path_factory.mktemp(f"isolation-{engine}"), n_sims=1, engine=engine,
                 sim_args=("--num-blocks", "16384" if engine == "vllm" else "262144"),
                 extra_config={"tenants": TENANTS, "auth": {"required": True},
                               "extproc": {"public_route_explain": True}}) as g:
        yield g


def auth(who: str) -> dict[str, str]:
    return {"authorization": f"Bearer key-{who}"}


def post(gw: Gateway, who: str, messages: list[dict[str, str]], **fields: Any) -> tuple[str, httpx.Headers, int]:
    """(request id, response headers, the engine's cached_tokens)."""
    rid = f"iso-{who}-{next(_ids)}"
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4,
                                                          **fields},
                   headers={**auth(who), "x-request-id": rid}, timeout=60)
    assert r.status_code == 200, r.text
    return rid, r.headers, (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def explain(gw: Gateway, who: str, messages: list[dict[str, str]], **fields: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/cortex/v1/route", json={"model": MODEL, "messages": messages, **fields},
                      headers=auth(who), timeout=30)


def settle(gw: Gateway, who: str, messages: list[dict[str, str]], **fields: Any) -> None:
    """Wait until the worker's events for the prompt, as `who` sends it, are in the ledger (as `who` sees it)."""
    def ready() -> bool:
        doc = explain(gw, who, messages, **fields).json()
        return doc["mode"] == "exact_kv_events" and doc["cache_hit_tokens"] > 0
    wait_for(ready, timeout=20, what="the prompt's blocks in the ledger")


def observed(gw: Gateway, rid: str) -> dict[str, Any]:
    """The observer's record of the request: the claim Cortex made for it and the engine's own figure."""
    def find() -> dict[str, Any] | None:
        doc = httpx.get(f"{gw.observe_url}/cortex/decisions?limit=200", timeout=5).json()
        return next((d for d in doc["decisions"] if d["request_id"] == rid), None)
    return wait_for(find, timeout=20, what=f"the observer's entry for {rid}")


def decisions(gw: Gateway) -> list[dict[str, Any]]:
    return list(httpx.get(f"{gw.observe_url}/cortex/decisions?limit=200", timeout=5).json()["decisions"])


def observed_next(gw: Gateway, count: int) -> dict[str, Any]:
    """The observer's record of the request that makes `count` routed requests (a PD pair's decode leg carries
    Cortex's own x-request-id, so the client's cannot find it)."""
    seen = wait_for(lambda: (lambda d: d if len(d) >= count else None)(decisions(gw)), timeout=20,
                    what=f"{count} observed requests")
    assert len(seen) == count, seen
    return seen[0]


def assert_claim_is_the_engines(gw: Gateway, claimed: int, cached: int) -> None:
    """vLLM's pages are Cortex's blocks: equal. SGLang's pages are one token: whole blocks, at most one short."""
    if gw.sims[0].engine == "vllm":
        assert claimed == cached > 0
    else:
        assert 0 < claimed <= cached < claimed + 16


def no_routing_headers(h: httpx.Headers) -> bool:
    return not [k for k in h if k.lower().startswith("x-cortex-")]


def test_a_tenants_prompt_is_never_a_hit_for_another_tenant(gw: Gateway) -> None:
    chat = long_chat(seed=101)
    post(gw, "alice", chat)
    settle(gw, "alice", chat)
    _, h, cached = post(gw, "alice", chat)
    assert_claim_is_the_engines(gw, int(h["x-cortex-cache-hit-tokens"]), cached)

    # Bob sends the very same prompt to the very same worker: no KV block of Alice's is reused, none is claimed.
    rid, h, cached = post(gw, "bob", chat)
    assert cached == 0
    assert no_routing_headers(h)
    seen = observed(gw, rid)
    assert seen["claimed_hit_tokens"] == 0 and seen["engine_cached_tokens"] == 0 and seen["worker"] == "sim-1"
    # Bob's own repeat does hit: his prompts are cached, apart from Alice's.
    _, _, cached = post(gw, "bob", chat)
    assert cached > 0
    # And Alice is still on her own blocks.
    _, h, cached = post(gw, "alice", chat)
    assert_claim_is_the_engines(gw, int(h["x-cortex-cache-hit-tokens"]), cached)


@pytest.mark.parametrize("gw", ["sglang"], indirect=True)  # the simulated vLLM has no /generate
def test_unrouted_endpoints_are_salted_too(gw: Gateway) -> None:
    """SGLang's native /generate is forwarded without routing, and reads cache_salt: it is salted all the same, so
    it neither shares another tenant's blocks nor lets a client name another tenant's salt."""
    text = " ".join(m["content"] for m in long_chat(seed=505))

    def generate(who: str, **fields: Any) -> int:
        r = httpx.post(f"{gw.url}/generate", json={"text": text, "sampling_params": {"max_new_tokens": 2},
                                                    **fields}, headers=auth(who), timeout=60)
        assert r.status_code == 200, r.text
        return int(r.json()["meta_info"]["cached_tokens"])

    assert generate("alice") == 0
    assert generate("alice") > 0
    assert generate("erin") == 0
    assert generate("erin", cache_salt="cortex-tenant-alice") == 0
    r = httpx.post(f"{gw.url}/generate", json={"text": text, "cache_salt": "a/b"}, headers=auth("erin"), timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_tenants_of_one_shared_prefix_group_share_hits(gw: Gateway) -> None:
    chat = long_chat(seed=202)
    post(gw, "carol", chat)
    settle(gw, "carol", chat)
    rid, h, cached = post(gw, "dave", chat)
    assert no_routing_headers(h)  # shared cache, but Dave is not trusted: the claim goes to the observer only
    seen = observed(gw, rid)
    assert seen["engine_cached_tokens"] == cached
    assert_claim_is_the_engines(gw, seen["claimed_hit_tokens"], cached)
    # Outside the group, the same prompt is cold.
    _, h, cached = post(gw, "erin", chat)
    assert cached == 0 and h["x-cortex-cache-hit-tokens"] == "0"


def test_a_clients_own_cache_salt_still_separates_inside_a_tenant(gw: Gateway) -> None:
    chat = long_chat(seed=303)
    post(gw, "frank", chat, cache_salt="user-1")
    settle(gw, "frank", chat, cache_salt="user-1")
    _, h, cached = post(gw, "frank", chat, cache_salt="user-2")
    assert cached == 0 and h["x-cortex-cache-hit-tokens"] == "0"
    _, h, cached = post(gw, "frank", chat)
    assert cached == 0 and h["x-cortex-cache-hit-tokens"] == "0"
    _, h, cached = post(gw, "frank", chat, cache_salt="user-1")
    assert_claim_is_the_engines(gw, int(h["x-cortex-cache-hit-tokens"]), cached)
    # A salt too long to combine within 128 characters is hashed, and separates all the same.
    long_salt = "u" * 120
    post(gw, "frank", chat, cache_salt=long_salt)
    settle(gw, "frank", chat, cache_salt=long_salt)
    _, h, cached = post(gw, "frank", chat, cache_salt=long_salt)
    assert_claim_is_the_engines(gw, int(h["x-cortex-cache-hit-tokens"]), cached)


def test_routing_facts_only_for_trusted_tenants(gw: Gateway) -> None:
    chat = [{"role": "user", "content": "Which tenant am I?"}]
    # Untrusted: no routing header on a plain, a streamed, or a non-inference answer; route explain refused.
    _, h, _ = post(gw, "bob", chat)
    assert no_routing_headers(h)
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", headers=auth("bob"), timeout=30,
                      json={"model": MODEL, "messages": chat, "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200 and no_routing_headers(r.headers)
        r.read()
    r = httpx.get(f"{gw.url}/health", headers=auth("bob"), timeout=10)
    assert r.status_code == 200 and no_routing_headers(r.headers)
    r = explain(gw, "bob", chat)
    assert r.status_code == 403
    assert r.json()["error"]["type"] == "permission_error" and r.json()["error"]["code"] == 403
    # Trusted: every routing header, and route explain answers.
    _, h, _ = post(gw, "alice", chat)
    assert all(k in h for k in ROUTING) and h["x-cortex-assigned-worker"] == "sim-1"
    r = httpx.get(f"{gw.url}/health", headers=auth("alice"), timeout=10)
    assert r.status_code == 200 and r.headers["x-cortex-assigned-worker"] == "sim-1"
    assert explain(gw, "alice", chat).status_code == 200
    # Without a key, auth is required: 401 before any of it.
    assert httpx.post(f"{gw.url}/cortex/v1/route", json={"model": MODEL, "messages": chat},
                      timeout=10).status_code == 401


# -- A PD pair: both legs, and the fallback after a failed pair, carry the tenant's salt --------------------------

VLLM_PD = [
    ("vp1", "vllm", "prefill", True, ()),
    # The decoder's own copy of transferred blocks is not in the ledger: only the prefill side proves a hit.
    ("vd1", "vllm", "decode", False, ("--kv-load-failure-policy", "fail")),
]


@pytest.fixture(scope="module")
def pd_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with pd_cluster(tmp_path_factory.mktemp("isolation-pd"), VLLM_PD,
                    extra_config={"tenants": TENANTS, "auth": {"required": True}}) as g:
        yield g


def test_pd_legs_and_fallback_carry_the_tenants_salt(pd_gw: Gateway) -> None:
    gw = pd_gw
    chat = long_chat(400, seed=404)
    _, h, _ = post(gw, "alice", chat)
    assert h["x-cortex-pd"] == "pair"
    # (Route explain shows the single-worker decision, not the pair's: wait for the prefill's events instead.)
    wait_for(lambda: gw.targets()["vp1"]["cached_blocks"] > 0, what="prefill blocks in the ledger")
    # The prefill leg stored the prompt under Alice's salt: her keys find it (a claim, proven by the engine).
    _, h, cached = post(gw, "alice", chat)
    assert h["x-cortex-pd"] == "pair" and h["x-cortex-assigned-worker"] == "prefill=vp1,decode=vd1"
    hit = int(h["x-cortex-cache-hit-tokens"])
    assert 0 < hit <= cached < hit + 16
    observed_next(gw, 2)  # Alice's two requests
    _, h, cached = post(gw, "bob", chat)
    assert cached == 0 and no_routing_headers(h)
    seen = observed_next(gw, 3)
    assert seen["claimed_hit_tokens"] == 0 and seen["engine_cached_tokens"] == 0 and seen["worker"] == "vd1"
    # The decoder refuses the transfer: the fallback serves Erin's request on the prefill worker, which her own
    # prefill leg just filled. It reuses those blocks only if it carries the same salt as that leg.
    vp1 = gw.sims[0]
    httpx.post(f"{vp1.url}/sim/faults", json={"pd_transfer_fail": True}, timeout=5).raise_for_status()
    try:
        _, h, cached = post(gw, "erin", chat)
    finally:
        httpx.post(f"{vp1.url}/sim/faults", json={"pd_transfer_fail": False}, timeout=5)
    assert h["x-cortex-pd"] == "fallback:decode_failed" and h["x-cortex-assigned-worker"] == "vp1"
    assert cached > 0
    # The untrusted tenant's fallback answer carries no routing header either.
    httpx.post(f"{vp1.url}/sim/faults", json={"pd_transfer_fail": True}, timeout=5).raise_for_status()
    try:
        _, h, cached = post(gw, "dave", chat)
    finally:
        httpx.post(f"{vp1.url}/sim/faults", json={"pd_transfer_fail": False}, timeout=5)
    assert no_routing_headers(h) and cached > 0  # the group's salt: Dave's own prefill leg's blocks
    seen = observed_next(gw, 5)
    # The claim facts still reach the observer (an immediate answer's usage is not read there: None).
    assert seen["worker"] == "vp1" and seen["claimed_hit_tokens"] is not None
