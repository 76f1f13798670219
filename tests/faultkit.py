"""Bounded traffic through the gateway while faults happen, and the one checker every fault case shares.

Each request is recorded as an `Outcome`: the worker Cortex assigned (`x-cortex-assigned-worker`, known once
the response headers arrive, i.e. at the start of an SSE stream), whether it completed, the hit Cortex claimed
(`x-cortex-cache-hit-tokens`) and what the engine itself reports (`usage.prompt_tokens_details.cached_tokens`).
`violation` then says what, if anything, the production promise forbids:

(a) a request failed, unless the fault case excuses it (a stream in flight on a worker that was killed, or a
    request in flight on an Envoy that was killed);
(b) a completed response claims more cached tokens than the engine says it had.

Used by tests/test_fault_suite_e2e.py, perf/soak.py and perf/streams_1000.py.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.harness import MODEL, Gateway, long_chat


@dataclass
class Outcome:
    n: int
    stream: bool
    started: float
    ended: float = 0.0
    status: int = 0
    """HTTP status; 0 when no response headers arrived."""
    worker: str | None = None
    mode: str = ""
    reason: str = ""
    claimed: int | None = None
    cached: int | None = None
    completed: bool = False
    """JSON: the body parsed with usage; SSE: the usage chunk and [DONE] arrived."""
    error: str = ""
    connect_retries: int = 0


Excuse = Callable[[Outcome], bool]


def violation(o: Outcome, excused: Excuse = lambda o: False) -> str | None:
    """Why this outcome breaks the promise, or None. Pure: the rule every fault case asserts."""
    if o.completed and o.status == 200:
        # No x-cortex-cache-hit-tokens (served by Envoy's fail-open route while extproc was down) claims nothing.
        if o.cached is None:
            return f"#{o.n}: completed without usage"
        if o.claimed is not None and o.claimed > o.cached:
            return f"#{o.n}: claimed {o.claimed} > engine cached {o.cached} on {o.worker} ({o.mode})"
        return None
    if excused(o):
        return None
    return f"#{o.n}: failed on {o.worker} (status {o.status}, stream={o.stream}): {o.error}"[:400]


def killed_mid_flight(kills: dict[str, list[float]]) -> Excuse:
    """Excuse a request whose assigned worker was killed while it was in flight (worker id -> kill times)."""
    def excuse(o: Outcome) -> bool:
        return o.worker is not None and any(o.started <= t <= o.ended for t in kills.get(o.worker, ()))
    return excuse


def in_flight_during(windows: list[tuple[float, float]]) -> Excuse:
    """Excuse a request that was in flight at some moment within one of the (start, end) windows."""
    def excuse(o: Outcome) -> bool:
        return any(o.started <= end and o.ended >= start for start, end in windows)
    return excuse


def any_of(*excuses: Excuse) -> Excuse:
    return lambda o: any(e(o) for e in excuses)


def check(outcomes: list[Outcome], excused: Excuse = lambda o: False) -> None:
    """Assert (a) and (b) over a run; the message lists the first violations."""
    bad = [v for o in outcomes if (v := violation(o, excused)) is not None]
    assert not bad, f"{len(bad)} of {len(outcomes)} requests broke the promise: {bad[:5]}"


def conversation(seed: int, words: int) -> list[dict[str, str]]:
    return long_chat(words, seed=seed)


def one_request(client: httpx.Client, url: str, n: int, messages: list[dict[str, Any]], stream: bool,
                max_tokens: int = 16, deadline_s: float = 60.0, on_headers: Callable[[Outcome], None] | None = None,
                extra: dict[str, Any] | None = None) -> Outcome:
    """One chat request, recorded. A connection the gateway refused (nothing was sent, e.g. Envoy restarting)
    is retried until the deadline, as any client or load balancer in front of a gateway does."""
    o = Outcome(n=n, stream=stream, started=time.monotonic())
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **(extra or {})}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    give_up = o.started + deadline_s
    while True:
        try:
            if stream:
                _stream(client, url, body, o, on_headers)
            else:
                r = client.post(f"{url}/v1/chat/completions", json=body)
                _headers(o, r)
                if r.status_code == 200:
                    o.cached = int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
                    o.completed = True
                else:
                    o.error = r.text[:200]
            break
        except httpx.ConnectError as exc:
            if time.monotonic() >= give_up:
                o.error = f"ConnectError: {exc}"
                break
            o.connect_retries += 1
            time.sleep(0.1)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            o.error = f"{type(exc).__name__}: {exc}"
            break
    o.ended = time.monotonic()
    return o


def _headers(o: Outcome, r: httpx.Response) -> None:
    o.status = r.status_code
    o.worker = r.headers.get("x-cortex-assigned-worker")
    o.mode = r.headers.get("x-cortex-match-mode", "")
    o.reason = r.headers.get("x-cortex-route-reason", "")
    hit = r.headers.get("x-cortex-cache-hit-tokens")
    o.claimed = int(hit) if hit is not None else None


def _stream(client: httpx.Client, url: str, body: dict[str, Any], o: Outcome,
            on_headers: Callable[[Outcome], None] | None) -> None:
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        _headers(o, r)
        if on_headers is not None:
            on_headers(o)
        if r.status_code != 200:
            o.error = r.read().decode(errors="replace")[:200]
            return
        done = False
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = orjson.loads(line[6:])
                if chunk.get("usage"):
                    o.cached = int(chunk["usage"]["prompt_tokens_details"]["cached_tokens"])
                if "error" in chunk:
                    o.error = str(chunk["error"])[:200]
        o.completed = done and o.cached is not None and not o.error
        if not o.completed and not o.error:
            o.error = "stream ended early"


@dataclass
class Traffic:
    """`threads` clients sending `total` requests (fixed count) over a small pool of shared-prefix chats,
    alternately SSE and JSON, each within `deadline_s`. Multi-turn: a chat grows by a turn now and then."""

    gw_url: str
    total: int = 60
    threads: int = 4
    prompts: int = 6
    words: tuple[int, int] = (200, 700)
    max_tokens: int = 16
    stream_every: int = 2
    """Every n-th request streams (1: all SSE)."""
    max_turns: int = 0
    """A chat that grew by this many turns ends and a new one takes its place (0: chats grow forever). A long
    run needs it: unbounded chats outgrow any KV pool, and the cache thrashes."""
    pause_s: float = 0.0
    deadline_s: float = 60.0
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    in_flight: dict[int, Outcome] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        base = rng.randint(0, 10**6)
        self._rng = rng
        self._chats = [conversation(base + i, rng.randint(*self.words)) for i in range(self.prompts)]
        self._turns = [0] * self.prompts
        self._new_seed = base + self.prompts
        self._lock = threading.Lock()
        self._next = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> Traffic:
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(self.threads)]
        for t in self._threads:
            t.start()
        return self

    def _take(self) -> tuple[int, list[dict[str, Any]]] | None:
        with self._lock:
            if self._next >= self.total or self._stop.is_set():
                return None
            n = self._next
            self._next += 1
            k = n % len(self._chats)
            chat = self._chats[k]
            if n and n % 7 == 0:  # the conversation goes on: the next turn shares the whole earlier prefix
                chat = [*chat, {"role": "assistant", "content": f"noted {n}"},
                        {"role": "user", "content": f"and point {n}?"}]
                self._turns[k] += 1
                if self.max_turns and self._turns[k] > self.max_turns:
                    chat, self._turns[k] = conversation(self._new_seed, self._rng.randint(*self.words)), 0
                    self._new_seed += 1
                self._chats[k] = chat
            return n, chat

    def _run(self, k: int) -> None:
        with httpx.Client(timeout=httpx.Timeout(self.deadline_s, connect=5.0)) as client:
            while (job := self._take()) is not None:
                n, messages = job
                o = one_request(client, self.gw_url, n, messages, stream=n % self.stream_every == 0,
                                max_tokens=self.max_tokens, deadline_s=self.deadline_s,
                                on_headers=lambda o: self._mark(o))
                with self._lock:
                    self.in_flight.pop(n, None)
                    self.outcomes.append(o)
                if self.pause_s:
                    time.sleep(self.pause_s)

    def _mark(self, o: Outcome) -> None:
        with self._lock:
            self.in_flight[o.n] = o

    def streaming_on(self, worker: str) -> bool:
        """A stream assigned to `worker` has started and not finished."""
        with self._lock:
            return any(o.worker == worker and o.stream for o in self.in_flight.values())

    def stop(self) -> None:
        self._stop.set()

    def drain(self) -> list[Outcome]:
        """Take the outcomes recorded so far (a long run keeps counters, not every outcome)."""
        with self._lock:
            out, self.outcomes = self.outcomes, []
            return out

    def done_count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def wait_done(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.done_count() < min(n, self.total) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.done_count() >= min(n, self.total), f"only {self.done_count()} of {n} requests done"

    def join(self, timeout: float = 120.0) -> list[Outcome]:
        """Wait for the fixed count; past the timeout the rest is stopped and the test fails on it."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        alive = [t for t in self._threads if t.is_alive()]
        assert not alive, f"{len(alive)} client threads still running after {timeout:.0f}s"
        return sorted(self.outcomes, key=lambda o: o.n)


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def gateway_rss(gw: Gateway) -> dict[str, int]:
    """RSS in KiB of each Cortex process (envoy, ingest, extproc-N), by name."""
    out: dict[str, int] = {}
    for needle, name in (("envoy", "envoy"), ("cortexctl.cli ingest", "ingest")):
        for pid in gw.child_pids(needle):
            out[name] = out.get(name, 0) + rss_kib(pid)
    for pid in gw.child_pids("cortexctl.cli extproc"):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        idx = cmd[cmd.index(b"--index") + 1].decode() if b"--index" in cmd else "?"
        out[f"extproc-{idx}"] = rss_kib(pid)
    return out
