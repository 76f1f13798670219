"""`POST /sim/prefix_match`: the read-only probe of what a simulated worker's cache holds for a request.

A benchmark oracle routes on it, so it must agree with what the worker then reports as cached, and asking
must not change the cache (no LRU refresh, no radix split)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from cortexsim.server import SimServer
from tests.sim.simkit import LONG, chat_body, config, first_token, serve


async def probe(http: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post("/sim/prefix_match", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def cached_of(http: aiohttp.ClientSession, body: dict[str, Any]) -> int:
    async with http.post("/v1/chat/completions", json={**body, "max_tokens": 2}) as resp:
        assert resp.status == 200, await resp.text()
        return int((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_probe_predicts_the_reported_hit_and_changes_nothing(engine: str) -> None:
    async def scenario(server: SimServer, http: aiohttp.ClientSession) -> None:
        body = chat_body(LONG + " First question?")
        cold = await probe(http, body)
        assert cold["cached_tokens"] == [0] and cold["prompt_tokens"] > 200
        assert await cached_of(http, body) == 0
        # Same system context, different question: a partial hit, which the probe must predict exactly.
        sibling = chat_body(LONG + " Second question, rather different?")
        expected = await probe(http, sibling)
        assert 0 < expected["cached_tokens"][0] < expected["prompt_tokens"] - 1
        if engine == "sglang":
            # A probe that split radix nodes would show up as extra nodes; refresh, as a changed LRU order.
            nodes = _nodes(server)
            await probe(http, sibling)
            assert _nodes(server) == nodes
        assert await cached_of(http, sibling) == expected["cached_tokens"][0]
        again = await probe(http, sibling)
        assert again["cached_tokens"][0] == again["prompt_tokens"] - 1 if engine == "sglang" else \
            again["cached_tokens"][0] == (again["prompt_tokens"] - 1) // 16 * 16
        # Same words as a completion prompt: a different token sequence from the chat, so no shared blocks.
        other = await probe(http, {"prompt": "Completely unrelated text about the weather."})
        assert other["cached_tokens"] == [0]

    serve(scenario, config(engine=engine))


def test_probe_rejects_a_body_without_a_prompt() -> None:
    async def scenario(server: SimServer, http: aiohttp.ClientSession) -> None:
        async with http.post("/sim/prefix_match", json={"model": "x"}) as resp:
            assert resp.status == 400

    serve(scenario, config())


def test_probe_reports_what_a_request_in_flight_will_cache() -> None:
    async def scenario(server: SimServer, http: aiohttp.ClientSession) -> None:
        body = chat_body(LONG + " Stream slowly?")
        async with http.post("/v1/chat/completions", json={**body, "max_tokens": 200, "stream": True}) as resp:
            await first_token(resp)  # running now, decoding its 200 tokens
            seen = await probe(http, body)
            assert seen["inflight_tokens"] == [seen["prompt_tokens"] - 1]
            other = await probe(http, chat_body("Nothing alike."))
            assert 0 < other["inflight_tokens"][0] < 40  # the chat template's head only
            async for _ in resp.content:  # let it finish
                pass
        after = await probe(http, body)
        assert after["inflight_tokens"] == [0] and after["cached_tokens"][0] > 0

    serve(scenario, config())


def test_probe_answers_per_data_parallel_rank() -> None:
    async def scenario(server: SimServer, http: aiohttp.ClientSession) -> None:
        body = chat_body(LONG)
        async with http.post("/v1/chat/completions", json={**body, "max_tokens": 2},
                             headers={"X-data-parallel-rank": "1"}) as resp:
            assert resp.status == 200
        cached = (await probe(http, body))["cached_tokens"]
        assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0

    serve(scenario, config(dp_size=2))


def _nodes(server: SimServer) -> int:
    assert server.engine is not None
    stack, n = [server.engine.cache.root], 0  # type: ignore[attr-defined]
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(node.children.values())
    return n
