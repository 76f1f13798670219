"""Run Envoy, ingest and the extproc processes as one supervised group.

Children start in stages (ChildSpec.stage, ascending); a stage may wait on a gate first (Envoy waits until
every extproc process serves, so it never fails open on a cold ext_proc cluster). A child that dies is
reported and restarted with backoff; one that keeps dying (more than `max_restarts` in `window_s`) stops
the whole group, which then exits non-zero with a message naming it. SIGINT/SIGTERM stop every child, stage
by stage in reverse (Envoy first, so no request meets a half-stopped gateway; simulated workers last, so
ingest never sees its publishers vanish): SIGTERM, then SIGKILL after a grace period. Each child runs in its
own process group, so a terminal's Ctrl-C reaches only the supervisor and each child gets exactly one
signal. Children also get PR_SET_PDEATHSIG, so even a SIGKILLed supervisor leaves no orphans behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cortex import logs
from cortex.die_with_parent import die_with_parent

log = logging.getLogger("cortex.supervisor")


@dataclass
class ChildSpec:
    name: str
    argv: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = True
    stage: int = 0
    """Start order: every child of a lower stage is started (and its gate passed) first; stop is the reverse."""
    gate: Callable[[], Awaitable[None]] | None = None
    """Awaited before this child starts; raises (TimeoutError, RuntimeError) with the reason to give up."""
    log: Path | None = None
    """Append the child's stdout and stderr to this file instead of the supervisor's terminal (the demo's
    replicas: N gateways logging to one terminal would bury what the user needs to read)."""


def _see(spec: ChildSpec) -> str:
    return f" (its log: {spec.log})" if spec.log is not None else ""


@dataclass
class _Child:
    spec: ChildSpec
    proc: asyncio.subprocess.Process | None = None
    restarts: deque[float] = field(default_factory=deque)
    started_at: float = 0.0


def _report_crash(task: asyncio.Task[None]) -> None:
    # Start-up (the gates, the ready announcement) must not fail silently: the person would wait for a ready
    # line that never comes.
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("start-up failed: %r", exc, exc_info=exc)


class GroupFailed(RuntimeError):
    pass


class Supervisor:
    def __init__(self, specs: Sequence[ChildSpec], *, max_restarts: int = 5, window_s: float = 60.0,
                 grace_s: float = 5.0, on_event: Callable[[str], None] | None = None) -> None:
        self.children = [_Child(s) for s in specs]
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.grace_s = grace_s
        self.on_event = on_event
        """Receives each event line ("error: " before a fatal one) instead of the `cortex` logger (tests)."""
        self._stopping = False
        self._failed: str | None = None
        self._done = asyncio.Event()

    def _event(self, msg: str, level: int = logging.INFO, **fields: object) -> None:
        if self.on_event is not None:
            self.on_event(f"error: {msg}" if level >= logging.ERROR else msg)
        else:
            logs.say("%s", msg, level=level, **fields)

    async def _spawn(self, child: _Child) -> None:
        # The child's name is its `process` in JSON log lines.
        env = {**os.environ, logs.PROCESS_ENV: child.spec.name, **child.spec.env}
        # A process group of its own: the terminal's Ctrl-C goes to the supervisor alone, which then stops the
        # children in order with one SIGTERM each. In the terminal's group every child also got the SIGINT, so
        # the supervisor's SIGTERM raced its shutdown (uvloop leaves the signal wakeup fd set after its handlers
        # are removed: "Exception ignored when trying to write to the signal wakeup fd").
        out = None
        if child.spec.log is not None:
            out = child.spec.log.open("ab")  # the child keeps its own descriptor; ours is closed below
        try:
            child.proc = await asyncio.create_subprocess_exec(
                *child.spec.argv, env=env, process_group=0, preexec_fn=die_with_parent,
                stdout=out, stderr=asyncio.subprocess.STDOUT if out is not None else None)
        finally:
            if out is not None:
                out.close()
        child.started_at = time.monotonic()
        log.info("%s %s (pid %d)", "restarted" if child.restarts else "started", child.spec.name, child.proc.pid,
                 extra={"child": child.spec.name, "pid": child.proc.pid})

    async def _watch(self, child: _Child) -> None:
        while not self._stopping:
            assert child.proc is not None
            code = await child.proc.wait()
            if self._stopping:
                return
            if not child.spec.restart:
                self._fail(f"{child.spec.name} exited with code {code}{_see(child.spec)}")
                return
            now = time.monotonic()
            child.restarts.append(now)
            while child.restarts and now - child.restarts[0] > self.window_s:
                child.restarts.popleft()
            if len(child.restarts) > self.max_restarts:
                self._fail(f"{child.spec.name} died {len(child.restarts)} times within {self.window_s:.0f}s "
                           f"(last exit code {code}); giving up{_see(child.spec)}")
                return
            delay = min(5.0, 0.25 * 2 ** (len(child.restarts) - 1))
            self._event(f"{child.spec.name} exited with code {code}; restarting in {delay:.2f}s "
                        f"({len(child.restarts)}/{self.max_restarts} in {self.window_s:.0f}s){_see(child.spec)}",
                        logging.WARNING, child=child.spec.name, exit_code=code, restarts=len(child.restarts))
            await asyncio.sleep(delay)
            if self._stopping:
                return
            await self._spawn(child)

    def _fail(self, message: str) -> None:
        if self._failed is None:
            self._failed = message
            self._event(message, logging.ERROR)
        self._done.set()

    def stop(self, sig: signal.Signals | None = None) -> None:
        if not self._done.is_set():
            self._event(f"stopping ({sig.name})" if sig is not None else "stopping")
        self._done.set()

    def pid_of(self, name: str) -> int | None:
        for c in self.children:
            if c.spec.name == name and c.proc is not None and c.proc.returncode is None:
                return c.proc.pid
        return None

    def _stages(self) -> list[list[_Child]]:
        stages: dict[int, list[_Child]] = {}
        for c in self.children:
            stages.setdefault(c.spec.stage, []).append(c)
        return [stages[k] for k in sorted(stages)]

    async def _start(self, watchers: list[asyncio.Task[None]], ready: Callable[[], object] | None) -> None:
        for stage in self._stages():
            for child in stage:
                if child.spec.gate is not None:
                    try:
                        await child.spec.gate()
                    except (TimeoutError, RuntimeError) as exc:
                        self._fail(f"{child.spec.name} not started: {exc}")
                        return
                if self._done.is_set():
                    return
            for child in stage:
                await self._spawn(child)
                watchers.append(asyncio.create_task(self._watch(child)))
        if ready is not None:
            await ready()  # type: ignore[misc]

    async def run(self, ready: Callable[[], object] | None = None) -> int:
        """Start everything, wait for a signal or a fatal failure, stop everything. Returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop, sig)
        watchers: list[asyncio.Task[None]] = []
        starter = asyncio.create_task(self._start(watchers, ready))
        starter.add_done_callback(_report_crash)
        try:
            await self._done.wait()
        finally:
            self._stopping = True
            starter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starter
            await self._terminate_all()
            for w in watchers:
                w.cancel()
        if not self._failed:
            self._event("stopped")
        return 1 if self._failed else 0

    async def _terminate_all(self) -> None:
        for stage in reversed(self._stages()):
            await self._terminate([c for c in stage if c.proc is not None and c.proc.returncode is None])

    async def _terminate(self, children: list[_Child]) -> None:
        live = [c.proc for c in children if c.proc is not None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)), self.grace_s)
        except TimeoutError:
            for c in children:
                if c.proc is not None and c.proc.returncode is None:
                    log.warning("%s did not stop within %.0f s of SIGTERM: killed", c.spec.name, self.grace_s,
                                extra={"child": c.spec.name})
                    with contextlib.suppress(ProcessLookupError):
                        c.proc.kill()
            await asyncio.gather(*(p.wait() for p in live))

    @property
    def failure(self) -> str | None:
        return self._failed
