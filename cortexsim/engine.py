"""The simulated engine core shared by both flavours: a scheduler step loop over a KV cache and a cost model.

One ``EngineCore`` is one data-parallel rank: its own cache (vLLM ``PrefixCache`` or SGLang ``RadixCache``),
its own KV-event publisher, its own queues. It is a single asyncio task; each step

1. schedules: every running request that finished its prefill decodes one token; running requests still in
   prefill continue with the next chunk; then waiting requests are admitted FCFS while the running batch has
   room, the step's token budget (``max_num_batched_tokens`` / SGLang's ``chunked_prefill_size``) is not used
   up and their blocks fit (a head that does not fit blocks the queue, as in both engines);
2. sleeps for the step's modelled duration (``TimingModel``, cortexsim/timing.py: weights, linear prefill,
   attention over each chunk's context, KV reads of every decoding sequence), minus the CPU time the step
   itself took;
3. commits the computed tokens to the cache (vLLM's cache committed them when it scheduled the step, as
   ``allocate_slots`` does), samples one token for every request whose prompt is now fully computed, publishes
   the step's events as one batch and only then hands tokens to the HTTP handlers, so a prompt's
   ``BlockStored`` is on the wire before its first token.

KV transfer (PD) enters as ``num_external_tokens``: tokens whose KV arrives from another worker and so cost
no prefill compute here, but are cached like computed ones. A vLLM prefill that hands its KV to a remote
decoder finishes but keeps its blocks pinned (``held``) until the decoder reads them or the lease expires.

Generation returns a fixed cycle of ordinary tokens; sampling parameters are not modelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cortex.engine_hashes import LoraRef
from cortex.media import MediaSpan
from cortexsim.kv_events import EventPublisher, now_batch
from cortexsim.prefix_cache import Admission, CapacityError
from cortexsim.timing import TimingModel

log = logging.getLogger("cortex.sim.engine")  # its name in log lines, kept across the move


class KVCache(Protocol):
    """What the engine needs from a cache; ``PrefixCache`` (vLLM) and ``RadixCache`` (SGLang) provide it."""

    block_size: int
    num_blocks: int
    query_tokens: int
    hit_tokens: int
    caches_on_schedule: bool
    """True: the step's blocks are committed when it is scheduled (vLLM), else once computed (SGLang)."""

    @property
    def usage(self) -> float: ...

    @property
    def num_usable_blocks(self) -> int: ...

    def prompt_hashes(self, token_ids: list[int], *, cache_salt: str | None = None,
                      lora: LoraRef | None = None, media: Sequence[MediaSpan] = ()) -> list[bytes]: ...

    def prefix_match(self, token_ids: list[int], *, cache_salt: str | None = None, lora: LoraRef | None = None,
                     extra_key: str | None = None) -> int: ...

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int = 1) -> None: ...

    def admit(self, request_id: str, token_ids: list[int], *, max_new_tokens: int = 1,
              block_hashes: list[bytes] | None = None, cache_salt: str | None = None,
              lora: LoraRef | None = None, extra_key: str | None = None,
              report_hits: bool = False, media: Sequence[MediaSpan] = ()) -> Admission | None: ...

    def extend(self, request_id: str, new_token_ids: list[int]) -> None: ...

    def commit(self, request_id: str, num_computed_tokens: int) -> None: ...

    def free(self, request_id: str) -> None: ...

    def block_ids(self, request_id: str) -> list[int]: ...

    def reset(self) -> bool: ...

    def forget_all(self) -> None: ...

    def take_events(self) -> list[Any]: ...


class EngineDeadError(RuntimeError):
    """The step loop crashed or stopped; like vLLM, the server then answers 503 on /health."""


@dataclass(frozen=True)
class Delta:
    """One step's output for one request."""

    token_id: int | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None
    lora: LoraRef | None = None
    extra_key: str | None = None
    media: tuple[MediaSpan, ...] = ()
    """Its media items' placeholder runs (a vLLM chat with images), folded into its blocks' hashes."""
    block_hashes: list[bytes] = field(default_factory=list)
    num_external_tokens: int = 0
    """Prompt tokens whose KV is transferred in (PD decode); they cost no prefill here."""
    hold_blocks: bool = False
    """vLLM prefill for a remote decoder: keep the blocks pinned after finishing, until read or expired."""
    report_hits: bool = False
    """vLLM's ``kv_cache_report_mode: "full"``: its prefix hit is published again as a BlockStored."""
    arrival: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    aborted: bool = False
    outputs: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.aborted

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= len(self.prompt_token_ids)

    async def deltas(self) -> AsyncIterator[Delta]:
        """Outputs until the request finishes; raises EngineDeadError if the engine fails it."""
        while True:
            delta = await self.outputs.get()
            if delta.error is not None:
                raise EngineDeadError(delta.error)
            yield delta
            if delta.finish_reason is not None:
                return

    def drain(self) -> list[Delta]:
        """Every output already queued, without waiting (lets a slow stream catch up in one write)."""
        out: list[Delta] = []
        while not self.outputs.empty():
            out.append(self.outputs.get_nowait())
        return out


