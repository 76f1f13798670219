"""The response observation end to end, on `cortex demo` itself: real Envoy (its Lua filter and gRPC access
log), real extproc, the observer process and the demo's simulated vLLM workers. Twenty requests, JSON and SSE,
move every per-request series by exactly what the engines did (checked against the engines' own counters),
streams that did not ask for usage never see it, and endings that are not a success are counted by cause."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import MODEL, Gateway, demo, long_chat, wait_for

pytestmark = pytest.mark.timeout(300)

SERIES = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = SERIES.match(line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
            out[(m["name"], labels)] = out.get((m["name"], labels), 0.0) + float(m["value"])
    return out


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **match: str) -> float:
    want = set(match.items())
    return sum(v for (n, labels), v in samples.items() if n == name and want <= labels)


def engines(gw: Gateway) -> dict[str, float]:
    """The simulated vLLM engines' own token counters, summed over the fleet."""
    sums = {"vllm:prompt_tokens_total": 0.0, "vllm:generation_tokens_total": 0.0,
            "vllm:prefix_cache_hits_total": 0.0}
    for s in gw.sims:
        for (name, _), v in scrape(s.url).items():
            if name in sums:
                sums[name] += v
    return sums


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # The demo writes its request log and Envoy's access log into its runtime directory (gw.root).
    with demo(tmp_path_factory.mktemp("observe")) as g:
        yield g


def sse_events(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.startswith("data: ")]


def observed(gw: Gateway, n: float) -> None:
    """Wait until the observer has read n more routed entries (Envoy flushes its access log every 100 ms)."""
    wait_for(lambda: total(scrape(gw.ingest_url), "cortex_observer_entries_total", outcome="ok") >= n,
             timeout=20, what=f"{n} observed requests")


