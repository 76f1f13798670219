"""Every inference path through the real Envoy, Cortex and simulated workers of two models (two vLLM workers of
MODEL, one SGLang worker of OTHER): each path is governed by the tenant's limits (rate, concurrency, token limits
settled with the engine's own usage in that API's shape), refuses a model that is not served, never reaches a
worker of another model, and, where the engine caches the prompt, is routed by it with a claim equal to the
engine's cached tokens. A Responses follow-up naming its previous response goes to the worker that stored it.
Anthropic's count_tokens is governed like the rest, goes only to a worker of its model (SOLO has one, also named
through an alias), claims nothing and spends no tokens."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cortex.api_paths import (
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    EMBEDDINGS,
    GENERATE,
    INFERENCE_PATHS,
    MESSAGES,
    RERANK,
    RESPONSES,
    SCORE,
    TENANT_VIEW_HEADER,
    TOKENIZER_PATHS,
)
from cortex.config import ChargeWeights
from cortex.tenancy import limits
from extproc.tenants import digest
from tests.harness import MODEL, Gateway, Sim, free_ports, serving, wait_for
from tests.test_observe_e2e import scrape, total

pytestmark = pytest.mark.timeout(600)

OTHER = "other/sglang-model"
SOLO = "solo/vllm-model"
"""Served by one vLLM worker only (solo-1), also under the alias SOLO_ALIAS."""
SOLO_ALIAS = "claude-solo"
STREAMED = (CHAT, COMPLETIONS, RESPONSES, MESSAGES, GENERATE)
POOLING = (EMBEDDINGS, RERANK, SCORE)
# A quota period no test run crosses (windows are aligned to the epoch): the settled charge stays in the window.
CENTURY_S = 3_000_000_000
NAMES = {CHAT: "chat", COMPLETIONS: "completions", RESPONSES: "responses", MESSAGES: "messages",
         COUNT_TOKENS: "count_tokens", GENERATE: "generate", EMBEDDINGS: "embeddings", RERANK: "rerank",
         SCORE: "score"}
SPENDING = [p for p in INFERENCE_PATHS if p != COUNT_TOKENS]
"""The paths whose requests cost tokens under a tenant's token limits (count_tokens computes and generates none)."""


def key(tenant: str) -> str:
    return f"sk-{tenant}"


def tenant(tid: str, **limits_: Any) -> dict[str, Any]:
    return {"id": tid, "api_keys": [digest(key(tid))], "limits": limits_}


TENANTS = [
    {"id": "free", "api_keys": [digest(key("free"))], "trusted": True},
    tenant("conc", max_concurrent=1),
    *(tenant(f"rate-{n}", requests_per_s=0.1, burst=2) for n in (*NAMES.values(), "tokenize", "stored")),
    *(tenant(f"tpm-{n}", tokens_per_minute=300) for n in NAMES.values()),
    *(tenant(f"quota-{n}", token_quota=100_000, quota_period_s=CENTURY_S) for n in NAMES.values()),
]


def body(path: str, text: str = "Summarise the repository layout in one line.", *, big: bool = False,
         stream: bool = False, model: str | None = None, **extra: Any) -> dict[str, Any]:
    """A small request on `path` (its model: MODEL, or for /generate none: the only model serving it). `big`: one
    that may cost more than 300 tokens (its output budget, or a long input for the pooling paths)."""
    out = 400 if big else 4
    doc: dict[str, Any]
    if path == CHAT:
        doc = {"messages": [{"role": "user", "content": text}], "max_tokens": out}
    elif path == COMPLETIONS:
        doc = {"prompt": text, "max_tokens": out}
    elif path == RESPONSES:
        doc = {"input": text, "max_output_tokens": out}
    elif path == MESSAGES:
        doc = {"messages": [{"role": "user", "content": text}], "max_tokens": out}
    elif path == COUNT_TOKENS:  # no output budget: `big` is a long prompt
        doc = {"messages": [{"role": "user", "content": text * 40 if big else text}]}
    elif path == GENERATE:
        doc = {"text": text, "sampling_params": {"max_new_tokens": out}}
    else:
        long = text * 40 if big else text
        pooling: dict[str, dict[str, Any]] = {EMBEDDINGS: {"input": long},
                                              RERANK: {"query": long, "documents": ["a", "b"]},
                                              SCORE: {"text_1": long, "text_2": ["a", "b"]}}
        doc = pooling[path]
    if path != GENERATE or model is not None:
        doc["model"] = model or MODEL
    if stream:
        doc["stream"] = True
    return {**doc, **extra}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, transport: str) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("paths")
    ports = free_ports(15)
    sims = [Sim(id="sim-1", port=ports[0], kv_port=ports[1]), Sim(id="sim-2", port=ports[2], kv_port=ports[3]),
            Sim(id="sgl-1", port=ports[4], kv_port=ports[5], replay_port=ports[10], engine="sglang", model=OTHER),
            Sim(id="solo-1", port=ports[13], kv_port=ports[14], model=SOLO)]
    g = Gateway(root=root, sims=sims, port=ports[6], admin_port=ports[7], ingest_port=ports[8],
                extproc_port=ports[9], extra_config={
                    "auth": {"required": True}, "tenants": TENANTS,
                    "aliases": [{"name": SOLO_ALIAS, "targets": [{"model": SOLO}]}],
                    "observe": {"request_log_path": str(root / "requests.log")}})
    with serving(g, "--decode-ms-per-token", "20"):
        yield g


