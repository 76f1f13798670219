"""Fault injection: the publisher faults over real ZMQ sockets, the HTTP faults and the /sim/faults contract."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import zmq

from cortex.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SglBlockStored,
    decode_batch,
    decode_sglang_batch,
)
from cortexsim.faults import FaultError, Faults
from cortexsim.kv_events import ZmqEventPublisher
from cortexsim.server import SimServer
from tests.sim.simkit import chat_body, config, first_token, metric, replay, serve, until


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def batch(n: int) -> KVEventBatch:
    return KVEventBatch(ts=float(n), events=[BlockRemoved(block_hashes=[n], medium="GPU", group_idx=0)])


def removal(payload: bytes) -> BlockRemoved:
    """The one event of a batch made by `batch`."""
    event = decode_batch(payload).events[0]
    assert isinstance(event, BlockRemoved)
    return event


def marker(frames: list[bytes]) -> int:
    """The batch's id (the hash it carries) and, separately, its seq."""
    return int(removal(frames[2]).block_hashes[0])


def seq(frames: list[bytes]) -> int:
    return int.from_bytes(frames[1], "big")


class Live:
    """A subscribed SUB socket past the slow-joiner window."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], pub: ZmqEventPublisher) -> None:
        assert pub.endpoint is not None
        self.pub = pub
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub.endpoint)
        self.join(10_000)

    def join(self, marker_base: int) -> None:
        """Publish warm-up batches until one arrives, then drain (bounded)."""
        for i in range(400):
            self.pub.publish(batch(marker_base + i))
            if self.sub.poll(50):
                break
        else:
            raise AssertionError("subscriber never joined")
        assert self.pub.flush(5)
        while self.sub.poll(200):
            self.sub.recv_multipart()

    def take(self, n: int) -> list[list[bytes]]:
        out: list[list[bytes]] = []
        for _ in range(n):
            assert self.sub.poll(5000), f"expected {n} messages, got {len(out)}"
            out.append(self.sub.recv_multipart())
        return out

    def quiet(self) -> bool:
        return not self.sub.poll(300)


def test_drop_consumes_the_seq_and_stays_replayable(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    faults = Faults()
    pub = ZmqEventPublisher(0, replay_port=0, faults=faults)
    try:
        live = Live(ctx, pub)
        faults.update({"drop_events": 1.0})
        pub.publish(batch(1))
        assert pub.flush(5) and live.quiet()
        faults.update({"drop_events": 0.0})
        pub.publish(batch(2))
        (got,) = live.take(1)
        assert marker(got) == 2
        dropped_seq = seq(got) - 1  # the consumer sees a gap of one
        assert pub.replay_endpoint is not None
        (replayed, _) = replay(pub.replay_endpoint, dropped_seq)
        assert replayed[0] == dropped_seq
        assert removal(replayed[1]).block_hashes == [1]
    finally:
        pub.close()


def test_duplicate_sends_one_seq_twice(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    faults = Faults()
    pub = ZmqEventPublisher(0, faults=faults)
    try:
        live = Live(ctx, pub)
        faults.update({"duplicate_events": 1.0})
        pub.publish(batch(1))
        a, b = live.take(2)
        assert a == b and marker(a) == 1
        assert live.quiet()
    finally:
        pub.close()


def test_reorder_holds_a_batch_until_after_the_next(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    faults = Faults()
    pub = ZmqEventPublisher(0, faults=faults)
    try:
        live = Live(ctx, pub)
        faults.update({"reorder_events": 1.0})
        for n in (1, 2, 3, 4):
            pub.publish(batch(n))
        got = live.take(4)
        assert [marker(f) for f in got] == [2, 1, 4, 3]
        assert seq(got[0]) == seq(got[1]) + 1
    finally:
        pub.close()


def test_seq_gap_skips_numbers_once(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    faults = Faults()
    pub = ZmqEventPublisher(0, replay_port=0, faults=faults)
    try:
        live = Live(ctx, pub)
        pub.publish(batch(1))
        (before,) = live.take(1)
        state, _ = faults.update({"seq_gap": 5})
        assert state["seq_gap"] == 5
        pub.publish(batch(2))
        pub.publish(batch(3))
        after = live.take(2)
        assert [seq(f) for f in after] == [seq(before) + 6, seq(before) + 7]
        assert faults.snapshot()["seq_gap"] == 0
        assert pub.replay_endpoint is not None
        seqs = [s for s, _ in replay(pub.replay_endpoint, seq(before))]
        assert seqs == [seq(before), seq(before) + 6, seq(before) + 7]
    finally:
        pub.close()


def test_restart_rebinds_with_seq_zero_and_empty_buffer(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = ZmqEventPublisher(0, replay_port=0)
    try:
        live = Live(ctx, pub)
        endpoint, replay_endpoint = pub.endpoint, pub.replay_endpoint
        pub.restart()
        assert pub.flush(10)
        assert (pub.endpoint, pub.replay_endpoint) == (endpoint, replay_endpoint) and pub.restarts == 1
        live.join(20_000)  # the SUB reconnects by itself
        assert replay_endpoint is not None
        seqs = [s for s, _ in replay(replay_endpoint, 0)]
        assert seqs[0] == 0 and seqs == list(range(len(seqs)))
        assert all(int(removal(p).block_hashes[0]) >= 20_000 for _, p in replay(replay_endpoint, 0))
    finally:
        pub.close()


def test_fault_validation() -> None:
    faults = Faults()
    for bad in ({"nope": 1}, {"drop_events": 2}, {"drop_events": True}, {"seq_gap": -1},
                {"crash_mid_stream": 1}, {"slow_health_ms": -5}):
        with pytest.raises(FaultError):
            faults.update(bad)
    assert faults.snapshot()["drop_events"] == 0.0


# --- over HTTP ------------------------------------------------------------------------------------


async def post_faults(http: aiohttp.ClientSession, **update: Any) -> dict[str, Any]:
    async with http.post("/sim/faults", json=update) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


def test_fault_endpoint_contract() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        async with http.get("/sim/faults") as resp:
            state = await resp.json()
        assert state == {"drop_events": 0.0, "duplicate_events": 0.0, "reorder_events": 0.0, "seq_gap": 0,
                         "restart_publisher": False, "stall_stream_ms": 0.0, "crash_mid_stream": False,
                         "http_5xx_rate": 0.0, "overload_503": False, "reset_requests": False,
                         "slow_health_ms": 0.0,
                         "slow_first_token_ms": 0.0, "load_endpoint_down": False, "pd_stall_bootstrap": False,
                         "pd_transfer_fail": False}
        state = await post_faults(http, drop_events=0.25, stall_stream_ms=10)
        assert state["drop_events"] == 0.25 and state["stall_stream_ms"] == 10.0
        async with http.post("/sim/faults", json={"drop_events": 3}) as resp:
            assert resp.status == 400
            assert "probability" in (await resp.json())["error"]["message"]
        async with http.get("/sim/faults") as resp:
            assert (await resp.json())["drop_events"] == 0.25  # a rejected update changes nothing

    serve(scenario)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_http_error_faults(engine: str) -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        await post_faults(http, http_5xx_rate=1.0)
        async with http.post("/v1/chat/completions", json=chat_body("hi", max_tokens=2)) as resp:
            assert resp.status == 500
        await post_faults(http, http_5xx_rate=0.0, overload_503=True)
        async with http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 503
            body = await resp.json()
        message = body["error"]["message"] if engine == "vllm" else body["message"]
        assert "queue is full" in message or "waiting queue" in message
        await post_faults(http, overload_503=False, reset_requests=True)
        with pytest.raises(aiohttp.ClientError):
            async with http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
                await resp.read()
        async with http.get("/health") as resp:
            assert resp.status == 200  # the probe still passes
        await post_faults(http, reset_requests=False)
        async with http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 200

    serve(scenario, config(engine=engine))


def test_stall_holds_the_stream_after_its_first_token() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        await post_faults(http, stall_stream_ms=3000)
        body = {"prompt": list(range(100, 120)), "max_tokens": 5, "stream": True}
        async with http.post("/v1/completions", json=body) as resp:
            await first_token(resp)
            received = resp.content.total_bytes

            async def engine_done() -> bool:
                return await metric(http, "vllm:generation_tokens_total") == 5

            await until(engine_done, "the engine to finish while the stream stalls")
            # The engine has produced all five tokens, yet nothing after the first reached the client.
            assert resp.content.total_bytes == received
            rest = [line async for line in resp.content if line.startswith(b"data: {")]
        assert len(rest) == 4  # the other four tokens arrive after the stall

    serve(scenario)


def test_crash_cuts_the_stream_and_frees_the_request() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        await post_faults(http, crash_mid_stream=True)
        body = {"prompt": list(range(100, 120)), "max_tokens": 50, "stream": True}
        async with http.post("/v1/completions", json=body) as resp:
            await first_token(resp)
            with pytest.raises(aiohttp.ClientPayloadError):
                async for _ in resp.content:
                    pass

        async def released() -> bool:
            return await metric(http, "vllm:num_requests_running") == 0

        await until(released, "the cut request to be released")
        assert await metric(http, "vllm:generation_tokens_total") < 50

    serve(scenario)


def test_load_endpoint_down() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        await post_faults(http, load_endpoint_down=True)
        async with http.get("/metrics") as resp:
            assert resp.status == 503
        await post_faults(http, load_endpoint_down=False)
        async with http.get("/metrics") as resp:
            assert resp.status == 200 and "vllm:num_requests_running" in await resp.text()

    serve(scenario)


def test_slow_health() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        await post_faults(http, slow_health_ms=60_000)
        with pytest.raises(asyncio.TimeoutError):
            async with http.get("/health", timeout=aiohttp.ClientTimeout(total=0.3)):
                pass
        await post_faults(http, slow_health_ms=0)
        async with http.get("/health") as resp:
            assert resp.status == 200

    serve(scenario)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_slow_first_token_holds_the_request_before_the_engine(engine: str) -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        await post_faults(http, slow_first_token_ms=60_000)
        body = {"prompt": "hello there", "max_tokens": 2, "stream": True}
        with pytest.raises(asyncio.TimeoutError):
            async with http.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.3)) as resp:
                await first_token(resp)
        assert all(not e.running and not e.waiting for e in srv.engines)  # the engine never saw it
        await post_faults(http, slow_first_token_ms=0)
        async with http.post("/v1/completions", json=body) as resp:
            assert resp.status == 200
            await first_token(resp)

    serve(scenario, config(engine=engine))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_restart_publisher_starts_cold(engine: str) -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        body = {"prompt": list(range(1000, 1040)), "max_tokens": 1}
        async with http.post("/v1/completions", json=body) as resp:
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        async with http.post("/v1/completions", json=body) as resp:
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        state = await post_faults(http, restart_publisher=True)
        assert state["restart_publisher"] is False
        assert srv.kv_replay_endpoint is not None
        after = replay(srv.kv_replay_endpoint)
        if engine == "vllm":
            assert after == []  # vLLM publishes nothing at startup
        else:
            (only,) = after
            assert only[0] == 0 and [type(e).__name__ for e in decode_sglang_batch(only[1]).events] == [
                "SglAllBlocksCleared"]
        async with http.post("/v1/completions", json=body) as resp:
            assert (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # cold cache
        assert srv.publisher.flush(10)
        seqs = [s for s, _ in replay(srv.kv_replay_endpoint)]
        assert seqs == list(range(len(seqs))) and seqs
        payloads = [p for _, p in replay(srv.kv_replay_endpoint)]
        stored = [e for p in payloads for e in (decode_batch(p).events if engine == "vllm"
                                                 else decode_sglang_batch(p).events)
                  if isinstance(e, BlockStored | SglBlockStored)]
        assert stored and stored[0].parent_block_hash is None

    serve(scenario, config(engine=engine, block_size=16))
