"""`cortex capacity --probe URL`: a bounded load test of one worker that finds its knee (knee.py).

Closed loop, one step per concurrency level (1, 2, 4, ... up to --max-concurrency, or --steps): `c` slots each
send a streaming chat completion and, once it ends, the next, until the step has sent its requests (default
max(8, 4 x c)). Each request streams (`stream_options.include_usage`); its TTFT is the arrival of the first
content chunk, its output tokens the worker's own usage figure. The first wave of each step (`c` requests that
start together, a burst no steady state has) is left out of the TTFT percentiles. Throughput is the step's
output tokens over its wall time.

Prompts are unique (prefix caching would otherwise make later steps look cheap, seed 004 §4.4): text of common
English words that are one token each in Qwen2.5's real tokenizer (cortexbench.workloads), log-normal
lengths around --prompt-tokens, or the user's own prompts from a JSONL file.

Bounded: the sweep stops at the first step past the knee, when --duration-s has passed (in-flight requests are
then cancelled, which closes their connections and makes the engine abort them), or after --max-requests.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from cortexbench.capacity.knee import KNEE_FRACTION, Knee, KneeRule, Step, find_knee
from cortexbench.capacity.kv_size import CapacityError
from cortexbench.workloads import text as word_text

SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    url: str
    model: str | None = None
    max_concurrency: int = 64
    steps: tuple[int, ...] | None = None
    duration_s: float = 120.0
    max_requests: int = 2000
    requests_per_step: int | None = None
    """None: max(8, 4 x concurrency)."""
    prompt_tokens: int = 1000
    max_tokens: int = 64
    prompts_file: str | None = None
    request_timeout_s: float = 60.0
    seed: int = 0
    api_key: str | None = None
    rule: KneeRule = field(default_factory=KneeRule)
    knee_fraction: float = KNEE_FRACTION


@dataclass(slots=True)
class Sample:
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str | None = None
    cut: bool = False
    """Cancelled by the probe's own deadline: neither a success nor the worker's failure."""


@dataclass(frozen=True, slots=True)
class StepResult:
    step: Step
    sent: int
    cut: int
    wall_s: float
    e2e_p50_s: float | None
    first_error: str | None


@dataclass(frozen=True, slots=True)
class ProbeResult:
    url: str
    model: str
    steps: tuple[StepResult, ...]
    knee: Knee
    requests_sent: int
    duration_s: float
    stopped: str
    prompts: str
    knee_fraction: float = KNEE_FRACTION
    notes: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {
            "url": self.url, "model": self.model, "prompts": self.prompts,
            "steps": [{"concurrency": r.step.concurrency, "requests": r.sent, "completed": r.step.completed,
                       "errors": r.step.errors, "cut_by_deadline": r.cut,
                       "ttft_p50_s": _round(r.step.ttft_p50_s), "ttft_p90_s": _round(r.step.ttft_p90_s),
                       "e2e_p50_s": _round(r.e2e_p50_s), "output_tokens_per_s": round(r.step.output_tokens_per_s, 1),
                       "wall_s": round(r.wall_s, 3), "first_error": r.first_error} for r in self.steps],
            "knee_concurrency": self.knee.concurrency, "knee_found": self.knee.found, "reason": self.knee.reason,
            "knee_fraction": self.knee_fraction,
            "recommended_max_concurrent": self.knee.recommended_max_concurrent,
            "requests_sent": self.requests_sent, "duration_s": round(self.duration_s, 2), "stopped": self.stopped,
            "notes": list(self.notes),
        }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def ladder(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... below max_concurrency, then max_concurrency itself."""
    out, c = [], 1
    while c < max_concurrency:
        out.append(c)
        c *= 2
    out.append(max_concurrency)
    return out


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 1])."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def base_url(url: str) -> str:
    """The worker's root: accepts http://host:port, with or without a trailing /v1."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise CapacityError(f"--probe: expected an http:// or https:// URL, got {url!r}")
    return url.removesuffix("/v1")


class Prompts:
    """The chats the probe sends, in order: synthetic unique ones, or a JSONL file's, cycled."""

    def __init__(self, settings: ProbeSettings) -> None:
        self._rng = random.Random(settings.seed)
        self._median = settings.prompt_tokens
        self._max_tokens = settings.max_tokens
        self._file: list[tuple[list[dict[str, str]], int]] = []
        self.sent = 0
        if settings.prompts_file:
            self._file = load_prompts(settings.prompts_file, settings.max_tokens)
            self.describe = f"{len(self._file)} prompts from {settings.prompts_file}"
        else:
            self.describe = (f"synthetic, unique, ~{settings.prompt_tokens} tokens (log-normal), "
                             f"max_tokens {settings.max_tokens}")

    @property
    def repeated(self) -> bool:
        return bool(self._file) and self.sent > len(self._file)

    def next(self) -> tuple[list[dict[str, str]], int]:
        n = self.sent
        self.sent += 1
        if self._file:
            return self._file[n % len(self._file)]
        words = int(min(4 * self._median, max(16, round(self._rng.lognormvariate(math.log(self._median), 0.5)))))
        # The request number leads the user turn so no two prompts share more than the template and system prompt.
        content = f"Request {n}: {word_text(self._rng, words)}\nSummarise the text above in one paragraph."
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}], self._max_tokens