def test_twenty_requests_move_every_series_by_what_the_engines_did(gw: Gateway) -> None:
    before, eng_before = scrape(gw.ingest_url), engines(gw)
    ok_before = total(before, "cortex_observer_entries_total", outcome="ok")
    chats = [long_chat(200 + 60 * i, seed=i) for i in range(5)]
    usages: list[dict[str, Any]] = []  # what clients saw
    claims = 0
    streams = plain_streams = 0
    for i in range(20):
        body: dict[str, object] = {"model": MODEL, "messages": chats[i % 5], "max_tokens": 3 + i % 4}
        headers = {"x-request-id": f"obs-test-{i}"}
        kind = i % 3
        if kind == 0:  # JSON
            r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
            claims += int(r.headers["x-cortex-cache-hit-tokens"])
            continue
        streams += 1
        if kind == 2:
            body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json={**body, "stream": True}, headers=headers,
                          timeout=30) as r:
            assert r.status_code == 200
            raw = b"".join(r.iter_raw())
            claims += int(r.headers["x-cortex-cache-hit-tokens"])
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        with_usage = [json.loads(e) for e in events[:-1] if '"usage"' in e and json.loads(e).get("usage")]
        if kind == 2:  # asked: exactly the engine's one usage event
            assert len(with_usage) == 1 and with_usage[0]["choices"] == []
            usages.append(with_usage[0]["usage"])
        else:  # did not ask: Cortex asked for it and took it out again
            plain_streams += 1
            assert with_usage == [], events
            assert all(json.loads(e)["choices"] for e in events[:-1])
    observed(gw, ok_before + 20)
    after, eng_after = scrape(gw.ingest_url), engines(gw)

    def moved(name: str, **match: str) -> float:
        return total(after, name, **match) - total(before, name, **match)

    labels = {"model": MODEL}
    assert moved("cortex_requests_total", code="200", **labels) == 20
    assert moved("cortex_e2e_seconds_count", **labels) == 20
    assert moved("cortex_ttft_seconds_count", **labels) == streams
    assert moved("cortex_itl_seconds_count", **labels) == streams  # every stream had >= 2 tokens
    assert moved("cortex_request_errors_total", **labels) == 0
    # Every request's tokens, streams whose client never saw a usage included: the engines' own counters.
    assert moved("cortex_prompt_tokens_total", **labels) == (eng_after["vllm:prompt_tokens_total"]
                                                            - eng_before["vllm:prompt_tokens_total"])
    assert moved("cortex_completion_tokens_total", **labels) == (eng_after["vllm:generation_tokens_total"]
                                                                - eng_before["vllm:generation_tokens_total"])
    cached = moved("cortex_engine_cached_tokens_total", **labels)
    assert cached == eng_after["vllm:prefix_cache_hits_total"] - eng_before["vllm:prefix_cache_hits_total"]
    # ... and, for the requests whose client saw the usage, the sum of the responses' cached_tokens.
    seen = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert seen <= cached and len(usages) == 20 - plain_streams
    assert cached > 0  # repeated chats hit
    # Cortex's claims: the same tokens the clients were told, all of them proven (never above the engine's).
    assert moved("cortex_observed_claimed_hit_tokens_total", **labels) == claims
    assert moved("cortex_claim_check_total", outcome="over", **labels) == 0
    assert moved("cortex_claim_check_total", **labels) == 20
    assert moved("cortex_claim_error_tokens_total", outcome="over", **labels) == 0
    # The routing gain's baseline: a worker drawn at random (two here, one holding each repeated chat) would
    # have had about half of what Cortex claimed.
    random_hit = moved("cortex_random_choice_hit_tokens_total")
    assert 0 < random_hit < claims

    # The request log: one line per request, its id, never the prompt's text.
    lines = {}
    log = Path(gw.root / "requests.log")
    wait_for(lambda: log.read_text().count("obs-test-19") == 1, timeout=10, what="the last request's log line")
    for line in log.read_text().splitlines():
        doc = json.loads(line)
        lines[doc["request_id"]] = doc
    for i in range(20):
        doc = lines[f"obs-test-{i}"]
        assert doc["model"] == MODEL and doc["status"] == 200 and doc["worker"].startswith("sim-")
        assert doc["prompt_tokens"] > 0 and doc["engine_cached_tokens"] is not None
    text = log.read_text()
    for chat in chats:
        for m in chat:
            assert m["content"][:40] not in text
    # The prompt, identified: the same chat has the same fingerprint and first ids (the ids routing used, as
    # the explain endpoint gives them), different chats differ; its length is the engine's count.
    for c in range(5):
        same = [lines[f"obs-test-{i}"] for i in range(c, 20, 5)]
        assert len({d["prompt_hash"] for d in same}) == 1 and len({tuple(d["first_ids"]) for d in same}) == 1
        explain = httpx.post(f"{gw.explain_url}?tokens=1", json={"model": MODEL, "messages": chats[c]},
                             timeout=10).json()
        assert same[0]["first_ids"] == explain["token_ids"][:64]
        assert all(d["token_count"] == d["prompt_tokens"] == explain["prompt_tokens"] for d in same)
    assert len({lines[f"obs-test-{c}"]["prompt_hash"] for c in range(5)}) == 5
    # Envoy's own access log: the same keys where Envoy knows them, the same values, joined on request_id.
    envoy_log = gw.root / "envoy-access.log"
    wait_for(lambda: envoy_log.exists() and "obs-test-19" in envoy_log.read_text(), timeout=20,
             what="Envoy's access log line")
    envoy_lines = {d["request_id"]: d for d in map(json.loads, envoy_log.read_text().splitlines())}
    for i in range(20):
        ours, theirs = lines[f"obs-test-{i}"], envoy_lines[f"obs-test-{i}"]
        for key in ("method", "path", "status", "model", "worker", "mode", "reason", "claimed_hit_tokens",
                    "engine_cached_tokens", "prompt_tokens", "completion_tokens", "stream", "prompt_hash"):
            assert theirs[key] == ours[key], (i, key, theirs[key], ours[key])
        # Envoy's round trip of each of the three ext_proc messages, in microseconds.
        spent = [theirs[f"extproc_{m}_us"] for m in ("request_headers", "request_body", "response_headers")]
        assert all(str(us).isdigit() and 0 < int(us) < 30_000_000 for us in spent), (i, spent)

    # The status page's source: the newest decision first, with the engine's figure beside the claim.
    doc = httpx.get(f"{gw.observe_url}/cortex/decisions?limit=5", timeout=5).json()
    assert doc["decisions"][0]["request_id"] == "obs-test-19"
    assert all(d["engine_cached_tokens"] >= d["claimed_hit_tokens"] for d in doc["decisions"])
    assert any(w["requests_60s"] > 0 for w in doc["workers"].values())


