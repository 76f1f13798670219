"""Each stage of the fallback chain, provoked for real, with the header, the reason and the metric it leaves:
a STALE ledger, broken hash parity, a dead load endpoint, a dead ingest; and Envoy's one retry on the
next-best worker (before the first byte only)."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import MODEL, Gateway, Sim, cluster, free_ports, long_chat, start_sim, stop, wait_for
from tests.test_gateway import chat

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # Route explain on the public listener too: a frozen ingest (below) takes its admin port with it.
    with cluster(tmp_path_factory.mktemp("chain"), extra_config={"extproc": {"public_route_explain": True}}) as g:
        yield g


def explain(gw: Gateway, messages: list[dict[str, str]]) -> dict:
    return httpx.post(gw.explain_url, json={"model": MODEL, "messages": messages}, timeout=30).json()


def decisions(gw: Gateway, mode: str, reason: str) -> float:
    text = httpx.get(f"{gw.ingest_url}/metrics", timeout=10).text
    want = {"model": MODEL, "mode": mode, "reason": reason}
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "cortex_route_decisions_total" and s.labels == want)


def faults(sim: Sim, **kw: object) -> None:
    assert httpx.post(f"{sim.url}/sim/faults", json=kw, timeout=10).status_code == 200


def warm_on(sim: Sim, messages: list[dict[str, str]]) -> None:
    httpx.post(f"{sim.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
               timeout=30).raise_for_status()


@pytest.fixture
def extra(gw: Gateway) -> Iterator[Sim]:
    port, kv = free_ports(2)
    sim = Sim(id="sim-extra", port=port, kv_port=kv)
    yield sim
    httpx.delete(f"{gw.ingest_url}/cortex/workers/{sim.id}", timeout=10)
    stop(sim.proc)


def test_stale_ledger_routes_by_load_and_says_why(gw: Gateway, extra: Sim) -> None:
    # Its replay endpoint answers nothing, so a gap keeps the target STALE for the replay timeout (3 s).
    start_sim(extra, gw.root)
    (dead,) = free_ports(1)
    cfg = {**extra.worker_config(), "kv_replay": f"tcp://127.0.0.1:{dead}"}
    assert httpx.post(f"{gw.ingest_url}/cortex/workers", json=cfg, timeout=10).status_code == 201
    wait_for(lambda: gw.targets()["sim-extra"]["exact_kv"], timeout=20, what="initial sync given up on")
    messages = long_chat(300, seed=501)
    warm_on(extra, messages)
    wait_for(lambda: explain(gw, messages)["mode"] == "exact_kv_events", what="cached on sim-extra")
    before = decisions(gw, "load_aware", "ledger_stale")
    faults(extra, seq_gap=5)
    warm_on(extra, long_chat(50, seed=502))  # any batch now carries the gap
    wait_for(lambda: gw.targets()["sim-extra"]["state"] == "STALE", what="STALE")
    wait_for(lambda: explain(gw, messages)["reason"] == "ledger_stale", timeout=2, what="extproc to see it")
    h, _ = chat(gw, messages)
    assert h["x-cortex-match-mode"] == "load_aware" and h["x-cortex-route-reason"] == "ledger_stale"
    assert h["x-cortex-cache-hit-tokens"] == "0"
    assert decisions(gw, "load_aware", "ledger_stale") == before + 1
    wait_for(lambda: gw.targets()["sim-extra"]["exact_kv"], timeout=20, what="resynced after the timeout")
    assert gw.targets()["sim-extra"]["resyncs"] >= 1


def test_broken_hash_parity_routes_by_load_and_says_why(gw: Gateway, extra: Sim) -> None:
    start_sim(extra, gw.root, "--hash-seed", "0")
    assert httpx.post(f"{gw.ingest_url}/cortex/workers", json=extra.worker_config(), timeout=10).status_code == 201
    messages = long_chat(300, seed=601)
    warm_on(extra, messages)
    wait_for(lambda: gw.targets()["sim-extra"]["parity"]["status"] == "failed", what="parity failure")
    wait_for(lambda: explain(gw, messages)["reason"] == "hash_parity_failed", what="extproc to see it")
    before = decisions(gw, "load_aware", "hash_parity_failed")
    h, _ = chat(gw, messages)
    assert h["x-cortex-match-mode"] == "load_aware" and h["x-cortex-route-reason"] == "hash_parity_failed"
    assert decisions(gw, "load_aware", "hash_parity_failed") == before + 1


def test_unknown_load_falls_back_to_p2c(gw: Gateway) -> None:
    # P2C only when no worker's load is known; one unknown worker alone is ranked last instead
    # (tests/test_fleet_health_e2e.py).
    for sim in gw.sims:
        faults(sim, load_endpoint_down=True)
    try:
        # extproc stops trusting a load reading after 2 s.
        wait_for(lambda: explain(gw, long_chat(20, seed=701))["mode"] == "fallback_p2c", timeout=15,
                 what="load to go unknown")
        before = decisions(gw, "fallback_p2c", "load_unknown")
        h, _ = chat(gw, long_chat(30, seed=702))
        assert h["x-cortex-match-mode"] == "fallback_p2c" and h["x-cortex-route-reason"] == "load_unknown"
        assert decisions(gw, "fallback_p2c", "load_unknown") == before + 1
    finally:
        for sim in gw.sims:
            faults(sim, load_endpoint_down=False)
    wait_for(lambda: explain(gw, long_chat(20, seed=703))["mode"] != "fallback_p2c", what="load known again")


def test_frozen_ingest_is_noticed_within_a_second(gw: Gateway) -> None:
    messages = long_chat(300, seed=801)
    chat(gw, messages)
    wait_for(lambda: explain(gw, messages)["mode"] == "exact_kv_events", what="cached")
    (pid,) = gw.child_pids("cortexctl.cli ingest")
    os.kill(pid, signal.SIGSTOP)  # alive but silent: no heartbeat, no restart by the supervisor
    try:
        doc = wait_for(lambda: (lambda d: d if d["reason"] == "ledger_unavailable" else None)(explain(gw, messages)),
                       timeout=5, what="extproc to stop trusting the view")
        assert doc["mode"] in ("fallback_p2c", "fallback_round_robin") and doc["cache_hit_tokens"] == 0
        h, _ = chat(gw, messages)
        assert h["x-cortex-route-reason"] == "ledger_unavailable" and h["x-cortex-cache-hit-tokens"] == "0"
        assert h["x-cortex-match-mode"] in ("fallback_p2c", "fallback_round_robin")
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: explain(gw, messages)["mode"] == "exact_kv_events", timeout=10, what="trusted again")
    assert decisions(gw, doc["mode"], "ledger_unavailable") >= 1


def sim_requests(sim: Sim) -> float:
    text = httpx.get(f"{sim.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'vllm:request_success_total\{[^}]*\} (\S+)', text))


def test_a_5xx_before_the_first_byte_is_retried_once_on_the_next_worker(gw: Gateway) -> None:
    messages = long_chat(300, seed=901)
    h, _ = chat(gw, messages)
    holder = next(s for s in gw.sims if s.id == h["x-cortex-assigned-worker"])
    other = next(s for s in gw.sims if s is not holder)
    faults(holder, http_5xx_rate=1.0)
    try:
        h2, _ = chat(gw, messages)
    finally:
        faults(holder, http_5xx_rate=0.0)
    assert h2["x-cortex-assigned-worker"] == other.id  # what really served it, not the first choice
    assert h2["x-cortex-route-reason"].startswith("retried:") and h2["x-cortex-cache-hit-tokens"] == "0"
    assert h2["x-cortex-match-mode"] == "load_aware"


def test_no_replay_after_streaming_started(gw: Gateway) -> None:
    messages = long_chat(200, seed=902)
    h, _ = chat(gw, messages)
    holder = next(s for s in gw.sims if s.id == h["x-cortex-assigned-worker"])
    other = next(s for s in gw.sims if s is not holder)
    served_before = sim_requests(other)
    faults(holder, crash_mid_stream=True)
    try:
        body = {"model": MODEL, "messages": messages, "max_tokens": 32, "stream": True}
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200 and r.headers["x-cortex-assigned-worker"] == holder.id
            with pytest.raises(httpx.HTTPError):
                for line in r.iter_lines():
                    assert line != "data: [DONE]"
    finally:
        faults(holder, crash_mid_stream=False)
    assert sim_requests(other) == served_before  # nothing was replayed on the other worker
