"""A worker that answers 500 to everything while its /health passes is demoted by its answers, through the real
Envoy: after `breaker.failure_threshold` failed first attempts its breaker opens and requests go to the other
worker first (reason `breaker_open`); once the fault clears and `open_s` is over, trial requests close it again.

Which worker a request's first attempt goes to is made certain, not left to load ties: each prompt is cached on the
sick worker alone (sent to the simulator directly before the fault), so the policy's natural choice is that worker.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Gateway, Sim, cluster, long_chat, wait_for
from tests.test_fallback_chain import explain, faults, warm_on
from tests.test_gateway import chat

pytestmark = pytest.mark.timeout(300)

THRESHOLD = 3
OPEN_S = 15.0


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, transport: str) -> Iterator[Gateway]:
    breaker = {"failure_threshold": THRESHOLD, "open_s": OPEN_S, "half_open_trials": 1, "success_threshold": 2}
    with cluster(tmp_path_factory.mktemp("breaker"),
                 extra_config={"breaker": breaker, "extproc": {"public_route_explain": True}}) as g:
        yield g


def breaker_of(gw: Gateway, sim: Sim) -> str:
    return str(gw.workers()[sim.id]["breaker"]["state"])


def metric(gw: Gateway, name: str, labels: dict[str, str]) -> float:
    text = httpx.get(f"{gw.ingest_url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels == labels)


def cached_on(gw: Gateway, sim: Sim, messages: list[dict[str, str]]) -> None:
    """The prompt is in `sim`'s cache alone, and the router knows it (its natural first choice is `sim`)."""
    warm_on(sim, messages)
    wait_for(lambda: explain(gw, messages)["chosen"] == sim.id and explain(gw, messages)["cache_hit_tokens"] > 0,
             what=f"the prompt cached on {sim.id}")


def test_a_worker_answering_500_is_demoted_then_brought_back_by_trials(gw: Gateway) -> None:
    sick, healthy = gw.sims
    prompts = [long_chat(300, seed=5100 + i) for i in range(THRESHOLD + 1)]
    for p in prompts:
        cached_on(gw, sick, p)
    assert breaker_of(gw, sick) == "closed"

    faults(sick, http_5xx_rate=1.0)
    try:
        # Each failure costs a retry: the first attempt goes to the worker holding the prompt, Envoy retries on
        # the other. The health probe keeps passing throughout.
        for p in prompts[:THRESHOLD]:
            h, _ = chat(gw, p)
            assert h["x-cortex-assigned-worker"] == healthy.id
            assert h["x-cortex-route-reason"].startswith("retried:")
        assert gw.workers()[sick.id]["healthy"] and breaker_of(gw, sick) == "open"
        assert metric(gw, "cortex_breaker_state", {"worker": sick.id}) == 2
        assert metric(gw, "cortex_breaker_transitions_total",
                      {"worker": sick.id, "from_state": "closed", "to_state": "open"}) == 1

        # Open: the prompt cached on the sick worker goes to the other one first, and says why.
        doc = explain(gw, prompts[THRESHOLD])
        assert doc["chosen"] == healthy.id and doc["reason"] == "breaker_open"
        assert doc["order"] == [healthy.id, sick.id]  # still a last resort
        assert {w["id"]: w["breaker"] for w in doc["workers"]} == {healthy.id: "closed", sick.id: "open"}
        h, _ = chat(gw, prompts[THRESHOLD])
        assert h["x-cortex-assigned-worker"] == healthy.id and h["x-cortex-route-reason"] == "breaker_open"
        page = httpx.get(f"{gw.ingest_url}/cortex/ui", timeout=10, headers=gw.admin_headers).text
        assert 'data-field="breaker" class="bad">open<' in page
    finally:
        faults(sick, http_5xx_rate=0.0)

    # The fault is gone; once open_s is over the breaker lets one trial at a time through.
    wait_for(lambda: breaker_of(gw, sick) == "half_open", timeout=OPEN_S + 30, what="the breaker half-open")
    again = long_chat(300, seed=5200)
    cached_on(gw, sick, again)
    for _ in range(2):  # success_threshold trials, one after the other
        h, _ = chat(gw, again)
        assert h["x-cortex-assigned-worker"] == sick.id and not h["x-cortex-route-reason"].startswith("retried:")
    assert breaker_of(gw, sick) == "closed"
    assert metric(gw, "cortex_breaker_state", {"worker": sick.id}) == 0
    assert metric(gw, "cortex_breaker_transitions_total",
                  {"worker": sick.id, "from_state": "half_open", "to_state": "closed"}) == 1
    h, _ = chat(gw, long_chat(300, seed=5100))  # cached on both now: no breaker reason any more
    assert h["x-cortex-route-reason"] != "breaker_open"


def test_a_worker_resetting_every_request_is_demoted_too(gw: Gateway) -> None:
    healthy, sick = gw.sims  # the other worker this time: its breaker has never moved
    assert breaker_of(gw, sick) == "closed"
    prompts = [long_chat(300, seed=5300 + i) for i in range(THRESHOLD + 1)]
    for p in prompts:
        cached_on(gw, sick, p)
    faults(sick, reset_requests=True)
    try:
        # Envoy sees the reset and retries on the other worker: extproc learns of it only as a retry past the
        # first choice (it never sees the failed attempt's answer).
        for p in prompts[:THRESHOLD]:
            h, _ = chat(gw, p)
            assert h["x-cortex-assigned-worker"] == healthy.id
            assert h["x-cortex-route-reason"].startswith("retried:")
        assert gw.workers()[sick.id]["healthy"] and breaker_of(gw, sick) == "open"
        h, _ = chat(gw, prompts[THRESHOLD])
        assert h["x-cortex-assigned-worker"] == healthy.id and h["x-cortex-route-reason"] == "breaker_open"
    finally:
        faults(sick, reset_requests=False)