def test_endings_that_are_not_a_success_are_counted_by_cause(gw: Gateway) -> None:
    before = scrape(gw.ingest_url)
    ok_before = total(before, "cortex_observer_entries_total")
    # A body Cortex refuses: its own reply.
    r = httpx.post(f"{gw.url}/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    # A client that leaves mid-stream: the workers stall after the first token, so the stream is still running.
    def faults(**f: object) -> None:
        for s in gw.sims:
            assert httpx.post(f"{s.url}/sim/faults", json=f, timeout=5).status_code == 200

    chat = {"model": MODEL, "messages": long_chat(100, seed=99), "max_tokens": 20, "stream": True}
    faults(stall_stream_ms=3000)
    try:
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", timeout=30, json=chat) as s:
            for _ in s.iter_raw():
                break  # the first chunk arrived: leave
    finally:
        faults(stall_stream_ms=0)
    # A worker whose connection dies mid-stream.
    faults(crash_mid_stream=True)
    try:
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", timeout=30, json=chat) as s, \
                contextlib.suppress(httpx.HTTPError):
            for _ in s.iter_raw():
                pass
    finally:
        faults(crash_mid_stream=False)
    wait_for(lambda: total(scrape(gw.ingest_url), "cortex_observer_entries_total") >= ok_before + 3, timeout=30,
             what="the three endings observed")
    time.sleep(0.3)
    after = scrape(gw.ingest_url)

    def moved(name: str, **match: str) -> float:
        return total(after, name, **match) - total(before, name, **match)

    assert moved("cortex_request_errors_total", cause="local_reply") == 1
    assert moved("cortex_requests_total", code="400") == 1
    assert moved("cortex_request_errors_total", cause="client_disconnect", model=MODEL) == 1
    assert moved("cortex_request_errors_total", cause="upstream_reset", model=MODEL) == 1


def test_extproc_and_request_series_stay_scrapable_while_ingest_is_down(gw: Gateway) -> None:
    r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": long_chat(120, seed=7), "max_tokens": 2})
    assert r.status_code == 200
    wait_for(lambda: total(scrape(gw.observe_url), "cortex_requests_total", code="200") > 0, timeout=20,
             what="the request on the observer's /metrics")
    # Two disjoint targets: ingest's own series, and extproc's with the observer's.
    ingest_only = httpx.get(f"{gw.ingest_url}/metrics", params={"scope": "ingest"}, timeout=10).text
    assert "cortex_worker_healthy" in ingest_only and "cortex_route_decisions_total" not in ingest_only
    assert "cortex_target_kv_usage_ratio{" in ingest_only  # the workers' own KV usage, read with their load
    served = scrape(gw.observe_url)
    assert total(served, "cortex_route_decisions_total") > 0 and total(served, "cortex_worker_healthy") == 0
    (pid,) = gw.child_pids("cli ingest")
    os.kill(pid, signal.SIGSTOP)  # ingest hangs: its port stops answering, the observer's does not
    try:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{gw.ingest_url}/metrics", timeout=1)
        assert total(scrape(gw.observe_url), "cortex_route_decisions_total") > 0
    finally:
        os.kill(pid, signal.SIGCONT)
