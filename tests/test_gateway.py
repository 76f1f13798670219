"""End to end through the real Envoy, extproc and ingest, in front of two simulated vLLM workers.

Every assertion here is about what a client sees: status, x-cortex-* headers, and the worker's own usage.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import MODEL, Gateway, cluster, long_chat, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with cluster(tmp_path_factory.mktemp("gw")) as g:
        yield g


def chat(gw: Gateway, messages: list[dict[str, str]], stream: bool = False, **extra: Any) -> tuple[
        httpx.Headers, dict[str, Any]]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}
    if not stream:
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.headers, r.json()["usage"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = orjson.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
        headers = r.headers
    assert usage is not None
    return headers, usage


def reset_worker(gw: Gateway, worker_id: str) -> None:
    sim = next(s for s in gw.sims if s.id == worker_id)
    assert httpx.post(f"{sim.url}/reset_prefix_cache", timeout=10).json()["success"] is True
    wait_for(lambda: gw.targets()[worker_id]["cached_blocks"] == 0, what="ledger to see the reset")


def wait_in_ledger(gw: Gateway, messages: list[dict[str, str]]) -> None:
    """Until route explain finds the chat's blocks in the ledger. The engine publishes them after its step, not with
    the answer: a repeat sent at once follows their prediction (same worker, nothing claimed; docs/ledger.md's
    window 2), one sent after them is an exact hit."""
    body = {"model": MODEL, "messages": messages}
    wait_for(lambda: httpx.post(gw.explain_url, json=body, timeout=10).json()["mode"] == "exact_kv_events",
             what="the chat's blocks in the ledger")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_repeated_chat_sticks_to_the_worker_that_caches_it(gw: Gateway, stream: bool) -> None:
    messages = long_chat(1500, seed=11 if stream else 7)
    first, usage = chat(gw, messages, stream)
    assert usage["prompt_tokens"] > 1900
    holder = first["x-cortex-assigned-worker"]
    assert first["x-cortex-cache-hit-tokens"] == "0"
    wait_in_ledger(gw, messages)
    for _ in range(19):
        h, usage = chat(gw, messages, stream)
        assert h["x-cortex-assigned-worker"] == holder
        assert h["x-cortex-match-mode"] == "exact_kv_events"
        assert int(h["x-cortex-cache-hit-tokens"]) == usage["prompt_tokens_details"]["cached_tokens"] > 0

    reset_worker(gw, holder)
    h, usage = chat(gw, messages, stream)
    assert h["x-cortex-cache-hit-tokens"] == "0"
    assert h["x-cortex-match-mode"] != "exact_kv_events"
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    wait_in_ledger(gw, messages)
    again, usage = chat(gw, messages, stream)
    assert again["x-cortex-assigned-worker"] == h["x-cortex-assigned-worker"]
    assert again["x-cortex-match-mode"] == "exact_kv_events"
    assert int(again["x-cortex-cache-hit-tokens"]) == usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_route_explain_runs_the_same_decision(gw: Gateway) -> None:
    messages = long_chat(400, seed=21)
    h, _ = chat(gw, messages)
    wait_in_ledger(gw, messages)
    body = {"model": MODEL, "messages": messages}
    r = httpx.post(f"{gw.explain_url}?tokens=1", json=body, timeout=30)
    assert r.status_code == 200
    doc = r.json()
    assert doc["chosen"] == h["x-cortex-assigned-worker"] and doc["mode"] == "exact_kv_events"
    assert len(doc["token_ids"]) == doc["prompt_tokens"]
    assert {w["id"] for w in doc["workers"]} == {s.id for s in gw.sims}
    h2, usage = chat(gw, messages)
    assert h2["x-cortex-assigned-worker"] == doc["chosen"]
    assert int(h2["x-cortex-cache-hit-tokens"]) == doc["cache_hit_tokens"] == \
        usage["prompt_tokens_details"]["cached_tokens"]


def test_client_cannot_pick_the_upstream(gw: Gateway) -> None:
    messages = long_chat(300, seed=31)
    h, _ = chat(gw, messages)
    holder = h["x-cortex-assigned-worker"]
    other = next(s for s in gw.sims if s.id != holder)
    spoof = {"x-gateway-destination-endpoint": f"127.0.0.1:{other.port}", "x-cortex-pool": "cortex_any",
             "x-cortex-worker": other.id}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4},
                   headers=spoof, timeout=30)
    assert r.status_code == 200 and r.headers["x-cortex-assigned-worker"] == holder


@pytest.mark.parametrize(("body", "status", "needle"), [
    (b"{not json", 400, "not valid JSON"),
    (orjson.dumps({"model": MODEL}), 400, "messages"),
    (orjson.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}), 404, "model"),
    (orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_salt": "a@b"}), 400,
     "cache_salt"),
])
def test_bad_bodies_get_openai_errors(gw: Gateway, body: bytes, status: int, needle: str) -> None:
    r = httpx.post(f"{gw.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]


def test_oversized_body_gets_413_json(gw: Gateway) -> None:
    big = b'{"model": "%s", "messages": [{"role": "user", "content": "' % MODEL.encode() + b"a" * (20 << 20) + b'"}]}'
    r = httpx.post(f"{gw.url}/v1/chat/completions", content=big, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413


def test_models_and_metrics(gw: Gateway) -> None:
    models = httpx.get(f"{gw.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    text = httpx.get(f"{gw.ingest_url}/metrics", timeout=10).text
    decided = [s.labels for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "cortex_route_decisions_total"]
    assert {"model": MODEL, "mode": "exact_kv_events", "reason": "longest_cached_prefix"} in decided
    assert "cortex_ledger_blocks" in text and "cortex_route_decision_seconds_bucket" in text
    ready = httpx.get(f"{gw.ingest_url}/health/ready", timeout=10).json()
    assert ready["status"] == "ready" and ready["targets_exact_kv"] == 2 and not ready["degraded"]


def _traffic(gw: Gateway, stop: threading.Event, results: list[tuple[int, str]]) -> None:
    messages = long_chat(200, seed=41)
    with httpx.Client(timeout=30) as client:
        while not stop.is_set() and len(results) < 2000:
            try:
                r = client.post(f"{gw.url}/v1/chat/completions",
                                json={"model": MODEL, "messages": messages, "max_tokens": 2})
                results.append((r.status_code, r.headers.get("x-cortex-match-mode", "")))
            except httpx.HTTPError as exc:
                results.append((0, type(exc).__name__))


@pytest.mark.parametrize("child", ["extproc", "ingest"])
def test_requests_survive_a_dying_child(gw: Gateway, child: str) -> None:
    (pid,) = gw.child_pids(f"cortexctl.cli {child}")
    stop = threading.Event()
    results: list[tuple[int, str]] = []
    t = threading.Thread(target=_traffic, args=(gw, stop, results))
    t.start()
    try:
        wait_for(lambda: len(results) >= 5, what="traffic")
        os.kill(pid, signal.SIGKILL)
        new = wait_for(lambda: [p for p in gw.child_pids(f"cortexctl.cli {child}") if p != pid], timeout=30,
                       what=f"{child} restart")
        n = len(results)
        wait_for(lambda: len(results) >= n + 5, what="traffic after restart")
    finally:
        stop.set()
        t.join(30)
    failures = [r for r in results if r[0] != 200]
    assert not failures, failures[:5]
    assert new and "restarting" in Path(gw.log).read_text()
    # Back to normal once the child is up again (the ledger refills from live events).
    wait_for(lambda: all(t["exact_kv"] for t in gw.targets().values()), timeout=40, what="targets ready")
    messages = long_chat(250, seed=int(time.time()) % 1000)
    chat(gw, messages)
    h, _ = wait_for(lambda: (lambda r: r if r[0]["x-cortex-match-mode"] == "exact_kv_events" else None)(
        chat(gw, messages)), timeout=40, interval=0.2, what="exact routing back")
    assert int(h["x-cortex-cache-hit-tokens"]) > 0


def test_large_body_is_accepted_and_forwarded(gw: Gateway) -> None:
    # 10 MiB is inside the 16 MiB limit: Envoy buffers it, extproc routes on a bounded prefix, and the
    # worker (not Cortex) judges the prompt, here as longer than its context window.
    text = ("lorem ipsum dolor sit amet " * 400_000)[: 10 << 20]
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1},
                   timeout=120)
    assert r.headers["x-cortex-assigned-worker"] in {s.id for s in gw.sims}
    assert r.status_code == 400 and "context" in r.json()["error"]["message"].lower()


def test_a_burst_of_new_siblings_does_not_scatter(gw: Gateway) -> None:
    # Before any BlockStored can arrive, the first request's blocks count as predicted on its worker. The
    # shared prefix is long (~2.6K tokens, ~130 ms of prefill): worth more than queueing behind a sibling,
    # so the scorer keeps the burst together (a short one may rightly spread when the holder queues).
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    messages = long_chat(2000, seed=int(time.time() * 1000) % 100_000)
    # Predictions are made only on workers whose ledger is trusted (never a claim on one that is not), so the test
    # starts once extproc trusts every ledger: the module's other tests kill ingest, flood a worker with a 10 MiB
    # body, and leave a ledger resyncing (ledger_stale) for a moment, which spreads a burst by load, rightly.
    wait_for(lambda: all(w["ledger_trusted"] for w in httpx.post(
        gw.explain_url, json={"model": MODEL, "messages": messages}, timeout=30).json()["workers"]),
        timeout=60, what="every ledger trusted")
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: chat(gw, messages), range(6)))
    reasons = [(h["x-cortex-assigned-worker"], h["x-cortex-route-reason"]) for h, _ in results]
    # Every sibling saw the first one's predicted blocks: it followed them, or the scorer sent it elsewhere
    # because the holder was loaded (the trade-off issue 5 defines), never for want of a known prefix.
    # A sibling spread to a second worker leaves its prediction there, so a later one may follow it
    # (predicted_prefix): allowed only on a worker some sibling was spread to.
    first = Counter(h["x-cortex-assigned-worker"] for h, _ in results).most_common(1)[0][0]
    spread = ("holder_too_loaded", "holder_slower", "holder_over_high_watermark")
    spread_to = {h["x-cortex-assigned-worker"] for h, _ in results if h["x-cortex-route-reason"] in spread}
    for h, _ in results:
        if h["x-cortex-assigned-worker"] != first:
            reason = h["x-cortex-route-reason"]
            assert reason in spread or (reason == "predicted_prefix" and h["x-cortex-assigned-worker"] in spread_to), \
                (reasons, {t["id"]: (t["exact_kv"], t.get("why")) for t in gw.targets().values()})
    assert sum(h["x-cortex-assigned-worker"] == first for h, _ in results) >= 4, reasons
    for h, usage in results:  # never a claim beyond what the worker itself reports
        assert int(h["x-cortex-cache-hit-tokens"]) <= usage["prompt_tokens_details"]["cached_tokens"]
