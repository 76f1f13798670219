"""LoRA requests end to end, for both engines: simulated workers serving an adapter, the real Envoy, ingest and
extproc. A request for the adapter is routed by the blocks the engine stored under that adapter, with a claimed
hit equal to the engine's own cached_tokens; the base model never claims the adapter's blocks, nor the reverse."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.harness import MODEL, Gateway, cluster, long_chat, wait_for

pytestmark = pytest.mark.timeout(240)

ADAPTER = "sql-lora"
LORA_FLAGS = ("--lora-modules", f"{ADAPTER}=/adapters/sql")


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    engine = request.param
    with cluster(tmp_path_factory.mktemp(f"lora-{engine}"), sim_args=LORA_FLAGS, engine=engine,
                 model_extra={"loras": [ADAPTER]}) as g:
        yield g


def lora_fields(gw: Gateway, form: int = 0) -> dict[str, Any]:
    """How a client of this engine asks for the adapter (SGLang has two ways; both must land on the same blocks)."""
    if gw.sims[0].engine == "vllm":
        return {"model": ADAPTER}
    return {"model": f"{MODEL}:{ADAPTER}"} if form == 0 else {"model": MODEL, "lora_path": ADAPTER}


def post(gw: Gateway, messages: list[dict[str, str]], fields: dict[str, Any]) -> tuple[httpx.Headers, dict]:
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **fields},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.headers, r.json()["usage"]


def explain(gw: Gateway, messages: list[dict[str, str]], fields: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(gw.explain_url, json={"messages": messages, **fields}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def claimed(doc: dict[str, Any]) -> int:
    return max((w["matched_tokens"] or 0) for w in doc["workers"])


def cached(usage: dict[str, Any]) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def assert_hit(gw: Gateway, h: httpx.Headers, usage: dict[str, Any]) -> None:
    """The claim is the engine's own reuse: equal for vLLM (pages are Cortex's 16-token blocks); for SGLang (pages
    of one token) whole Cortex blocks, so at most one block short of it and never more."""
    assert h["x-cortex-match-mode"] == "exact_kv_events"
    hit = int(h["x-cortex-cache-hit-tokens"])
    if gw.sims[0].engine == "vllm":
        assert hit == cached(usage) > 0
    else:
        assert 0 < hit <= cached(usage) < hit + 16


def settle(gw: Gateway, messages: list[dict[str, str]], fields: dict[str, Any]) -> dict[str, Any]:
    """Wait until the worker's events for the prompt are in the ledger."""
    return wait_for(lambda: (lambda d: d if d["mode"] == "exact_kv_events" and d["cache_hit_tokens"] > 0 else None)(
        explain(gw, messages, fields)), timeout=20, what="the prompt's blocks in the ledger")


def test_models_lists_the_vllm_adapter(gw: Gateway) -> None:
    ids = {m["id"] for m in httpx.get(f"{gw.url}/v1/models", timeout=10).json()["data"]}
    assert MODEL in ids
    assert (ADAPTER in ids) == (gw.sims[0].engine == "vllm")


def test_lora_request_repeated_hits_the_adapter_blocks(gw: Gateway) -> None:
    messages = long_chat(600, seed=701)
    lora = lora_fields(gw)
    first, usage = post(gw, messages, lora)
    assert first["x-cortex-cache-hit-tokens"] == "0" and cached(usage) == 0
    doc = settle(gw, messages, lora)
    assert doc["lora"] == ADAPTER and doc["model"] == MODEL
    assert doc["chosen"] == first["x-cortex-assigned-worker"]
    for form in (0, 1):
        h, usage = post(gw, messages, lora_fields(gw, form))
        assert h["x-cortex-assigned-worker"] == first["x-cortex-assigned-worker"]
        assert_hit(gw, h, usage)


def test_base_model_never_claims_the_adapter_blocks(gw: Gateway) -> None:
    messages = long_chat(600, seed=702)
    lora = lora_fields(gw)
    post(gw, messages, lora)
    settle(gw, messages, lora)
    base = {"model": MODEL}
    doc = explain(gw, messages, base)
    assert doc["lora"] is None and claimed(doc) == 0, doc
    h, usage = post(gw, messages, base)
    # The engine reuses nothing across the namespaces either: at most a few leading tokens (one-token SGLang pages)
    # that earlier prompts of the same namespace share with this one, never a Cortex block's worth.
    assert h["x-cortex-cache-hit-tokens"] == "0" and cached(usage) < 16


def test_adapter_never_claims_the_base_model_blocks(gw: Gateway) -> None:
    messages = long_chat(600, seed=703)
    base = {"model": MODEL}
    post(gw, messages, base)
    settle(gw, messages, base)
    lora = lora_fields(gw)
    doc = explain(gw, messages, lora)
    assert doc["lora"] == ADAPTER and claimed(doc) == 0, doc
    h, usage = post(gw, messages, lora)
    # The engine reuses nothing across the namespaces either: at most a few leading tokens (one-token SGLang pages)
    # that earlier prompts of the same namespace share with this one, never a Cortex block's worth.
    assert h["x-cortex-cache-hit-tokens"] == "0" and cached(usage) < 16
    # and now the adapter has its own copy, which its repeat finds
    settle(gw, messages, lora)
    h, usage = post(gw, messages, lora)
    assert_hit(gw, h, usage)


def test_unknown_adapter_name_is_a_clear_404(gw: Gateway) -> None:
    # vLLM: `model` names the adapter, so an unlisted name is unknown. SGLang loads adapters at run time and
    # judges `<model>:<adapter>` itself, so what Cortex can refuse there is an unknown base model.
    name = "no-such-lora" if gw.sims[0].engine == "vllm" else "no-such-model:no-such-lora"
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": name, "messages": long_chat(10)}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