def post(gw: Gateway, path: str, doc: dict[str, Any], who: str = "free") -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=doc, headers={"authorization": f"Bearer {key(who)}"}, timeout=60)


def served(gw: Gateway) -> dict[str, dict[str, int]]:
    """Per worker, the requests it answered on each inference path."""
    return {s.id: {p: n for p, n in httpx.get(f"{s.url}/sim/requests", timeout=5).json()["paths"].items()
                   if p in INFERENCE_PATHS} for s in gw.sims}


def delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {w: {p: n - before[w].get(p, 0) for p, n in paths.items() if n != before[w].get(p, 0)}
            for w, paths in after.items()}


@pytest.mark.parametrize("path", INFERENCE_PATHS)
def test_each_path_reaches_only_a_worker_of_its_model(gw: Gateway, path: str) -> None:
    before = served(gw)
    r = post(gw, path, body(path))
    assert r.status_code == 200, r.text
    workers = {"sgl-1"} if path == GENERATE else {"sim-1", "sim-2"}
    assert r.headers["x-sim-worker"] in workers and r.headers["x-cortex-assigned-worker"] == r.headers["x-sim-worker"]
    moved = {w: d for w, d in delta(before, served(gw)).items() if d}
    assert moved == {r.headers["x-sim-worker"]: {path: 1}}
    if path in (*POOLING, COUNT_TOKENS):  # by load, nothing claimed
        assert r.headers["x-cortex-cache-hit-tokens"] == "0" and r.headers["x-cortex-match-mode"] != "exact_kv_events"


@pytest.mark.parametrize("path", [p for p in INFERENCE_PATHS if p != GENERATE])
def test_the_other_model_goes_only_to_its_worker(gw: Gateway, path: str) -> None:
    before = served(gw)
    r = post(gw, path, body(path, model=OTHER))
    assert r.status_code == 200, r.text
    assert r.headers["x-sim-worker"] == "sgl-1"
    assert {w: d for w, d in delta(before, served(gw)).items() if d} == {"sgl-1": {path: 1}}


@pytest.mark.parametrize("path", INFERENCE_PATHS)
def test_a_model_not_served_is_refused_before_any_worker(gw: Gateway, path: str) -> None:
    before = served(gw)
    r = post(gw, path, body(path, model="no/such-model"))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "x-sim-worker" not in r.headers
    assert delta(before, served(gw)) == {s.id: {} for s in gw.sims}


def test_generate_on_a_model_whose_engine_has_no_such_path_is_refused(gw: Gateway) -> None:
    before = served(gw)
    r = post(gw, GENERATE, body(GENERATE, model=MODEL))  # MODEL is served by vLLM: no /generate
    assert r.status_code == 404 and "has no /generate endpoint" in r.json()["error"]["message"]
    assert delta(before, served(gw)) == {s.id: {} for s in gw.sims}


@pytest.mark.parametrize("path", INFERENCE_PATHS)
def test_the_rate_limit_holds_on_every_path(gw: Gateway, path: str) -> None:
    who = f"rate-{NAMES[path]}"
    codes = [post(gw, path, body(path), who) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]  # a burst of 2 at 0.1/s
    refused = codes[2]
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert refused.headers["x-cortex-dropped-reason"] == "rate_limited"
    assert "x-sim-worker" not in refused.headers


