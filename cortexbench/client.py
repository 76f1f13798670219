"""The benchmark's client: sends a workload's sessions to a contestant and records what each request saw.

Every request streams (`stream_options.include_usage`), so time to first token is the arrival of the first
content chunk, the inter-token latency the mean gap between the content chunks after it, and the prompt and
cached token counts are the worker's own `usage` figures. The worker that
served it is read from the simulator's `x-sim-worker` header, which every contestant passes through. While
the run lasts, each worker's running + waiting count is sampled from its own metrics endpoint.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from cortexbench.launch import MODEL, Worker
from cortexbench.workloads import LazyTurns, Session, Workload


@dataclass(slots=True)
class Record:
    session: int
    turn: int
    sent: float
    """Seconds after the run's start."""
    ttft: float | None = None
    e2e: float | None = None
    itl: float | None = None
    """Inter-token latency: the mean gap between the content chunks after the first (last chunk's arrival minus
    the first's, over the chunks minus one), in seconds; None with fewer than two chunks."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker: str | None = None
    status: int = 0
    error: str | None = None
    bypass: bool = False
    """Sent straight to a worker, past the gateway (the --bypass share of sessions)."""
    lag: float | None = None
    """Open loop, a session's first request: how late it was sent, in seconds after its arrival time (a client
    that cannot keep the workload's rate shows here, not as a slower contestant); None otherwise."""


@dataclass(slots=True)
class RunResult:
    records: list[Record]
    wall_s: float
    load_samples: list[dict[str, float]] = field(default_factory=list)
    """Per sample, running + waiting per worker id."""


async def one(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int,
              rec: Record, t0: float) -> str:
    """Send one streaming chat; fill `rec`; return the answer text (empty on failure)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.monotonic()
    rec.sent = start - t0
    parts: list[str] = []
    first = last = 0.0
    try:
        async with http.post(f"{url}/v1/chat/completions", data=orjson.dumps(body),
                             headers={"content-type": "application/json"}) as resp:
            rec.status = resp.status
            rec.worker = resp.headers.get("x-sim-worker")
            if resp.status != 200:
                rec.error = f"http {resp.status}: {(await resp.text())[:200]}"
                return ""
            async for raw in resp.content:
                if not raw.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(raw[6:])
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        last = time.monotonic()
                        if rec.ttft is None:
                            first = last
                            rec.ttft = last - start
                        parts.append(content)
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        rec.e2e = time.monotonic() - start
        if len(parts) > 1:
            rec.itl = (last - first) / (len(parts) - 1)
        if rec.ttft is None:
            rec.error = "stream ended without a token"
        elif not rec.prompt_tokens:
            rec.error = "no usage in the stream"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class Routing:
    """How the client reaches the contestant: which URL each request goes to."""

    targets: list[str]
    """One URL: a gateway. Several: gateway replicas (or, for round-robin, the workers themselves)."""
    sticky: bool = False
    """Several targets: keep each session on one (a balancer with session affinity); default: every request
    goes to the next target, as an L4 balancer spreading connections would."""
    bypass: float = 0.0
    """This share of sessions goes straight to a worker, as batch jobs or another gateway would."""
    seed: int = 0

    def picker(self, workers: list[Worker]) -> Callable[[Session], tuple[Callable[[], str], bool]]:
        """A function giving, per session, how to pick each request's URL and whether it bypasses."""
        cycle = itertools.cycle(self.targets)
        rng = random.Random(self.seed)
        # Bypass draws come from their own stream, so the same seed bypasses the same sessions for every
        # contestant, whatever the number of replicas.
        urls = [w.url for w in workers]

        def per_session(s: Session) -> tuple[Callable[[], str], bool]:
            if self.bypass > 0 and rng.random() < self.bypass:
                url = rng.choice(urls)
                return (lambda: url), True
            if len(self.targets) == 1:
                only = self.targets[0]
                return (lambda: only), False
            if self.sticky:
                key = s.affinity if s.affinity is not None else str(s.id)
                home = self.targets[zlib.crc32(key.encode()) % len(self.targets)]
                return (lambda: home), False
            return (lambda: next(cycle)), False

        return per_session


async def _session(http: aiohttp.ClientSession, pick: Callable[[], str], s: Session, out: list[Record],
                   t0: float, bypass: bool = False, open_loop: bool = False) -> None:
    history: list[dict[str, str]] = []
    for turn in range(len(s.turns)):
        rec = Record(s.id, turn, 0.0, bypass=bypass)
        out.append(rec)
        content = s.turns[turn]  # built once (a trace's prompt is joined here, from block texts built before)
        answer = await one(http, pick(), s.messages(history, turn, content), s.max_tokens, rec, t0)
        if open_loop and turn == 0:
            rec.lag = max(rec.sent - s.start, 0.0)
        if rec.error is not None:
            return  # a conversation whose turn failed has no history to continue from
        if turn + 1 < len(s.turns):
            history += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]