def load_prompts(path: str, default_max_tokens: int) -> list[tuple[list[dict[str, str]], int]]:
    """A JSONL file of `{"messages": [...]}` or `{"prompt": "..."}` lines, each with an optional max_tokens."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CapacityError(f"--prompts {p}: cannot read it: {exc}") from None
    out: list[tuple[list[dict[str, str]], int]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CapacityError(f"--prompts {p}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(doc, dict):
            raise CapacityError(f"--prompts {p}:{number}: expected an object with messages or prompt")
        messages = doc.get("messages")
        if messages is None and isinstance(doc.get("prompt"), str):
            messages = [{"role": "user", "content": doc["prompt"]}]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise CapacityError(f"--prompts {p}:{number}: messages must be a non-empty list of "
                                "{role, content} strings (or give a prompt string)")
        max_tokens = doc.get("max_tokens", default_max_tokens)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise CapacityError(f"--prompts {p}:{number}: max_tokens must be a positive integer")
        out.append(([{"role": m["role"], "content": m["content"]} for m in messages], max_tokens))
    if not out:
        raise CapacityError(f"--prompts {p}: no prompts in it")
    return out


async def _one(http: aiohttp.ClientSession, url: str, body: dict[str, Any], sample: Sample) -> None:
    start = time.monotonic()
    counted = 0
    async with http.post(f"{url}/v1/chat/completions", data=orjson.dumps(body),
                         headers={"content-type": "application/json"}) as resp:
        if resp.status != 200:
            sample.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        async for raw in resp.content:
            if not raw.startswith(b"data: {"):
                continue
            chunk = orjson.loads(raw[6:])
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    counted += 1
                    if sample.ttft_s is None:
                        sample.ttft_s = time.monotonic() - start
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                sample.output_tokens = int(usage["completion_tokens"])
    sample.e2e_s = time.monotonic() - start
    sample.output_tokens = sample.output_tokens or counted
    if sample.ttft_s is None:
        sample.error = "the stream ended without a token"


async def _request(http: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float,
                   deadline: float, sample: Sample) -> None:
    budget = deadline - time.monotonic()
    if budget <= 0:
        sample.cut = True
        return
    try:
        await asyncio.wait_for(_one(http, url, body, sample), timeout=min(timeout_s, budget))
    except TimeoutError:
        if timeout_s < budget:
            sample.error = f"no complete answer within {timeout_s:g} s"
        else:
            sample.cut = True
    except (aiohttp.ClientError, ValueError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:200]


async def run_step(http: aiohttp.ClientSession, url: str, model: str, prompts: Prompts, concurrency: int,
                   requests: int, settings: ProbeSettings, deadline: float) -> StepResult:
    """`requests` requests through `concurrency` closed-loop slots (fewer when the deadline comes first)."""
    # By issue order, not completion order: the first `concurrency` are the first wave.
    samples: list[Sample] = []

    async def slot() -> None:
        while len(samples) < requests and time.monotonic() < deadline:
            sample = Sample()
            samples.append(sample)
            messages, max_tokens = prompts.next()
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}
            await _request(http, url, body, settings.request_timeout_s, deadline, sample)

    start = time.monotonic()
    await asyncio.gather(*(slot() for _ in range(concurrency)))
    wall = max(time.monotonic() - start, 1e-9)
    done = [s for s in samples if s.error is None and not s.cut]
    # The first wave starts together: a burst no steady state has. Skip it when there is a steady part.
    steady = [s for s in samples[concurrency:] if s.error is None and not s.cut] or done
    ttfts = [s.ttft_s for s in steady if s.ttft_s is not None]
    e2es = [s.e2e_s for s in done if s.e2e_s is not None]
    errors = [s for s in samples if s.error is not None]
    step = Step(concurrency=concurrency, completed=len(done), errors=len(errors),
                ttft_p50_s=percentile(ttfts, 0.5) if ttfts else None,
                ttft_p90_s=percentile(ttfts, 0.9) if ttfts else None,
                output_tokens_per_s=sum(s.output_tokens for s in done) / wall)
    return StepResult(step=step, sent=len(samples), cut=sum(1 for s in samples if s.cut), wall_s=wall,
                      e2e_p50_s=statistics.median(e2es) if e2es else None,
                      first_error=errors[0].error if errors else None)


async def served_model(http: aiohttp.ClientSession, url: str) -> str:
    """The first model the worker lists at /v1/models."""
    try:
        async with http.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                raise CapacityError(f"{url}/v1/models answered HTTP {resp.status}; pass --model")
            doc = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise CapacityError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not (isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str)):
        raise CapacityError(f"{url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])


def _validate(settings: ProbeSettings) -> list[int]:
    for name in ("max_concurrency", "max_requests", "prompt_tokens", "max_tokens"):
        if getattr(settings, name) < 1:
            raise CapacityError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(settings, name)}")
    for name in ("duration_s", "request_timeout_s"):
        value = getattr(settings, name)
        if not (math.isfinite(value) and value > 0):
            raise CapacityError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
    if settings.requests_per_step is not None and settings.requests_per_step < 1:
        raise CapacityError(f"--requests-per-step must be at least 1, got {settings.requests_per_step}")
    steps = list(settings.steps) if settings.steps else ladder(settings.max_concurrency)
    if any(c < 1 for c in steps) or steps != sorted(set(steps)):
        raise CapacityError(f"--steps must be increasing positive concurrencies, got {steps}")
    return steps


async def probe(settings: ProbeSettings, progress: Callable[[StepResult], None] | None = None) -> ProbeResult:
    """Run the sweep; the knee and the recommendation from what it measured."""
    levels = _validate(settings)
    url = base_url(settings.url)
    prompts = Prompts(settings)
    headers = {"authorization": f"Bearer {settings.api_key}"} if settings.api_key else None
    connector = aiohttp.TCPConnector(limit=max(levels) + 4)
    t0 = time.monotonic()
    deadline = t0 + settings.duration_s
    results: list[StepResult] = []
    stopped = "swept every step"
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        model = settings.model or await served_model(http, url)
        for concurrency in levels:
            left = settings.max_requests - prompts.sent
            if left <= 0:
                stopped = f"--max-requests {settings.max_requests} reached"
                break
            if time.monotonic() >= deadline:
                stopped = f"--duration-s {settings.duration_s:g} reached"
                break
            wanted = settings.requests_per_step or max(8, 4 * concurrency)
            result = await run_step(http, url, model, prompts, concurrency, min(wanted, left), settings, deadline)
            if result.step.completed == 0 and result.step.errors == 0:
                stopped = f"--duration-s {settings.duration_s:g} reached"
                break
            results.append(result)
            if progress:
                progress(result)
            if result.cut:
                stopped = f"--duration-s {settings.duration_s:g} reached"
                break
            if find_knee([r.step for r in results], settings.rule, settings.knee_fraction).found:
                stopped = "stopped at the first step past the knee"
                break
    # A step the deadline cut short lost its in-flight requests' tokens: its throughput would fake a knee.
    whole = [r.step for r in results if not r.cut]
    if not whole:
        raise CapacityError(f"no step completed within --duration-s {settings.duration_s:g}; raise it")
    notes = []
    if prompts.repeated:
        notes.append("prompts from the file were sent more than once: cached prefixes make later steps look "
                     "cheaper than real traffic; give more prompts than requests")
    if len(whole) < len(results):
        notes.append(f"the step at concurrency {results[-1].step.concurrency} was cut short by --duration-s and "
                     "is left out of the knee")
    knee = find_knee(whole, settings.rule, settings.knee_fraction)
    return ProbeResult(url=url, model=model, steps=tuple(results), knee=knee, requests_sent=prompts.sent,
                       duration_s=time.monotonic() - t0, stopped=stopped, prompts=prompts.describe,
                       knee_fraction=settings.knee_fraction, notes=tuple(notes))