@pytest.mark.parametrize("name", ["tokenize", "stored"])
def test_the_rate_limit_holds_beyond_the_inference_paths(gw: Gateway, name: str) -> None:
    """/tokenize and a stored response's retrieval reach a worker too: the tenant's rate limit holds there."""
    who = f"rate-{name}"
    auth = {"authorization": f"Bearer {key(who)}"}
    if name == "tokenize":
        codes = [httpx.post(f"{gw.url}/tokenize", json={"model": MODEL, "prompt": "hello"}, headers=auth, timeout=30)
                 for _ in range(3)]
    else:
        rid = post(gw, RESPONSES, body(RESPONSES, "Store this.")).json()["id"]
        codes = [httpx.get(f"{gw.url}{RESPONSES}/{rid}", headers=auth, timeout=30) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429], [r.text for r in codes]
    assert codes[2].headers["x-cortex-dropped-reason"] == "rate_limited"
    assert "x-sim-worker" not in codes[2].headers


@pytest.mark.parametrize("path", TOKENIZER_PATHS)
def test_a_tokenizer_endpoint_goes_only_to_a_worker_of_the_body_model(gw: Gateway, path: str) -> None:
    """/tokenize and its kin answer with one model's tokenizer: each goes to a worker of the model its body names
    (an alias as the model it stands for), never to the least loaded worker of another model."""
    def tokenize(model: str | None) -> httpx.Response:
        doc = {"prompt": "hello"} if "detokenize" not in path else {"tokens": [1, 2]}
        return post(gw, path, doc if model is None else {**doc, "model": model})

    for model, workers in ((MODEL, {"sim-1", "sim-2"}), (OTHER, {"sgl-1"}), (SOLO, {"solo-1"}),
                           (SOLO_ALIAS, {"solo-1"})):
        if path.startswith("/v1/") and model != OTHER:  # vLLM serves only the unprefixed pair: Cortex says so
            r = tokenize(model)
            assert r.status_code == 404 and "has no /v1/" in r.json()["error"]["message"], r.text
            assert "x-sim-worker" not in r.headers
            continue
        for _ in range(3):
            r = tokenize(model)
            assert r.status_code == 200, (model, r.text)
            assert r.headers["x-sim-worker"] in workers, model
    unknown = tokenize("no/such-model")
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert "x-sim-worker" not in unknown.headers
    unnamed = tokenize(None)  # four models are configured: which tokenizer is meant?
    assert unnamed.status_code == 400 and "names no model" in unnamed.json()["error"]["message"]
    assert "x-sim-worker" not in unnamed.headers


def test_a_stored_response_is_retrieved_from_the_worker_that_stored_it(gw: Gateway) -> None:
    """vLLM keeps stored responses in its API server's memory: GET /v1/responses/{id} and its cancel answer only
    there (another worker says 404), so they go to the worker Cortex named the id after."""
    first = post(gw, RESPONSES, body(RESPONSES, "Remember the colour blue."))
    rid, worker = first.json()["id"], first.headers["x-sim-worker"]
    auth = {"authorization": f"Bearer {key('free')}"}
    for _ in range(4):  # whatever the load
        got = httpx.get(f"{gw.url}{RESPONSES}/{rid}", headers=auth, timeout=30)
        assert got.status_code == 200, got.text
        assert got.headers["x-sim-worker"] == worker and got.json()["id"] == rid
    cancel = httpx.post(f"{gw.url}{RESPONSES}/{rid}/cancel", headers=auth, timeout=30)
    assert cancel.headers["x-sim-worker"] == worker
    assert cancel.status_code == 400 and cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
    # An id Cortex did not name goes to some worker, which answers as the engine does.
    unknown = httpx.get(f"{gw.url}{RESPONSES}/resp_unknown_1", headers=auth, timeout=30)
    assert unknown.status_code == 404 and "x-sim-worker" in unknown.headers
    # Other paths under /v1/responses stay closed at Envoy.
    assert httpx.get(f"{gw.url}{RESPONSES}/{rid}/input_items/x", headers=auth, timeout=30).status_code == 404


