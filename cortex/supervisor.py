"""Run Envoy, ingest and the extproc processes as one supervised group.

A child that dies is reported and restarted with backoff; one that keeps dying (more than `max_restarts`
in `window_s`) stops the whole group, which then exits non-zero with a message naming it. SIGINT/SIGTERM
stop every child (SIGTERM, then SIGKILL after a grace period). Children also get PR_SET_PDEATHSIG, so
even a SIGKILLed supervisor leaves no orphans behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("cortex.supervisor")


def _die_with_parent() -> None:
    # Linux-only: deliver SIGTERM to the child when the supervisor thread that forked it exits.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


@dataclass
class ChildSpec:
    name: str
    argv: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = True


@dataclass
class _Child:
    spec: ChildSpec
    proc: asyncio.subprocess.Process | None = None
    restarts: deque[float] = field(default_factory=deque)
    started_at: float = 0.0


class GroupFailed(RuntimeError):
    pass


class Supervisor:
    def __init__(self, specs: Sequence[ChildSpec], *, max_restarts: int = 5, window_s: float = 60.0,
                 grace_s: float = 5.0, on_event: Callable[[str], None] | None = None) -> None:
        self.children = [_Child(s) for s in specs]
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.grace_s = grace_s
        self.on_event = on_event or (lambda msg: print(f"[cortex] {msg}", file=sys.stderr, flush=True))
        self._stopping = False
        self._failed: str | None = None
        self._done = asyncio.Event()

    async def _spawn(self, child: _Child) -> None:
        env = {**os.environ, **child.spec.env}
        child.proc = await asyncio.create_subprocess_exec(*child.spec.argv, env=env,
                                                          preexec_fn=_die_with_parent)
        child.started_at = time.monotonic()
        log.info("started %s (pid %d)", child.spec.name, child.proc.pid)

    async def _watch(self, child: _Child) -> None:
        while not self._stopping:
            assert child.proc is not None
            code = await child.proc.wait()
            if self._stopping:
                return
            if not child.spec.restart:
                self._fail(f"{child.spec.name} exited with code {code}")
                return
            now = time.monotonic()
            child.restarts.append(now)
            while child.restarts and now - child.restarts[0] > self.window_s:
                child.restarts.popleft()
            if len(child.restarts) > self.max_restarts:
                self._fail(f"{child.spec.name} died {len(child.restarts)} times within {self.window_s:.0f}s "
                           f"(last exit code {code}); giving up")
                return
            delay = min(5.0, 0.25 * 2 ** (len(child.restarts) - 1))
            self.on_event(f"{child.spec.name} exited with code {code}; restarting in {delay:.2f}s "
                          f"({len(child.restarts)}/{self.max_restarts} in {self.window_s:.0f}s)")
            await asyncio.sleep(delay)
            if self._stopping:
                return
            await self._spawn(child)

    def _fail(self, message: str) -> None:
        if self._failed is None:
            self._failed = message
            self.on_event(f"error: {message}")
        self._done.set()

    def stop(self) -> None:
        self._done.set()

    def pid_of(self, name: str) -> int | None:
        for c in self.children:
            if c.spec.name == name and c.proc is not None and c.proc.returncode is None:
                return c.proc.pid
        return None

    async def run(self, ready: Callable[[], object] | None = None) -> int:
        """Start everything, wait for a signal or a fatal failure, stop everything. Returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)
        watchers = []
        try:
            for child in self.children:
                await self._spawn(child)
            watchers = [asyncio.create_task(self._watch(c)) for c in self.children]
            if ready is not None:
                ready_task = asyncio.ensure_future(ready())  # type: ignore[arg-type]
                ready_task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
            await self._done.wait()
        finally:
            self._stopping = True
            await self._terminate_all()
            for w in watchers:
                w.cancel()
        return 1 if self._failed else 0

    async def _terminate_all(self) -> None:
        live = [c.proc for c in self.children if c.proc is not None and c.proc.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)), self.grace_s)
        except TimeoutError:
            for p in live:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            await asyncio.gather(*(p.wait() for p in live))

    @property
    def failure(self) -> str | None:
        return self._failed
