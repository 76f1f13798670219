"""Tenants through the real Envoy: 401 before any routing work, each limit's 429 with Retry-After and the dropped
reason under both names, and a token reservation settled by the observer with the engine's own usage."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from cortex.config import ChargeWeights
from cortex.tenancy import limits
from extproc.tenants import digest
from tests.harness import MODEL, Gateway, cluster, wait_for
from tests.test_observe_e2e import scrape, total

pytestmark = pytest.mark.timeout(300)

KEYS = {"rate": "sk-rate-1", "conc": "sk-conc-1", "tokens": "sk-tokens-1", "tpm": "sk-tpm-1", "free": "sk-free-1"}
# A quota period no test run crosses (windows are aligned to the epoch): the settled charge stays in the window.
CENTURY_S = 3_000_000_000
TENANTS = [
    {"id": "rate", "api_keys": [digest(KEYS["rate"])], "limits": {"requests_per_s": 0.1, "burst": 2}},
    {"id": "conc", "api_keys": [digest(KEYS["conc"])], "limits": {"max_concurrent": 1}},
    {"id": "tokens", "api_keys": [digest(KEYS["tokens"])],
     "limits": {"token_quota": 600, "quota_period_s": CENTURY_S}},
    {"id": "tpm", "api_keys": [digest(KEYS["tpm"])], "limits": {"tokens_per_minute": 300}},
    {"id": "free", "api_keys": [digest(KEYS["free"])], "trusted": True},
]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, transport: str) -> Any:
    root = tmp_path_factory.mktemp("tenancy")
    with cluster(root, n_sims=2, sim_args=("--decode-ms-per-token", "40"),
                 extra_config={"auth": {"required": True}, "tenants": TENANTS,
                               "observe": {"request_log_path": str(root / "requests.log")}}) as g:
        yield g


def chat(gw: Gateway, key: str | None, max_tokens: int = 4, **extra: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{gw.url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hello there"}], **extra})


def engine_requests(gw: Gateway) -> float:
    return sum(total(scrape(s.url), "vllm:request_success_total") for s in gw.sims)


@pytest.mark.parametrize("key", [None, "sk-nobody"])
def test_no_or_unknown_key_gets_401_before_any_worker(gw: Gateway, key: str | None) -> None:
    before = engine_requests(gw)
    r = chat(gw, key)
    assert r.status_code == 401
    assert r.headers["x-cortex-dropped-reason"] == r.headers["x-llm-d-request-dropped-reason"] == "unauthenticated"
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == 401
    assert "x-cortex-assigned-worker" not in r.headers
    assert chat(gw, KEYS["free"]).status_code == 200
    assert engine_requests(gw) == before + 1  # only the authenticated one reached a worker


def test_the_request_rate_limit_answers_429_with_retry_after(gw: Gateway) -> None:
    codes = [chat(gw, KEYS["rate"]) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]  # a burst of 2 at 0.1/s
    refused = codes[2]
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 10
    assert refused.headers["x-cortex-dropped-reason"] == "rate_limited"
    assert refused.headers["x-llm-d-request-dropped-reason"] == "rate_limited"
    assert chat(gw, KEYS["free"]).status_code == 200  # another tenant is not limited by it
    # The request log says whose requests were refused and why (never the key).
    log = gw.root / "requests.log"

    def refused_lines() -> list[dict[str, Any]]:
        docs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return [d for d in docs if d.get("tenant") == "rate" and d.get("dropped_reason") == "rate_limited"]

    wait_for(refused_lines, timeout=20, what="the refusal in the request log")
    assert refused_lines()[0]["status"] == 429
    assert KEYS["rate"] not in log.read_text()


def test_max_concurrent_refuses_the_second_and_frees_the_slot_when_the_client_leaves(gw: Gateway) -> None:
    first_chunk = threading.Event()
    leave = threading.Event()

    def long_stream() -> None:
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", timeout=60,
                          headers={"authorization": f"Bearer {KEYS['conc']}"},
                          json={"model": MODEL, "max_tokens": 500, "stream": True,
                                "messages": [{"role": "user", "content": "a long answer please"}]}) as r:
            assert r.status_code == 200
            for _ in r.iter_raw():
                first_chunk.set()
                if leave.is_set():
                    break  # the client disconnects mid-stream

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert first_chunk.wait(30)
        second = chat(gw, KEYS["conc"])
        assert second.status_code == 429 and second.headers["x-cortex-dropped-reason"] == "concurrency"
    finally:
        leave.set()
        t.join(60)
    # The disconnect ended the first request; its slot is free again.
    wait_for(lambda: chat(gw, KEYS["conc"]).status_code == 200, timeout=20, interval=0.2, what="slot released")


def test_a_request_larger_than_the_token_rate_is_refused_at_once(gw: Gateway) -> None:
    r = chat(gw, KEYS["tpm"], max_tokens=400)
    assert r.status_code == 429 and "too large" in r.json()["error"]["message"]
    assert r.headers["x-cortex-dropped-reason"] == "tokens_per_minute"
    assert chat(gw, KEYS["tpm"], max_tokens=8).status_code == 200


def test_tokens_are_reserved_then_settled_with_the_engines_usage(gw: Gateway) -> None:
    ok = chat(gw, KEYS["tokens"], max_tokens=8)
    assert ok.status_code == 200
    usage = ok.json()["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    expected = limits.cost(ChargeWeights(), usage["prompt_tokens"], cached, usage["completion_tokens"])
    wait_for(lambda: total(scrape(gw.observe_url), "cortex_tenant_charged_tokens_total", tenant="tokens") > 0,
             timeout=20, what="the observer settled the request")
    charged = total(scrape(gw.observe_url), "cortex_tenant_charged_tokens_total", tenant="tokens")
    assert charged == pytest.approx(expected)
    # What is left of the quota is the quota minus the settled charge, not minus the reservation (8 + prompt).
    left = 600 - charged
    prompt = usage["prompt_tokens"]
    assert chat(gw, KEYS["tokens"], max_tokens=int(left - prompt - 1)).status_code == 200
    refused = chat(gw, KEYS["tokens"], max_tokens=int(left))
    assert refused.status_code == 429 and refused.headers["x-cortex-dropped-reason"] == "token_quota"


def test_models_list_needs_a_key_too(gw: Gateway) -> None:
    assert httpx.get(f"{gw.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{gw.url}/v1/models", timeout=10,
                     headers={"authorization": f"Bearer {KEYS['free']}"}).status_code == 200
