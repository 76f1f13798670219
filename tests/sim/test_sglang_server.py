"""The simulated SGLang server over real loopback HTTP and ZMQ: endpoints, events, DP ranks and PD roles."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cortex.engine_hashes import LoraRef, sglang_page_hashes, sglang_wire_hash
from cortex.kv_events import SglAllBlocksCleared, SglBlockStored, decode_sglang_batch
from cortexsim.server import SimConfig, SimServer
from tests.sim.simkit import BUNDLE, LONG, MODEL, chat_body, config, first_token, metric, replay, serve, sse, until

CYCLE = BUNDLE.encode(" The quick brown fox jumps over the lazy dog.", add_special_tokens=False)


def sgl(**overrides: Any) -> SimConfig:
    return config(engine="sglang", **overrides)


def events(srv: SimServer, rank: int = 0) -> list[object]:
    pub = srv.publishers[rank]
    assert pub.flush(10) and pub.replay_endpoint is not None
    out: list[object] = []
    for _, payload in replay(pub.replay_endpoint):
        batch = decode_sglang_batch(payload)
        assert batch.attn_dp_rank == rank
        out.extend(batch.events)
    return out


def wires(tokens: list[int], page: int = 1) -> list[int]:
    return [sglang_wire_hash(d) for d in sglang_page_hashes(tokens, page)]


def test_chat_stream_and_usage() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        body = chat_body("Name three colours.", max_tokens=5)
        prompt = BUNDLE.encode_chat(body["messages"], add_generation_prompt=True)
        async with http.post("/v1/chat/completions", json=body) as resp:
            assert resp.headers["x-sim-worker"] == "w-test" and resp.headers["x-sim-dp-rank"] == "0"
            out = await resp.json()
        assert out["object"] == "chat.completion" and out["model"] == MODEL
        assert out["choices"][0]["message"]["content"] == BUNDLE.decode(CYCLE[:5])
        assert out["usage"]["prompt_tokens"] == len(prompt)
        assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        async with http.post("/v1/chat/completions", json=body) as resp:
            chunks = await sse(resp)
        assert chunks[-1] == "[DONE]"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        # SGLang sends the finish reason in its own chunk with an empty delta, then usage.
        assert chunks[-3]["choices"][0]["finish_reason"] == "length"
        assert chunks[-3]["choices"][0]["delta"]["content"] is None
        assert chunks[-2]["choices"] == []
        # Page size 1: every prompt token but the last is a hit.
        assert chunks[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt) - 1}
        text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks[1:-3])
        assert text == BUNDLE.decode(CYCLE[:5])

    serve(scenario, sgl())


def test_errors_tokenize_models_generate() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        async with http.post("/v1/completions", data=b"{bad") as resp:
            assert resp.status == 400
            err = await resp.json()
        assert err["object"] == "error" and err["code"] == 400  # SGLang's flat error body
        async with http.post("/v1/tokenize", json={"prompt": "Hello there"}) as resp:
            out = await resp.json()
        assert out["tokens"] == BUNDLE.encode("Hello there", add_special_tokens=True)
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 32768
        messages = chat_body(LONG)["messages"]
        async with http.post("/tokenize", json={"messages": messages}) as resp:
            assert (await resp.json())["tokens"] == BUNDLE.encode_chat(messages, add_generation_prompt=True)
        async with http.post("/v1/detokenize", json={"tokens": out["tokens"]}) as resp:
            assert (await resp.json())["text"] == "Hello there"
        async with http.get("/v1/models") as resp:
            (card,) = (await resp.json())["data"]
        assert card["owned_by"] == "sglang" and card["id"] == MODEL
        async with http.post("/generate", json={"input_ids": list(range(500, 520)),
                                                "sampling_params": {"max_new_tokens": 3}}) as resp:
            out = await resp.json()
        assert out["output_ids"] == CYCLE[:3]
        assert out["meta_info"]["prompt_tokens"] == 20 and out["meta_info"]["finish_reason"]["type"] == "length"
        async with http.post("/generate", json={"input_ids": list(range(500, 520)), "stream": True,
                                                "sampling_params": {"max_new_tokens": 3}}) as resp:
            chunks = await sse(resp)
        assert chunks[-2]["text"] == BUNDLE.decode(CYCLE[:3]) and chunks[-2]["meta_info"]["cached_tokens"] == 19

    serve(scenario, sgl())


def test_server_info_model_info_loads_metrics() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        async with http.get("/server_info") as resp:
            info = await resp.json()
        assert srv.kv_events_endpoint is not None and srv.kv_replay_endpoint is not None
        assert info["kv_events"] == {
            "publisher": "zmq", "endpoint_host": "127.0.0.1",
            "endpoint_port_base": int(srv.kv_events_endpoint.rsplit(":", 1)[1]), "topic": "kv@w@M",
            "block_size": 4, "dp_size": 2,
            "replay_endpoint_port_base": int(srv.kv_replay_endpoint.rsplit(":", 1)[1])}
        assert len(info["internal_states"]) == 2 and info["page_size"] == 4 and info["version"] == "0.5.23"
        async with http.get("/model_info") as resp:
            model_info = await resp.json()
        assert model_info["served_model_name"] == MODEL and model_info["disaggregation_mode"] == "null"
        assert (Path(model_info["model_path"]) / "tokenizer.json").is_file()  # local, so routers stay offline
        for rank in (0, 1, 1):
            async with http.post("/v1/completions", json={"prompt": list(range(40)), "max_tokens": 2,
                                                          "routed_dp_rank": rank}) as resp:
                assert resp.headers["x-sim-dp-rank"] == str(rank)
        async with http.get("/v1/loads", params={"include": "core,queues"}) as resp:
            loads = (await resp.json())["loads"]
        assert [entry["dp_rank"] for entry in loads] == [0, 1]
        assert "queues" in loads[0] and "memory" not in loads[0]
        assert loads[0]["max_total_num_tokens"] == 32768 and loads[1]["cache_hit_rate"] > 0
        async with http.get("/v1/loads", params={"format": "prometheus"}) as resp:
            text = await resp.text()
        assert 'sglang_num_running_reqs{dp_rank="1"} 0' in text
        assert await metric(http, "sglang:num_requests_total", dp_rank="1") == 2
        for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                     "sglang:cache_hit_rate", "sglang:prompt_tokens_total", "sglang:time_to_first_token_seconds_count"):
            assert await metric(http, name, dp_rank="0", engine_type="unified") >= 0
        assert await metric(http, "sglang:time_to_first_token_seconds_count") == 3

    serve(scenario, sgl(dp_size=2, block_size=4, kv_topic="kv@w@M"))


def test_events_startup_clear_hashes_and_flush() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        prompt = list(range(1000, 1030))
        async with http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}) as resp:
            assert resp.status == 200
        evs = events(srv)
        assert evs[0] == SglAllBlocksCleared()  # the cache's construction, first batch after startup
        stores = [e for e in evs if isinstance(e, SglBlockStored)]
        # Prefill inserts the prompt; the finished request then inserts its 3 computed output tokens.
        assert stores[0].block_hashes == wires(prompt) and stores[0].parent_block_hash is None
        assert stores[1].token_ids == CYCLE[:3] and stores[1].parent_block_hash == wires(prompt)[-1]
        busy = asyncio.create_task(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2000,
                                                                      "stream": True}))
        resp = await busy
        await first_token(resp)
        async with http.post("/flush_cache") as r:
            assert r.status == 400  # not idle
        resp.close()

        async def flushed() -> bool:
            async with http.post("/flush_cache", params={"timeout": "5"}) as r:
                return r.status == 200

        await until(flushed, "an idle flush")
        assert events(srv)[-1] == SglAllBlocksCleared()

    serve(scenario, sgl())


def test_health_generate_runs_a_one_token_request() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        async with http.get("/health_generate") as resp:
            assert resp.status == 200
        # The probe is a real [0] request: with page size 1 it leaves token 0 in the tree.
        stores = [e for e in events(srv) if isinstance(e, SglBlockStored)]
        assert stores and stores[0].token_ids == [0]

    serve(scenario, sgl())


def test_lora_and_salt_reach_the_events() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        body = {"prompt": list(range(1, 21)), "max_tokens": 1}
        for extra in ({"model": f"{MODEL}:sql"}, {"lora_path": "sql"}, {"cache_salt": "t1"}):
            async with http.post("/v1/completions", json=body | extra) as resp:
                assert resp.status == 200
        async with http.post("/v1/completions", json=body | {"model": f"{MODEL}:nope"}) as resp:
            assert resp.status == 400
        stores = [e for e in events(srv) if isinstance(e, SglBlockStored)]
        # Both spellings select one adapter namespace, so the second request only hit; the salted one is new.
        assert [(s.lora_name, s.cache_salt) for s in stores] == [("sql", None), (None, "t1")]
        assert stores[0].block_hashes != wires(list(range(1, 21)), 4)
        assert stores[1].block_hashes == [sglang_wire_hash(d) for d in sglang_page_hashes(
            list(range(1, 21)), 4, cache_salt="t1")]

    serve(scenario, sgl(block_size=4, lora_modules=(LoraRef("sql", "/adapters/sql"),)))


# --- PD -------------------------------------------------------------------------------------------


def test_pd_prefill_and_decode_rendezvous() -> None:
    async def scenario(prefill: SimServer, decode: SimServer, hp: aiohttp.ClientSession,
                       hd: aiohttp.ClientSession) -> None:
        assert prefill.bootstrap_port
        body = chat_body(LONG, max_tokens=6) | {"bootstrap_host": "127.0.0.1",
                                                "bootstrap_port": prefill.bootstrap_port}
        for room, expect_cached in ((11, False), (12, True)):
            # The decode leg first: it waits for its prefill, as with a router that sends both at once.
            d = asyncio.create_task(hd.post("/v1/chat/completions", json=body | {"bootstrap_room": room}))
            p = asyncio.create_task(hp.post("/v1/chat/completions", json=body | {"bootstrap_room": room}))
            pr, dr = await p, await d
            assert pr.status == 200 and dr.status == 200, await dr.text()
            pout, dout = await pr.json(), await dr.json()
            assert pout["usage"]["completion_tokens"] == 1  # a prefill samples one token
            assert dout["usage"]["completion_tokens"] == 6
            assert dout["choices"][0]["message"]["content"] == BUNDLE.decode(CYCLE[:6])
            cached = pout["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (cached > 0) == expect_cached
            assert dout["usage"]["prompt_tokens_details"]["cached_tokens"] == cached  # reported from P
        # The decode did no prefill: its prompt tokens never cost compute, and it keeps no radix cache.
        assert await metric(hd, "sglang:prompt_tokens_total") > 0
        assert [e for e in events(decode) if isinstance(e, SglBlockStored)] == []
        assert [e for e in events(prefill) if isinstance(e, SglBlockStored)]
        async with hp.get("/model_info") as resp:
            assert (await resp.json())["disaggregation_mode"] == "prefill"
        async with aiohttp.ClientSession() as raw, \
                raw.get(f"http://127.0.0.1:{prefill.bootstrap_port}/health") as resp:
            assert await resp.text() == "OK"

    serve(scenario, sgl(role="prefill", bootstrap_port=0, bootstrap_timeout=30),
          sgl(role="decode", waiting_timeout=30, worker_id="d"))


def test_pd_timeouts_and_handshake_failure() -> None:
    async def scenario(prefill: SimServer, decode: SimServer, hp: aiohttp.ClientSession,
                       hd: aiohttp.ClientSession) -> None:
        base = {"prompt": list(range(1, 30)), "max_tokens": 3, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": prefill.bootstrap_port}
        # A prefill whose decode never comes fails after the bootstrap timeout.
        async with hp.post("/v1/completions", json=base | {"bootstrap_room": 1}) as resp:
            assert resp.status == 500 and "Bootstrapping" in (await resp.json())["message"]
        # A decode whose prefill never comes fails after the waiting timeout.
        async with hd.post("/v1/completions", json=base | {"bootstrap_room": 2}) as resp:
            assert resp.status == 500 and "Decode transfer failed" in (await resp.json())["message"]
        # A decode that cannot reach the bootstrap server fails the handshake.
        async with hd.post("/v1/completions", json=base | {"bootstrap_room": 3, "bootstrap_port": 1}) as resp:
            assert resp.status == 500 and "Decode handshake failed" in (await resp.json())["message"]
        # Without a room a PD server refuses outright.
        async with hd.post("/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 400
        assert await metric(hd, "sglang:num_transfer_failed_reqs_total") == 1
        assert await metric(hd, "sglang:num_bootstrap_failed_reqs_total") == 1
        assert await metric(hp, "sglang:num_bootstrap_failed_reqs_total") == 1

    serve(scenario, sgl(role="prefill", bootstrap_port=0, bootstrap_timeout=0.3),
          sgl(role="decode", waiting_timeout=0.3, worker_id="d"))


@pytest.mark.parametrize("room", [4, 7])
def test_pd_prefill_follows_the_room_across_dp_ranks(room: int) -> None:
    async def scenario(prefill: SimServer, decode: SimServer, hp: aiohttp.ClientSession,
                       hd: aiohttp.ClientSession) -> None:
        body = {"prompt": list(range(1, 30)), "max_tokens": 2, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
        d = asyncio.create_task(hd.post("/v1/completions", json=body))
        async with hp.post("/v1/completions", json=body) as resp:
            assert resp.headers["x-sim-dp-rank"] == str(room % 2)
        assert (await d).status == 200
        stored = [e for e in events(prefill, room % 2) if isinstance(e, SglBlockStored)]
        assert stored and not [e for e in events(prefill, 1 - room % 2) if isinstance(e, SglBlockStored)]

    serve(scenario, sgl(role="prefill", bootstrap_port=0, dp_size=2), sgl(role="decode", worker_id="d"))
