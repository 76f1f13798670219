"""Synthetic engine load without HTTP: a worker submits requests to its own engines at a steady rate.

What a fleet-scale benchmark needs (perf/fleet_scale.py): hundreds of workers each producing KV events at a
known rate, which a load generator sending chats would pay for in tokenization and HTTP on the same 2-core
machine as the gateway it measures. The requests are ordinary ``SimRequest``s (prefill, one output token, cache
stores and evictions, one event batch per step that changed the cache), so the events are exactly what a real
request would publish; only the prompt is made up: a shared prefix (``fleet_prefix``) followed by random tokens.

``POST /sim/drive`` with ``{"rate": <requests/s>, "prompt_tokens": n, "prefix_tokens": m, "seed": s}`` starts
(or replaces) the drive; ``rate`` 0 stops it; ``"once": true`` submits a single request instead (to warm every
worker with the same prefix). The answer (and ``GET /sim/drive``) says how many requests the drive has submitted
so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from dataclasses import dataclass

from cortexsim.engine import EngineCore, EngineDeadError, SimRequest

MAX_RATE = 1000.0
MAX_PROMPT_TOKENS = 32768


def fleet_prefix(n: int) -> list[int]:
    """The shared prefix every driven worker puts first: deterministic, so a benchmark can key it as a prompt."""
    return [100 + (i * 7919) % 30000 for i in range(n)]


@dataclass(frozen=True, slots=True)
class DrivePlan:
    rate: float = 0.0
    prompt_tokens: int = 256
    prefix_tokens: int = 0
    seed: int = 0

    @classmethod
    def parse(cls, body: dict[str, object]) -> DrivePlan:
        def num(name: str, default: float) -> float:
            value = body.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number")
            return float(value)

        plan = cls(rate=num("rate", 0.0), prompt_tokens=int(num("prompt_tokens", 256)),
                   prefix_tokens=int(num("prefix_tokens", 0)), seed=int(num("seed", 0)))
        if not 0 <= plan.rate <= MAX_RATE:
            raise ValueError(f"rate must be within 0..{MAX_RATE:g} requests/s")
        if not 1 <= plan.prompt_tokens <= MAX_PROMPT_TOKENS:
            raise ValueError(f"prompt_tokens must be within 1..{MAX_PROMPT_TOKENS}")
        if not 0 <= plan.prefix_tokens <= plan.prompt_tokens:
            raise ValueError("prefix_tokens must be within 0..prompt_tokens")
        return plan


class Driver:
    """At most one drive per worker; it round-robins over the worker's DP ranks."""

    def __init__(self, engines: list[EngineCore], name: str) -> None:
        self._engines = engines
        self._name = name
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self.submitted = 0

    def submit_one(self, plan: DrivePlan, rng: random.Random) -> None:
        prompt = fleet_prefix(plan.prefix_tokens) + [rng.randrange(100, 30100)
                                                     for _ in range(plan.prompt_tokens - plan.prefix_tokens)]
        n = next(self._ids)
        engine = self._engines[n % len(self._engines)]
        if engine.dead is not None or len(engine.waiting) > 64:
            return  # an engine that cannot keep up is not queued without bound
        req = SimRequest(f"drive-{self._name}-{n}", prompt, 1,
                         block_hashes=engine.cache.prompt_hashes(prompt))
        with contextlib.suppress(EngineDeadError):
            engine.submit(req)
            self.submitted += 1

    def start(self, plan: DrivePlan) -> None:
        self.stop()
        if plan.rate > 0:
            self._task = asyncio.create_task(self._run(plan), name=f"sim-drive-{self._name}")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self, plan: DrivePlan) -> None:
        rng = random.Random(f"{plan.seed}-{self._name}")
        loop = asyncio.get_running_loop()
        interval = 1.0 / plan.rate
        # A random phase, so a fleet's workers do not all submit in the same tick.
        due = loop.time() + rng.random() * interval
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            self.submit_one(plan, rng)
            # Fixed schedule, not sleep-after-work: the rate holds while the host is busy (missed ticks are
            # skipped rather than bursted).
            due = max(due + interval, loop.time())