@pytest.mark.parametrize("held", STREAMED)
def test_max_concurrent_holds_across_every_path(gw: Gateway, held: str) -> None:
    """One stream in flight on `held`: the tenant's every other request, on any path, is refused."""
    first_chunk, leave = threading.Event(), threading.Event()

    def long_stream() -> None:
        doc = body(held, stream=True)
        for field in ("max_tokens", "max_output_tokens"):
            if field in doc:
                doc[field] = 2000
        if held == GENERATE:
            doc["sampling_params"] = {"max_new_tokens": 2000}
        with httpx.stream("POST", f"{gw.url}{held}", json=doc, timeout=60,
                          headers={"authorization": f"Bearer {key('conc')}"}) as r:
            assert r.status_code == 200
            for _ in r.iter_raw():
                first_chunk.set()
                if leave.is_set():
                    break

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert first_chunk.wait(30)
        for path in INFERENCE_PATHS:
            r = post(gw, path, body(path), "conc")
            assert r.status_code == 429 and r.headers["x-cortex-dropped-reason"] == "concurrency", path
    finally:
        leave.set()
        t.join(60)
    wait_for(lambda: post(gw, CHAT, body(CHAT), "conc").status_code == 200, timeout=20, interval=0.2,
             what="the slot released")


@pytest.mark.parametrize("path", SPENDING)
def test_a_request_larger_than_the_token_rate_is_refused_on_every_path(gw: Gateway, path: str) -> None:
    who = f"tpm-{NAMES[path]}"
    before = served(gw)
    r = post(gw, path, body(path, big=True), who)
    assert r.status_code == 429 and r.headers["x-cortex-dropped-reason"] == "tokens_per_minute", r.text
    assert "too large" in r.json()["error"]["message"]
    assert delta(before, served(gw)) == {s.id: {} for s in gw.sims}
    assert post(gw, path, body(path), who).status_code == 200


def _usage(path: str, r: httpx.Response) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens from the answer, in its API's own usage shape."""
    doc = r.json()
    if path == RESPONSES:
        u = doc["usage"]
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"], u["output_tokens"]
    if path == MESSAGES:
        u = doc["usage"]
        read = u.get("cache_read_input_tokens") or 0
        return u["input_tokens"] + read + (u.get("cache_creation_input_tokens") or 0), read, u["output_tokens"]
    if path == GENERATE:
        m = doc["meta_info"]
        return m["prompt_tokens"], m["cached_tokens"], m["completion_tokens"]
    u = doc["usage"]
    return (u["prompt_tokens"], ((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
            u.get("completion_tokens") or 0)


@pytest.mark.parametrize("path", SPENDING)
def test_token_limits_are_settled_with_each_apis_usage(gw: Gateway, path: str) -> None:
    who = f"quota-{NAMES[path]}"
    r = post(gw, path, body(path), who)
    assert r.status_code == 200, r.text
    prompt, cached, completion = _usage(path, r)
    expected = limits.cost(ChargeWeights(), prompt, cached, completion)
    assert expected > 0

    def charged() -> float:
        return total(scrape(gw.observe_url), "cortex_tenant_charged_tokens_total", tenant=who)

    wait_for(charged, timeout=20, what="the observer settled the request")
    assert charged() == pytest.approx(expected)


@pytest.mark.parametrize("path", [RESPONSES, MESSAGES])
def test_a_streamed_answer_is_settled_with_its_final_usage(gw: Gateway, path: str) -> None:
    who = f"quota-{NAMES[path]}"
    before = total(scrape(gw.observe_url), "cortex_tenant_charged_tokens_total", tenant=who)
    with httpx.stream("POST", f"{gw.url}{path}", json=body(path, "Stream this please.", stream=True), timeout=60,
                      headers={"authorization": f"Bearer {key(who)}"}) as r:
        assert r.status_code == 200
        text = r.read().decode()
    final = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")][-1 if path == RESPONSES
                                                                                              else -2]
    usage = final["response"]["usage"] if path == RESPONSES else final["usage"]
    if path == RESPONSES:
        prompt, cached, out = usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], \
            usage["output_tokens"]
    else:
        cached = usage["cache_read_input_tokens"]
        prompt, out = usage["input_tokens"] + cached, usage["output_tokens"]
    expected = before + limits.cost(ChargeWeights(), prompt, cached, out)
    wait_for(lambda: total(scrape(gw.observe_url), "cortex_tenant_charged_tokens_total", tenant=who) > before,
             timeout=20, what="the stream settled")
    assert total(scrape(gw.observe_url), "cortex_tenant_charged_tokens_total", tenant=who) == pytest.approx(expected)


def explain(gw: Gateway, path: str, doc: dict[str, Any]) -> dict[str, Any]:
    """The decision `doc` would get on `path` from tenant free (route explain on the admin port, in that tenant's
    view of the cache: nothing is forwarded)."""
    r = httpx.post(gw.explain_url, params={"path": path}, json=doc, timeout=10, headers={TENANT_VIEW_HEADER: "free"})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(path: str, r: httpx.Response) -> int:
    return _usage(path, r)[1]