@dataclass
class _Step:
    prefills: list[tuple[SimRequest, int]]
    decodes: list[SimRequest]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


@dataclass
class EngineStats:
    """Counters both flavours' metrics are computed from."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_computed_tokens: int = 0
    num_requests: int = 0
    num_aborted: int = 0
    kv_expired: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    recent_tokens: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256))

    def gen_throughput(self, now: float, window: float = 5.0) -> float:
        """Generated tokens per second over the last `window` seconds."""
        total = sum(n for t, n in self.recent_tokens if now - t <= window)
        return total / window


class EngineCore:
    """One DP rank: scheduler + model runner reduced to a step loop over a KV cache and a cost model."""

    def __init__(self, cache: KVCache, publisher: EventPublisher, timing: TimingModel, max_running: int,
                 output_token_ids: list[int], *, rank: int = 0) -> None:
        if not output_token_ids:
            raise ValueError("output_token_ids must not be empty")
        self.cache = cache
        self.publisher = publisher
        self.timing = timing
        self.max_running = max_running
        self.rank = rank
        self._cycle = list(output_token_ids)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.held: dict[str, tuple[SimRequest, asyncio.TimerHandle | None]] = {}
        self._wakeup = asyncio.Event()
        self.dead: str | None = None
        self.stats = EngineStats()
        self.last_output_at = 0.0
        self._lease_seconds = 30.0
        # Set by the API layer, which owns the metric names.
        self.on_first_token: Callable[[float], None] | None = None

    # Compatibility accessors for the metrics code written against the first version.
    @property
    def prompt_tokens(self) -> int:
        return self.stats.prompt_tokens

    @property
    def generation_tokens(self) -> int:
        return self.stats.generation_tokens

    @property
    def finished(self) -> dict[str, int]:
        return self.stats.finished

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, req: SimRequest) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.stats.num_requests += 1
        self.waiting.append(req)
        self._wakeup.set()

    def abort(self, req: SimRequest) -> None:
        """Client went away: drop it if waiting; a running one is released at the end of its step."""
        if req.done:
            return
        req.aborted = True
        self.stats.num_aborted += 1
        with contextlib.suppress(ValueError):
            self.waiting.remove(req)

    def reset_prefix_cache(self, *, require_idle: bool = False) -> bool:
        """vLLM's reset (refused while blocks are pinned) or, with `require_idle`, SGLang's idle-only flush."""
        if require_idle and (self.waiting or self.running or self.held):
            return False
        ok = self.cache.reset()
        if ok:
            # Published at once rather than with the next step (an idle engine has none), so a
            # subscriber learns of the reset before any later store.
            self._publish()
        return ok

    def restart_cold(self) -> None:
        """Fault injection: the engine restarted. The cache forgets everything, the publisher starts over at
        seq 0, and whatever the engine emits at construction (SGLang: AllBlocksCleared) goes out first."""
        self.cache.forget_all()
        self.publisher.restart()
        self._publish()

    def publish_startup_events(self) -> None:
        self._publish()

    # --- PD: blocks held for a remote decoder (vLLM) -------------------------------------------

    def release_held(self, request_id: str) -> SimRequest | None:
        entry = self.held.pop(request_id, None)
        if entry is None:
            return None
        req, timer = entry
        if timer is not None:
            timer.cancel()
        self.cache.free(req.request_id)
        self._wakeup.set()  # freed blocks may unblock the queue head
        return req

    def _expire_held(self, request_id: str) -> None:
        if self.release_held(request_id) is not None:
            self.stats.kv_expired += 1

    # --- the loop ------------------------------------------------------------------------------

    async def run(self, *, lease_seconds: float = 30.0) -> None:
        self._lease_seconds = lease_seconds
        loop = asyncio.get_running_loop()
        try:
            while True:
                started = loop.time()
                step = self._schedule()
                if step.empty:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                modelled = self.step_seconds(step)
                # The simulator's own CPU time for this step counts against the modelled time, so heavy load
                # slows the clock only once the host, not the model, is the bottleneck. sleep(0) still yields.
                await asyncio.sleep(max(0.0, started + modelled - loop.time()))
                self._finish_step(step)
        except asyncio.CancelledError:
            self._fail_all("the engine is shutting down")
            raise
        except Exception as exc:
            log.exception("simulated engine step failed")
            self._fail_all(f"engine step failed: {exc}")

    def step_seconds(self, step: _Step) -> float:
        """The modelled duration of a scheduled step (before ``_finish_step`` advances its requests): each
        prefill chunk at the position its request has reached, each decode over its whole context."""
        return self.timing.step_seconds(
            prefills=[(n, req.num_computed_tokens) for req, n in step.prefills],
            decode_contexts=[req.num_computed_tokens + 1 for req in step.decodes])

    def _schedule(self) -> _Step:
        budget = self.timing.max_num_batched_tokens
        decodes: list[SimRequest] = []
        prefills: list[tuple[SimRequest, int]] = []
        early = self.cache.caches_on_schedule
        for req in self.running:
            if req.prefill_done:
                # The token sampled last step is computed this step and needs its KV slot now.
                self.cache.extend(req.request_id, [req.output_token_ids[-1]])
                decodes.append(req)
                if early:
                    self.cache.commit(req.request_id, req.num_computed_tokens + 1)
        budget -= len(decodes)
        for req in self.running:
            if not req.prefill_done and budget > 0:
                n = min(len(req.prompt_token_ids) - req.num_computed_tokens, budget)
                prefills.append((req, n))
                budget -= n
                if early:
                    self.cache.commit(req.request_id, req.num_computed_tokens + n)
        admitted = 0
        while self.waiting and len(self.running) + admitted < self.max_running and budget > 0:
            req = self.waiting[0]
            try:
                admission = self.cache.admit(req.request_id, req.prompt_token_ids, max_new_tokens=req.max_tokens,
                                             block_hashes=req.block_hashes, cache_salt=req.cache_salt,
                                             lora=req.lora, extra_key=req.extra_key, report_hits=req.report_hits,
                                             media=req.media)
            except CapacityError as exc:
                self.waiting.popleft()
                req.finish_reason = "error"
                req.outputs.put_nowait(Delta(error=str(exc)))
                continue
            if admission is None:
                break  # FCFS: the head waits for blocks and so does everyone behind it
            self.waiting.popleft()
            admitted += 1
            req.num_cached_tokens = admission.num_cached_tokens
            req.num_computed_tokens = max(admission.num_cached_tokens, req.num_external_tokens)
            n = min(len(req.prompt_token_ids) - req.num_computed_tokens, budget)
            prefills.append((req, n))
            budget -= n
            self.running.append(req)
            if early:
                # Cached now, as vLLM's allocate_slots does: the next admission, even in this step, hits them.
                self.cache.commit(req.request_id, req.num_computed_tokens + n)
        return _Step(prefills, decodes)

    def _finish_step(self, step: _Step) -> None:
        now = time.monotonic()
        sampled: list[SimRequest] = []
        for req, n in step.prefills:
            if req.aborted:
                continue
            req.num_computed_tokens += n
            self.stats.prefill_computed_tokens += n
            if not self.cache.caches_on_schedule:
                self.cache.commit(req.request_id, req.num_computed_tokens)
            if req.prefill_done:
                self.stats.prompt_tokens += len(req.prompt_token_ids)
                sampled.append(req)
        for req in step.decodes:
            if req.aborted:
                continue
            req.num_computed_tokens += 1
            if not self.cache.caches_on_schedule:
                self.cache.commit(req.request_id, req.num_computed_tokens)
            sampled.append(req)
        deliveries: list[tuple[SimRequest, Delta]] = []
        for req, _ in step.prefills:
            if req.aborted:
                self._retire(req)
        for req in step.decodes:
            if req.aborted:
                self._retire(req)
        for req in sampled:
            token = self._cycle[len(req.output_token_ids) % len(self._cycle)]
            req.output_token_ids.append(token)
            self.stats.generation_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = now
                if self.on_first_token is not None:
                    self.on_first_token(now - req.arrival)
            finish = "length" if len(req.output_token_ids) >= req.max_tokens else None
            if finish is not None:
                req.finish_reason = finish
                self.stats.finished[finish] = self.stats.finished.get(finish, 0) + 1
                self._retire(req)
            deliveries.append((req, Delta(token_id=token, finish_reason=finish)))
        if sampled:
            self.stats.recent_tokens.append((now, len(sampled)))
            self.last_output_at = now
        self._publish()
        for req, delta in deliveries:
            req.outputs.put_nowait(delta)

    def _retire(self, req: SimRequest) -> None:
        self.running.remove(req)
        if req.hold_blocks and not req.aborted and req.finish_reason in ("length", "stop"):
            # NIXL: the prefill's blocks stay pinned for the decoder to read, for at most the lease.
            timer = asyncio.get_running_loop().call_later(self._lease_seconds, self._expire_held, req.request_id)
            self.held[req.request_id] = (req, timer)
            return
        self.cache.free(req.request_id)

    def _publish(self) -> None:
        events = self.cache.take_events()
        if events:
            self.publisher.publish(now_batch(events))

    def _fail_all(self, reason: str) -> None:
        self.dead = reason
        for req in (*self.waiting, *self.running):
            if not req.done:
                req.finish_reason = "error"
                req.outputs.put_nowait(Delta(error=reason))
        self.waiting.clear()
        for _, timer in self.held.values():
            if timer is not None:
                timer.cancel()
        self.held.clear()
