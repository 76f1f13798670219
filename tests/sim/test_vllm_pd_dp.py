"""The simulated vLLM server's data-parallel ranks, NIXL-style PD, LoRA and chunked prefill."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from cortex.engine_hashes import LoraRef, VllmBlockHasher, vllm_wire_hash
from cortex.kv_events import BlockStored, decode_batch
from cortexsim.server import SimServer
from tests.sim.simkit import LONG, MODEL, chat_body, config, metric, replay, serve


def stores(srv: SimServer, rank: int = 0) -> list[BlockStored]:
    pub = srv.publishers[rank]
    assert pub.flush(10) and pub.replay_endpoint is not None
    out: list[BlockStored] = []
    for _, payload in replay(pub.replay_endpoint):
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == rank
        out += [e for e in batch.events if isinstance(e, BlockStored)]
    return out


def wires(tokens: list[int], **kw: Any) -> list[int]:
    return [vllm_wire_hash(h) for h in VllmBlockHasher().block_hashes(tokens, 16, **kw)]


def test_dp_ranks_have_their_own_cache_ports_and_metrics() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        endpoints = [p.endpoint for p in srv.publishers]
        assert len(set(endpoints)) == 2
        body = {"prompt": list(range(100, 140)), "max_tokens": 1}
        async with http.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "1"}) as resp:
            assert resp.headers["x-sim-dp-rank"] == "1"
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        async with http.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "0"}) as resp:
            # Rank 0 has its own, still cold cache.
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        async with http.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "1"}) as resp:
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        ranks = []
        for _ in range(4):
            async with http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}) as resp:
                ranks.append(resp.headers["x-sim-dp-rank"])
        assert sorted(ranks) == ["0", "0", "1", "1"]  # round robin without a header
        async with http.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "2"}) as resp:
            assert resp.status == 400
        assert [s.block_hashes for s in stores(srv, 1)][:1] == [wires(list(range(100, 140)))]
        assert await metric(http, "vllm:prefix_cache_hits_total", engine="1") == 32
        assert await metric(http, "vllm:prefix_cache_hits_total", engine="0") == 0

    serve(scenario, config(dp_size=2))


def test_pd_producer_hands_blocks_to_a_consumer() -> None:
    async def scenario(p: SimServer, d: SimServer, hp: aiohttp.ClientSession, hd: aiohttp.ClientSession) -> None:
        body = chat_body(LONG, max_tokens=5)
        for expect_hit in (False, True):
            prefill_body = body | {"max_tokens": 1, "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}}
            async with hp.post("/v1/chat/completions", json=prefill_body) as resp:
                pout = await resp.json()
            params = pout["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["remote_port"] == p.port
            assert params["remote_num_tokens"] == pout["usage"]["prompt_tokens"]
            p_cached = pout["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert params["remote_prefill_cached_tokens"] == p_cached and (p_cached > 0) == expect_hit
            # The prefill still pins its blocks for the decoder.
            assert await metric(hp, "vllm:kv_cache_usage_perc") > 0
            async with hd.post("/v1/chat/completions", json=body | {"kv_transfer_params": params}) as resp:
                dout = await resp.json()
            assert dout["usage"]["completion_tokens"] == 5
            assert dout["usage"]["prompt_tokens_details"]["cached_tokens"] == p_cached  # P's hit, as vLLM
            assert await metric(hp, "vllm:kv_cache_usage_perc") == 0  # read: released
        # The decoder computed one prompt token per request, not the whole prompt ...
        prompt_len = pout["usage"]["prompt_tokens"]
        assert await metric(hd, "vllm:prompt_tokens_total") == 2 * prompt_len
        # ... and caches the transferred blocks like its own.
        assert stores(d)[0].block_hashes[: prompt_len // 16] == stores(p)[0].block_hashes[: prompt_len // 16]
        # The same params a second time: the blocks were already read, so the pull fails; recompute policy.
        async with hd.post("/v1/chat/completions", json=body | {"kv_transfer_params": params}) as resp:
            again = await resp.json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # a local hit by now, no P report

    serve(scenario, config(role="prefill"), config(role="decode", worker_id="d"))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_pd_invalid_and_expired_params(policy: str) -> None:
    async def scenario(p: SimServer, d: SimServer, hp: aiohttp.ClientSession, hd: aiohttp.ClientSession) -> None:
        body = {"prompt": list(range(200, 260)), "max_tokens": 2}
        async with hp.post("/v1/completions", json=body | {"kv_transfer_params": {"do_remote_decode": True}}) as r:
            params = (await r.json())["kv_transfer_params"]

        async def expired() -> bool:
            return await metric(hp, "vllm:nixl_num_kv_expired_reqs_total") == 1

        for _ in range(500):
            if await expired():
                break
            await asyncio.sleep(0.01)
        assert await expired()
        # Incomplete coordinates are ignored whatever the policy: a full local prefill.
        partial = {"do_remote_prefill": True, "remote_block_ids": [[1]]}
        async with hd.post("/v1/completions", json=body | {"kv_transfer_params": partial}) as resp:
            assert resp.status == 200
        assert await metric(hd, "vllm:prompt_tokens_total") == 60
        async with hd.post("/v1/completions", json=body | {"prompt": list(range(300, 360)),
                                                           "kv_transfer_params": params}) as resp:
            if policy == "fail":
                assert resp.status == 500
            else:
                assert resp.status == 200
                assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    serve(scenario, config(role="prefill", kv_lease_seconds=0.05),
          config(role="decode", worker_id="d", kv_load_failure_policy=policy))


def test_lora_adapters_are_served_and_hashed() -> None:
    lora = LoraRef("sql-lora", "/adapters/sql", int_id=1)

    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        async with http.get("/v1/models") as resp:
            cards = (await resp.json())["data"]
        assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
            (MODEL, MODEL, None), ("sql-lora", "/adapters/sql", MODEL)]
        prompt = list(range(1, 41))
        async with http.post("/v1/completions", json={"model": "sql-lora", "prompt": prompt, "max_tokens": 1}):
            pass
        async with http.post("/v1/completions", json={"model": "nope", "prompt": prompt}) as resp:
            assert resp.status == 404
        (stored,) = stores(srv)
        assert stored.block_hashes == wires(prompt, lora=lora)
        assert (stored.lora_name, stored.lora_id) == ("sql-lora", 1)
        assert stored.extra_keys == [("sql-lora",), ("sql-lora",)]

    serve(scenario, config(lora_modules=(lora,)))


def test_long_prefill_is_chunked_and_published_per_chunk() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        prompt = list(range(1000, 1100))  # 100 tokens, budget 32 per step: 4 steps of prefill
        async with http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as resp:
            assert resp.status == 200
        got = stores(srv)
        assert [len(s.block_hashes) for s in got] == [2, 2, 2]  # blocks stored as each chunk completes
        assert [h for s in got for h in s.block_hashes] == wires(prompt)
        assert got[1].parent_block_hash == got[0].block_hashes[-1]

    serve(scenario, config(max_num_batched_tokens=32))