LONG = " ".join(f"step{i}: read the file, run the tests, fix what fails." for i in range(40))
CACHED_BODIES: dict[str, dict[str, Any]] = {
    RESPONSES: {"model": MODEL, "instructions": "You are a coding agent.", "max_output_tokens": 4,
                "tools": [{"type": "function", "name": "run_tests", "parameters": {"type": "object"}}],
                "input": [{"role": "user", "content": LONG},
                          {"type": "function_call", "call_id": "c1", "name": "run_tests", "arguments": '{"k": 1}'},
                          {"type": "function_call_output", "call_id": "c1", "output": "3 passed"}]},
    MESSAGES: {"model": MODEL, "max_tokens": 4, "system": [{"type": "text", "text": "You are Claude Code."}],
               "tools": [{"name": "run_tests", "input_schema": {"type": "object"}}],
               "messages": [{"role": "user", "content": LONG},
                            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "run_tests",
                                                               "input": {"k": 1}}]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                          "content": "3 passed"}]}]},
    CHAT: {"model": MODEL, "max_tokens": 4, "tools": [{"type": "function", "function": {"name": "run_tests"}}],
           "messages": [{"role": "user", "content": LONG},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": "3 passed"}]},
    COMPLETIONS: {"model": MODEL, "max_tokens": 4, "prompt": list(range(1000, 1400))},
    GENERATE: {"input_ids": list(range(2000, 2400)), "sampling_params": {"max_new_tokens": 4}},
}


@pytest.mark.parametrize("path", list(CACHED_BODIES))
def test_a_second_identical_request_is_an_exact_hit(gw: Gateway, path: str) -> None:
    doc = CACHED_BODIES[path]
    first = post(gw, path, doc)
    assert first.status_code == 200, first.text
    worker = first.headers["x-cortex-assigned-worker"]
    # The ledger learns the first request's blocks from the engine's KV events before the second is routed.
    wait_for(lambda: explain(gw, path, doc)["mode"] == "exact_kv_events", timeout=20, what="an exact-KV decision")
    second = post(gw, path, doc)
    claimed = int(second.headers["x-cortex-cache-hit-tokens"])
    assert second.headers["x-cortex-assigned-worker"] == worker
    cached = _cached(path, second)
    # Cortex claims whole 16-token blocks: exactly the vLLM workers' cached tokens (16-token pages); for the
    # SGLang worker (1-token pages) the whole blocks of what it cached.
    assert claimed > 0 and claimed == (cached if path != GENERATE else cached // 16 * 16)


def test_a_responses_follow_up_goes_to_the_worker_that_stored_its_response(gw: Gateway) -> None:
    first = post(gw, RESPONSES, body(RESPONSES, "Remember the number 42."))
    assert first.status_code == 200
    rid = first.json()["id"]
    assert rid.startswith("resp_cx")  # named by Cortex after the worker that holds it
    worker = first.headers["x-sim-worker"]
    for _ in range(4):  # whatever the load, every follow-up goes there
        follow = post(gw, RESPONSES, body(RESPONSES, "Which number?", previous_response_id=rid))
        assert follow.status_code == 200, follow.text
        assert follow.headers["x-sim-worker"] == worker
        assert follow.headers["x-cortex-route-reason"] == "previous_response"
        assert follow.headers["x-cortex-cache-hit-tokens"] == "0"  # Cortex cannot render the stored conversation
    # A client's own request_id is kept (and such a response is routed as any other).
    own = post(gw, RESPONSES, body(RESPONSES, request_id="resp_mine_1"))
    assert own.json()["id"] == "resp_mine_1"


# --- Anthropic's count_tokens -------------------------------------------------------------------------------------

COUNTED = {"system": [{"type": "text", "text": "You are Claude Code."}],
           "tools": [{"name": "run_tests", "input_schema": {"type": "object"}}],
           "messages": [{"role": "user", "content": LONG},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "run_tests",
                                                           "input": {"k": 1}}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                      "content": "3 passed"}]}]}


