"""The simulator's agent and pooling APIs (cortexsim/agent_api.py): vLLM 0.32's answer shapes, the prompt the
real engine renders (so a repeat is a cache hit of the same size), stored responses continued by
previous_response_id (404 for one not held), and the pooling APIs' usage."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from cortex.conversation.chat import chat_messages
from cortexsim.server import SimServer
from tests.sim.simkit import BUNDLE, MODEL, config, serve


async def events(resp: aiohttp.ClientResponse) -> list[tuple[str, dict[str, Any]]]:
    """`event: <kind>` / `data: {...}` pairs of a Responses or Messages stream."""
    assert resp.status == 200, await resp.text()
    out: list[tuple[str, dict[str, Any]]] = []
    kind = ""
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"event: "):
            kind = line[7:].decode()
        elif line.startswith(b"data: "):
            out.append((kind, orjson.loads(line[6:])))
    return out


def rendered(messages: list[dict[str, Any]]) -> int:
    """Prompt tokens of a conversation as the engine renders it."""
    conv, _ = chat_messages(messages)
    return len(BUNDLE.encode_chat(conv, add_generation_prompt=True))


def test_responses_answer_store_and_continue() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        body = {"model": MODEL, "instructions": "Be brief.", "input": "Name a colour. " * 30, "max_output_tokens": 5}
        async with http.post("/v1/responses", json=body) as resp:
            first = await resp.json()
        prompt = rendered([{"role": "system", "content": "Be brief."}, {"role": "user", "content": body["input"]}])
        assert first["object"] == "response" and first["status"] == "incomplete" and first["id"].startswith("resp_")
        assert first["usage"]["input_tokens"] == prompt and first["usage"]["output_tokens"] == 5
        assert first["output"][0]["content"][0]["type"] == "output_text"
        async with http.post("/v1/responses", json={**body, "stream": True, "request_id": "resp_mine"}) as resp:
            stream = await events(resp)
        assert [k for k, _ in stream][:2] == ["response.created", "response.in_progress"]
        kind, done = stream[-1]
        assert kind == "response.completed" and done["response"]["id"] == "resp_mine"
        assert done["response"]["usage"]["input_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16
        follow = {"model": MODEL, "input": "And another?", "previous_response_id": "resp_mine"}
        async with http.post("/v1/responses", json=follow) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["input_tokens"] > prompt  # the stored conversation comes first
        async with http.post("/v1/responses", json={**follow, "previous_response_id": "resp_other"}) as resp:
            assert resp.status == 404
            assert "not found" in (await resp.json())["error"]["message"]

    serve(scenario)


def test_messages_answer_and_stream_in_anthropics_shape() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        body = {"model": MODEL, "max_tokens": 4, "system": "Be brief.",
                "messages": [{"role": "user", "content": "Count to three. " * 30}]}
        async with http.post("/v1/messages", json=body) as resp:
            first = await resp.json()
        assert first["type"] == "message" and first["stop_reason"] == "max_tokens"
        assert first["usage"]["cache_read_input_tokens"] == 0
        async with http.post("/v1/messages", json={**body, "stream": True}) as resp:
            stream = await events(resp)
        kinds = [k for k, _ in stream]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        usage = stream[-2][1]["usage"]
        # Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens is the whole prompt.
        assert usage["cache_read_input_tokens"] > 0
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == first["usage"]["input_tokens"]
        async with http.post("/v1/messages", json={**body, "max_tokens": None}) as resp:
            assert resp.status == 400
        # count_tokens: the same prompt counted, nothing run, in vLLM's shape.
        counted = {k: v for k, v in body.items() if k != "max_tokens"}
        async with http.post("/v1/messages/count_tokens", json=counted) as resp:
            doc = await resp.json()
        n = first["usage"]["input_tokens"]
        assert doc == {"input_tokens": n, "context_management": {"original_input_tokens": n}}
        async with http.post("/v1/messages/count_tokens", json={"model": MODEL}) as resp:
            assert resp.status == 400

    serve(scenario)


def test_pooling_apis_count_the_prompt() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        n = len(BUNDLE.encode("hello world", add_special_tokens=True))
        async with http.post("/v1/embeddings", json={"model": MODEL, "input": ["hello world", "hello world"]}) as r:
            doc = await r.json()
        assert len(doc["data"]) == 2 and doc["usage"]["prompt_tokens"] == 2 * n
        async with http.post("/v1/rerank", json={"model": MODEL, "query": "hello world",
                                                 "documents": ["a", "b", "c"], "top_n": 2}) as r:
            doc = await r.json()
        assert len(doc["results"]) == 2 and doc["usage"]["prompt_tokens"] > n
        async with http.post("/v1/score", json={"model": MODEL, "text_1": "hello world", "text_2": ["a"]}) as r:
            assert r.status == 200 and (await r.json())["data"][0]["object"] == "score"
        async with http.post("/v1/embeddings", json={"model": "other", "input": "x"}) as r:
            assert r.status == 404  # vLLM checks the model

    serve(scenario)


def test_sglang_serves_them_too() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        async with http.post("/v1/responses", json={"model": "any", "input": "hi", "max_output_tokens": 2}) as r:
            assert r.status == 200 and (await r.json())["usage"]["output_tokens"] == 2
        async with http.post("/v1/messages", json={"model": "any", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 200
            usage = (await r.json())["usage"]
            n = usage["input_tokens"] + usage["cache_read_input_tokens"]  # the Responses request cached most of it
        async with http.post("/v1/messages/count_tokens", json={"model": "any",
                                                                "messages": [{"role": "user", "content": "hi"}]}) as r:
            assert await r.json() == {"input_tokens": n}  # SGLang's shape: the count alone

    serve(scenario, config(engine="sglang"))
