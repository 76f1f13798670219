"""The agent APIs against real vLLM 0.32 engines behind `cortex run`: Cortex's token ids for chat completions,
Responses and Anthropic Messages requests equal the engine's own (its /render endpoints) on a corpus of agent
conversations with tools (tests/agent_corpus.py), a second identical Responses or Messages request is an exact
hit (the claim equals the engine's cached tokens), a Responses follow-up naming its previous response goes to
the engine that stored it (the other answers 404 for a response it does not hold), and Anthropic's count_tokens is
forwarded and answered with the length of the prompt the engine renders for the same Messages request, and the
tokenizer endpoints reach an engine of the body's model.

The engines run as agent deployments do: `--enable-auto-tool-choice --tool-call-parser hermes` (Qwen2.5's tool
format; without it vLLM refuses tools with tool_choice auto), `--enable-scale-out` (the /render endpoints) and
VLLM_ENABLE_RESPONSES_API_STORE=1 (previous_response_id)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex.api_paths import CHAT, COUNT_TOKENS, MESSAGES, RESPONSES
from tests import agent_corpus
from tests.harness import MODEL, Gateway, wait_for
from tests.real_engine.vllm_engine import VllmEngine, gateway, new_engine, running, settle

pytestmark = pytest.mark.timeout(900)

AGENT_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-scale-out")
CORPUS = agent_corpus.cases(20) + agent_corpus.EDGES


@pytest.fixture(scope="module")
def fleet(vllm_available: None, qwen2_tiny: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, list[VllmEngine]]]:
    logs = tmp_path_factory.mktemp("agents")
    engines = [new_engine(f"vllm-{i}", qwen2_tiny, logs, flags=AGENT_FLAGS,
                          env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"}) for i in (1, 2)]
    with running(engines), gateway(tmp_path_factory.mktemp("agents-gw"), engines) as gw:
        yield gw, engines


def cortex_ids(gw: Gateway, path: str, body: dict[str, Any]) -> list[int]:
    """The token ids Cortex routes the request by: route explain with the whole prompt (`tokens=1`), the same
    parse, conversion, template and tokenizer real traffic takes, nothing forwarded."""
    r = httpx.post(gw.explain_url, params={"path": path, "tokens": "1"}, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["token_ids"])


def engine_ids(engine: VllmEngine, path: str, body: dict[str, Any]) -> list[int]:
    r = httpx.post(f"{engine.url}{path}/render", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return list(r.json()["token_ids"])


@pytest.mark.parametrize(("api", "path", "doc"), CORPUS, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(CORPUS)])
def test_cortex_renders_every_api_as_the_engine(fleet: tuple[Gateway, list[VllmEngine]], api: str, path: str,
                                                doc: dict[str, Any]) -> None:
    gw, engines = fleet
    body = {"model": MODEL, **doc}
    ours, theirs = cortex_ids(gw, path, body), engine_ids(engines[0], path, body)
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    assert ours == theirs, f"first difference at token {at} of {len(theirs)}"


def _post(gw: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(f"{gw.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def _cached(path: str, doc: dict[str, Any]) -> int:
    if path == RESPONSES:
        return int(doc["usage"]["input_tokens_details"]["cached_tokens"])
    if path == MESSAGES:
        return int(doc["usage"].get("cache_read_input_tokens") or 0)
    return int(doc["usage"]["prompt_tokens_details"]["cached_tokens"])


def _current(gw: Gateway, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    view = httpx.post(gw.explain_url, params={"path": path}, json=body, timeout=60).json()
    return view if all(w["engine_load"] is not None and not w["suspect"] for w in view["workers"]) else None


@pytest.mark.parametrize("seed", [101, 102])
@pytest.mark.parametrize("path", [RESPONSES, MESSAGES, CHAT])
def test_a_second_identical_request_is_an_exact_hit(fleet: tuple[Gateway, list[VllmEngine]], path: str,
                                                    seed: int) -> None:
    gw, _ = fleet
    make = {RESPONSES: agent_corpus.responses, MESSAGES: agent_corpus.messages, CHAT: agent_corpus.chat}[path]
    body = {"model": MODEL, **make(seed)}
    first = _post(gw, path, body)
    settle(gw)  # the ledger holds what the engine stored before the second request is routed
    # Both engines known to be up with a current load reading: on a loaded machine a reading can age out or a
    # health probe time out, and such a holder rightly gives way to an engine known to be up (policies/tiers.py).
    view = wait_for(lambda: _current(gw, path, body), timeout=30, what="a current reading of every engine")
    second = _post(gw, path, body)
    claimed = int(second.headers["x-cortex-cache-hit-tokens"])
    assert second.headers["x-cortex-assigned-worker"] == first.headers["x-cortex-assigned-worker"], (
        second.headers.get("x-cortex-route-reason"), view)
    assert claimed > 0 and claimed == _cached(path, second.json())


def test_a_responses_follow_up_goes_to_the_engine_that_stored_its_response(
        fleet: tuple[Gateway, list[VllmEngine]]) -> None:
    gw, engines = fleet
    first = _post(gw, RESPONSES, {"model": MODEL, "input": "Remember the number 42.", "max_output_tokens": 4})
    rid = first.json()["id"]
    holder = first.headers["x-cortex-assigned-worker"]
    other = next(e for e in engines if e.id != holder)
    follow = {"model": MODEL, "input": "Which number?", "max_output_tokens": 4, "previous_response_id": rid}
    # Only the holder knows the response: the other engine answers 404 ...
    assert httpx.post(f"{other.url}{RESPONSES}", json=follow, timeout=60).status_code == 404
    for _ in range(3):  # ... and every follow-up through Cortex goes to the holder.
        r = _post(gw, RESPONSES, follow)
        assert r.headers["x-cortex-assigned-worker"] == holder
        assert r.headers["x-cortex-route-reason"] == "previous_response"
    chained = _post(gw, RESPONSES, {**follow, "previous_response_id": r.json()["id"]})
    assert chained.headers["x-cortex-assigned-worker"] == holder


# What vLLM's AnthropicCountTokensRequest takes of a Messages request (no max_tokens, no sampling fields).
_COUNTED_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                   "chat_template_kwargs")


@pytest.mark.parametrize("seed", [201, 202, 203])
def test_count_tokens_is_forwarded_and_counts_the_engines_render(fleet: tuple[Gateway, list[VllmEngine]],
                                                                 seed: int) -> None:
    gw, engines = fleet
    doc = {"model": MODEL, **agent_corpus.messages(seed)}
    counted = {k: v for k, v in doc.items() if k in _COUNTED_FIELDS}
    r = _post(gw, COUNT_TOKENS, counted)
    n = r.json()["input_tokens"]
    assert r.json() == {"input_tokens": n, "context_management": {"original_input_tokens": n}}
    assert n == len(engine_ids(engines[0], MESSAGES, doc)) > 0
    assert r.headers["x-cortex-route-reason"] == "token_count" and r.headers["x-cortex-cache-hit-tokens"] == "0"


def test_the_tokenizer_endpoints_reach_an_engine_of_the_model_and_answer_as_it_does(
        fleet: tuple[Gateway, list[VllmEngine]]) -> None:
    """/tokenize and /detokenize through Cortex answer with the engine's own tokenizer (a worker of the body's
    model); /v1/tokenize, which vLLM does not serve, is Cortex's 404 rather than a forwarded one."""
    gw, engines = fleet
    text = "Tokenize me, then give the words back: 東京, naïve, 42."
    for doc in ({"model": MODEL, "prompt": text},
                {"model": MODEL, "messages": [{"role": "user", "content": text}], "add_generation_prompt": True}):
        r = _post(gw, "/tokenize", doc)
        assert r.headers["x-cortex-assigned-worker"] in {e.id for e in engines}
        own = httpx.post(f"{engines[0].url}/tokenize", json=doc, timeout=60)
        assert r.json()["tokens"] == own.json()["tokens"] and r.json()["count"] > 0, (r.text, own.text)
    ids = _post(gw, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False}).json()["tokens"]
    back = _post(gw, "/detokenize", {"model": MODEL, "tokens": ids})
    assert back.json()["prompt"] == text
    assert httpx.post(f"{engines[0].url}/v1/tokenize", json={"model": MODEL, "prompt": text},
                      timeout=60).status_code == 404
    refused = httpx.post(f"{gw.url}/v1/tokenize", json={"model": MODEL, "prompt": text}, timeout=60)
    assert refused.status_code == 404 and "has no /v1/" in refused.json()["error"]["message"], refused.text
    assert "x-cortex-assigned-worker" not in refused.headers