def _load_of(text: str, engine: str) -> float:
    names = (("vllm:num_requests_running", "vllm:num_requests_waiting") if engine == "vllm"
             else ("sglang:num_running_reqs", "sglang:num_queue_reqs"))
    total = 0.0
    for line in text.splitlines():
        if line.startswith(names):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _sample_loads(http: aiohttp.ClientSession, workers: list[Worker], out: list[dict[str, float]],
                        interval: float) -> None:
    async def load(w: Worker) -> float:
        async with http.get(f"{w.url}/metrics") as resp:
            return _load_of(await resp.text(), w.engine)

    while True:
        try:
            values = await asyncio.gather(*(load(w) for w in workers))
            out.append(dict(zip((w.id for w in workers), values, strict=True)))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass  # a missed sample is not a finding
        await asyncio.sleep(interval)


async def _at(t0: float, when: float, action: Callable[[], object]) -> None:
    await asyncio.sleep(max(when - (time.monotonic() - t0), 0.0))
    await asyncio.to_thread(action)


def prepare(workload: Workload) -> None:
    """Before the clock starts: what the sessions' lazily built prompts can share is built now (a trace's block
    texts), so the client's event loop, which also times every stream, only joins them while the run lasts."""
    for s in workload.sessions:
        if isinstance(s.turns, LazyTurns):
            s.turns.prepare()


async def run(workload: Workload, routing: Routing | list[str], workers: list[Worker], *,
              concurrency: int | None = None, max_seconds: float = 120.0, grace_s: float = 60.0,
              sample_interval: float = 0.25,
              schedule: Sequence[tuple[float, Callable[[], object]]] = ()) -> RunResult:
    """Send every session as `routing` says (a list of URLs: one gateway, or several the client round-robins).

    Open loop (default): each session starts at its arrival time. Closed loop (`concurrency`): that many
    sessions at a time, the next starting as one ends. No new session starts after `max_seconds`; what is
    still running `grace_s` later is cancelled and counted as an error. `schedule`: (seconds after the start,
    action) pairs run in a thread at those times while traffic flows (a worker restarting mid-run)."""
    if isinstance(routing, list):
        routing = Routing(routing)
    prepare(workload)
    records: list[Record] = []
    samples: list[dict[str, float]] = []
    per_session = routing.picker(workers)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=max_seconds + grace_s)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        sampler = asyncio.create_task(_sample_loads(http, workers, samples, sample_interval))
        t0 = time.monotonic()
        actions = [asyncio.create_task(_at(t0, when, action)) for when, action in schedule]
        tasks: list[asyncio.Task[None]] = []
        if concurrency:
            queue = list(workload.sessions)

            async def slot() -> None:
                while queue and time.monotonic() - t0 < max_seconds:
                    s = queue.pop(0)
                    pick, bypass = per_session(s)
                    await _session(http, pick, s, records, t0, bypass)

            tasks = [asyncio.create_task(slot()) for _ in range(concurrency)]
        else:
            for s in workload.sessions:
                delay = s.start - (time.monotonic() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.monotonic() - t0 > max_seconds:
                    break
                pick, bypass = per_session(s)
                tasks.append(asyncio.create_task(_session(http, pick, s, records, t0, bypass, open_loop=True)))
        remaining = max(max_seconds - (time.monotonic() - t0), 0.0) + grace_s
        _, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.monotonic() - t0
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        # A disruption still pending (scheduled after the last session) is not waited for; one that ran and
        # failed is the run's failure, not a silent no-op.
        for task in actions:
            if not task.done():
                task.cancel()
        for result in await asyncio.gather(*actions, return_exceptions=True):
            if isinstance(result, Exception):
                raise result
    for rec in records:
        if rec.e2e is None and rec.error is None:
            rec.error = "cancelled at the time bound"
    return RunResult(records, wall, samples)


async def light_probe(target: str, workers: list[Worker], n: int, words: int) -> list[tuple[float, float]]:
    """Gateway overhead at light load: n pairs, one request at a time. Each pair sends a fresh prompt through
    `target`, then a different prompt of the same length straight to the worker that served the first; both
    are cold (no cached prefix), so the difference in time to first token is what the path through the
    gateway adds. Returns (ttft via target, ttft direct) per pair."""
    from random import Random

    from cortexbench.workloads import text

    rng = Random(12345)
    by_id = {w.id: w.url for w in workers}
    out: list[tuple[float, float]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for i in range(n):
            via, direct = Record(-1, i, 0.0), Record(-1, i, 0.0)
            msgs = [{"role": "user", "content": f"Probe {i} A. {text(rng, words)}"}]
            await one(http, target, msgs, 2, via, time.monotonic())
            if via.error is not None or via.worker not in by_id or via.ttft is None:
                continue
            msgs = [{"role": "user", "content": f"Probe {i} B. {text(rng, words)}"}]
            await one(http, by_id[via.worker], msgs, 2, direct, time.monotonic())
            if direct.ttft is not None and direct.error is None:
                out.append((via.ttft, direct.ttft))
    return out