def test_count_tokens_answers_vllms_shape_with_the_messages_prompt_length(gw: Gateway) -> None:
    """The count is the prompt /v1/messages computes for the same conversation, in vLLM's answer shape."""
    r = post(gw, COUNT_TOKENS, {"model": MODEL, **COUNTED})
    assert r.status_code == 200, r.text
    n = r.json()["input_tokens"]
    assert r.json() == {"input_tokens": n, "context_management": {"original_input_tokens": n}}
    assert r.headers["x-sim-worker"] in ("sim-1", "sim-2")
    # By load, nothing claimed: the engine renders and counts, it computes no KV.
    assert r.headers["x-cortex-cache-hit-tokens"] == "0" and r.headers["x-cortex-match-mode"] != "exact_kv_events"
    assert r.headers["x-cortex-route-reason"] == "token_count"
    prompt, _, _ = _usage(MESSAGES, post(gw, MESSAGES, {"model": MODEL, "max_tokens": 2, **COUNTED}))
    assert n == prompt > 100
    # SGLang answers the count alone.
    other = post(gw, COUNT_TOKENS, {"model": OTHER, **COUNTED})
    assert other.headers["x-sim-worker"] == "sgl-1"
    prompt, _, _ = _usage(MESSAGES, post(gw, MESSAGES, {"model": OTHER, "max_tokens": 2, **COUNTED}))
    assert other.json() == {"input_tokens": prompt}


def test_count_tokens_of_a_model_with_one_worker_goes_to_that_worker(gw: Gateway) -> None:
    """Whatever the load, by its name or its alias: a request only ever reaches a worker serving its model."""
    for model in (SOLO, SOLO_ALIAS, SOLO, SOLO_ALIAS):
        before = served(gw)
        r = post(gw, COUNT_TOKENS, {"model": model, **COUNTED})
        assert r.status_code == 200, r.text
        assert r.headers["x-sim-worker"] == "solo-1" and r.headers["x-cortex-cache-hit-tokens"] == "0"
        assert {w: d for w, d in delta(before, served(gw)).items() if d} == {"solo-1": {COUNT_TOKENS: 1}}


def test_count_tokens_claims_no_cache_and_leaves_no_prediction(gw: Gateway) -> None:
    """A counted conversation is not predicted on the worker that counted it: the Messages request that follows
    is decided on what the engines hold (nothing, on SOLO's only worker), not on a count."""
    doc = {**COUNTED, "messages": [{"role": "user", "content": "Never seen before. " + LONG}]}
    for _ in range(2):
        assert post(gw, COUNT_TOKENS, {"model": SOLO, **doc}).status_code == 200
    messages = {"model": SOLO, "max_tokens": 2, **doc}
    decided = explain(gw, MESSAGES, messages)
    (solo,) = decided["workers"]
    assert decided["cache_hit_tokens"] == solo["predicted_tokens"] == solo["matched_tokens"] == 0, decided
    # The same conversation sent to /v1/messages is computed, predicted, then held: the next one is a hit.
    assert post(gw, MESSAGES, messages).status_code == 200
    wait_for(lambda: explain(gw, MESSAGES, messages)["cache_hit_tokens"] > 0, timeout=20, what="a hit after a run")


@pytest.mark.parametrize(("doc", "status", "param"), [
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400, "messages"),
    ({"model": MODEL, "messages": [], "tools": [{"name": "f"}]}, 400, "tools"),
    ({"messages": []}, 400, "model"),
    ({"model": "no/such-model", "messages": []}, 404, "model"),
])
def test_a_bad_count_tokens_request_is_refused_before_any_worker(gw: Gateway, doc: dict[str, Any], status: int,
                                                                  param: str) -> None:
    before = served(gw)
    r = post(gw, COUNT_TOKENS, doc)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"]
    assert "x-sim-worker" not in r.headers
    assert delta(before, served(gw)) == {s.id: {} for s in gw.sims}


def test_count_tokens_spends_no_tokens(gw: Gateway) -> None:
    """A tenant held to 300 tokens a minute counts a prompt far longer, again and again; its settled charge is
    only what its one generation costs."""
    who = f"tpm-{NAMES[COUNT_TOKENS]}"
    for _ in range(4):
        r = post(gw, COUNT_TOKENS, body(COUNT_TOKENS, big=True), who)
        assert r.status_code == 200 and r.json()["input_tokens"] > 300, r.text
    spent = post(gw, CHAT, body(CHAT), who)
    assert spent.status_code == 200
    u = spent.json()["usage"]
    expected = limits.cost(ChargeWeights(), u["prompt_tokens"],
                           (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0, u["completion_tokens"])

    def charged() -> float:
        return total(scrape(gw.observe_url), "cortex_tenant_charged_tokens_total", tenant=who)

    wait_for(charged, timeout=20, what="the observer settled the chat completion")
    assert charged() == pytest.approx(expected)
