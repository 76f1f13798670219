"""PD orchestration, the sending half: the prefill leg, the decode leg's body, and a pair's failures as one unit.

Envoy sends the decode leg (it streams the answer to the client, with its connection pools and retry on a
failed connect); extproc sends the prefill leg itself, with its own HTTP client. Not an Envoy mirror: a
mirror is fire-and-forget, so Cortex could neither see a prefill fail nor cancel it (docs/pd.md).

SGLang (engines.md §1, concurrent): one body with `bootstrap_host/port/room` (and a `rid`) goes to the prefill
here and to the decode through Envoy. The decode is released to Envoy once the prefill leg is written to its
worker; a prefill that cannot be reached is re-picked first (a new pair, a new room).

vLLM (engines.md §2.2, NIXL pull, sequential): the prefill leg (`do_remote_decode`, `max_tokens: 1`, not
streamed) is awaited; its `kv_transfer_params` go verbatim into the decode body. A failed prefill is re-picked
once; then the request falls back to a worker that can serve it alone.

A pair's life is the pure state machine `on_event`; its actions (cancel the prefill leg, abort the decode by
its `rid`) are carried out by `PairLegs`, so no leg of a broken pair is left waiting for the engines' own
300 s timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from cortex import engines
from cortex.config import UpstreamTlsConfig
from cortex.upstream_tls import WorkerTls
from extproc.cluster_view import TargetInfo
from extproc.metrics import PD_FAILURES, PD_LEG_SECONDS
from extproc.pd import Pair, PdPlan
from extproc.policies.base import Candidate

log = logging.getLogger("cortex.extproc.pd")

# Rooms are drawn so that room + i (the engine's per-sample rooms) never passes int64 (engines.md §1.2).
ROOM_MAX = 2**63 - 1 - 1024


class Phase(enum.StrEnum):
    WAITING = "waiting"
    """Both legs in flight; the decode waits for the prefill's KV."""
    DECODE_STARTED = "decode_started"
    """The decode answered with headers (a stream started); the prefill leg has not finished yet."""
    PREFILLED = "prefilled"
    """The prefill leg finished; the decode has or will have its KV."""
    DONE = "done"
    FAILED = "failed"


CANCEL_PREFILL = "cancel_prefill"
ABORT_DECODE = "abort_decode"

_TABLE: dict[tuple[Phase, str], tuple[Phase, tuple[str, ...]]] = {
    (Phase.WAITING, "prefill_ok"): (Phase.PREFILLED, ()),
    (Phase.WAITING, "prefill_failed"): (Phase.FAILED, (ABORT_DECODE,)),
    (Phase.WAITING, "decode_ok"): (Phase.DECODE_STARTED, ()),
    (Phase.WAITING, "decode_failed"): (Phase.FAILED, (CANCEL_PREFILL,)),
    (Phase.WAITING, "watchdog"): (Phase.FAILED, (CANCEL_PREFILL, ABORT_DECODE)),
    (Phase.WAITING, "stream_end"): (Phase.DONE, (CANCEL_PREFILL,)),
    (Phase.DECODE_STARTED, "prefill_ok"): (Phase.PREFILLED, ()),
    (Phase.DECODE_STARTED, "prefill_failed"): (Phase.FAILED, (ABORT_DECODE,)),
    (Phase.DECODE_STARTED, "watchdog"): (Phase.FAILED, (CANCEL_PREFILL, ABORT_DECODE)),
    (Phase.DECODE_STARTED, "stream_end"): (Phase.DONE, (CANCEL_PREFILL,)),
    (Phase.PREFILLED, "decode_failed"): (Phase.FAILED, ()),
    (Phase.PREFILLED, "stream_end"): (Phase.DONE, ()),
    (Phase.FAILED, "stream_end"): (Phase.DONE, (CANCEL_PREFILL,)),
}


def on_event(phase: Phase, event: str) -> tuple[Phase, tuple[str, ...]]:
    """A pair's next phase and the actions that keep no leg waiting in vain. Unlisted pairs change nothing
    (late news about a leg of a pair already settled)."""
    return _TABLE.get((phase, event), (phase, ()))


def splice(body: bytes, changes: Mapping[str, Any]) -> bytes:
    """Append fields to a validated JSON object without re-serialising it (cheaper, and safe for bodies nested
    deeper than orjson serialises). Duplicate keys: the engines' JSON parsers keep the last."""
    if not changes:
        return body
    extra = b",".join(orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in changes.items())
    head = body.rstrip()[:-1].rstrip()
    return head + (b"," if not head.endswith(b"{") else b"") + extra + b"}"


def vllm_prefill_body(body: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """The NIXL prefill leg: compute the prompt, keep its KV for a remote decoder, answer one token."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
    out.update(changes)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if "n" in out:
        out["n"] = 1
    return out


def sglang_room(rng: random.Random, rank: int | None, dp_size: int) -> int:
    """A bootstrap room; with a data-parallel prefill, one that its `follow_bootstrap_room` balancing sends to
    `rank` (room % dp_size == rank), the safe way to place a prefill rank (engines.md §1.8)."""
    room = rng.randint(0, ROOM_MAX)
    if rank is not None and dp_size > 1:
        room -= room % dp_size
        room += rank
    return room


@dataclass(slots=True)
class PairResult:
    legs: PairLegs
    decode_body: bytes
    decode_headers: dict[str, str]
    prefill: Candidate
    decode: Candidate
    repicked: bool


class PairLegs:
    """One pair's legs and phase. Everything runs on the extproc event loop; nothing here blocks."""

    def __init__(self, dispatcher: PdDispatcher, *, engine: str, prefill: TargetInfo, decodes: list[TargetInfo],
                 rid: str, phase: Phase, early_headers_s: float = 0.0, abort_window_s: float = 30.0) -> None:
        self.dispatcher = dispatcher
        self.engine = engine
        self.prefill = prefill
        self.decodes = decodes
        self.rid = rid
        self.phase = phase
        self.prefill_task: asyncio.Task[int] | None = None
        self.watchdog: asyncio.Task[None] | None = None
        self.started = time.monotonic()
        self.failure = ""
        """The event that failed the pair ('' while it has not failed): names the fallback (x-cortex-pd)."""
        self.settled = asyncio.Event()
        """Set once the prefill side is over: its leg finished, or the pair failed or ended."""
        self.early_headers_s = early_headers_s
        """> 0: the decode answers its headers at once (an SGLang stream), within about this long."""
        self.defer_abort = False
        """extproc holds the decode's headers: an abort now would reset the upstream before the headers went out,
        and Envoy would answer the client its own 502 instead of extproc's fallback. It waits for
        `release_abort`."""
        self.abort_window_s = abort_window_s
        """How long an abort is repeated while the decode's answer has not come (see `_abort`)."""
        self._abort_deferred = False
        self._headers = asyncio.Event()
        self._aborting: asyncio.Task[None] | None = None

    def event(self, event: str) -> None:
        before = self.phase
        self.phase, actions = on_event(self.phase, event)
        if self.phase is Phase.FAILED and before is not Phase.FAILED:
            self.failure = event
            leg = "decode" if event == "decode_failed" else "prefill"
            PD_FAILURES.labels(self.engine, leg, event).inc()
            log.warning("PD pair prefill=%s decode=%s failed (%s); %s", self.prefill.id,
                        ",".join(d.id for d in self.decodes), event, ", ".join(actions) or "nothing left running")
        for action in actions:
            if action == CANCEL_PREFILL and self.prefill_task is not None and not self.prefill_task.done():
                # Closing the connection is how both engines learn to abort a request.
                self.prefill_task.cancel()
            elif action == ABORT_DECODE:
                if self.defer_abort:
                    self._abort_deferred = True
                elif self._aborting is None:
                    self._aborting = self.dispatcher.spawn(self._abort())
        if self.phase in (Phase.PREFILLED, Phase.DONE, Phase.FAILED):
            self.settled.set()
            if self.watchdog is not None:
                self.watchdog.cancel()

    async def _abort(self) -> None:
        """Abort the decode of a failed pair, until its answer shows it took effect.

        The decode leg is sent by Envoy, so a pair can fail before the decode has the request: an abort then finds
        no such rid (a no-op in SGLang), and the decode would wait for a KV that never comes until the engine's
        own timeout (300 s). So the abort is repeated until the decode's answer reaches extproc (a reset shows as
        Envoy's local error), within `abort_window_s`. An SGLang stream's decode answers its headers at once:
        those are awaited first (`early_headers_s`), since a reset while they are on their way to extproc would
        let Envoy answer the client itself instead of extproc's fallback."""
        deadline = time.monotonic() + self.abort_window_s
        if self.early_headers_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._headers.wait(), self.early_headers_s)
        while self.phase is not Phase.DONE:
            if self._headers.is_set() and self.defer_abort:
                self._abort_deferred = True  # extproc holds the headers: release_abort sends it
                return
            await self.dispatcher.abort_decode(self.decodes, self.rid)
            if self._headers.is_set() or time.monotonic() > deadline:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._headers.wait(), 0.5)

    def headers_arrived(self) -> None:
        """The decode's response headers are at extproc: an abort waits until extproc answered them."""
        self._headers.set()
        self.defer_abort = True

    def release_abort(self, delay_s: float = 0.0) -> None:
        """Carry out a decode abort deferred while its headers were held, after `delay_s` (time for Envoy to act on
        extproc's answer first: its own reset of the upstream aborts the decode too; this one makes sure)."""
        self.defer_abort = False
        if self._abort_deferred:
            self._abort_deferred = False
            self.dispatcher.spawn(self.dispatcher.abort_decode(self.decodes, self.rid, delay_s))

    def prefill_finished(self, task: asyncio.Task[int]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        ok = exc is None and 200 <= task.result() < 300
        if ok:
            PD_LEG_SECONDS.labels(self.engine, "prefill").observe(time.monotonic() - self.started)
        self.event("prefill_ok" if ok else "prefill_failed")

    async def _watch(self, timeout: float) -> None:
        await asyncio.sleep(timeout)
        self.event("watchdog")


class PdDispatcher:
    def __init__(self, leg: Callable[[int], contextlib.AbstractContextManager[None]] | None = None,
                 tls: WorkerTls | None = None) -> None:
        self.leg = leg
        """Counts a prefill leg as in flight on its worker while it runs (extproc/router.py: Router.leg)."""
        self.rng = random.Random()
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.tls = tls if tls is not None else WorkerTls(UpstreamTlsConfig())
        """How an https worker is reached (upstream_tls); its certificate is checked, never skipped."""

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            trace = aiohttp.TraceConfig()
            trace.on_request_chunk_sent.append(_mark_sent)
            trace.on_request_headers_sent.append(_mark_sent)
            self._session = aiohttp.ClientSession(
                trace_configs=[trace], timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0),
                connector=aiohttp.TCPConnector(limit=0, force_close=False))
        return self._session

    def post(self, target: TargetInfo, path: str, **kwargs: Any) -> Any:
        """POST `path` to a worker, over TLS when it is an https one (its TLS name, from ingest)."""
        return self.session().post(f"{self.tls.base_url(target.address, target.tls_name)}{path}",
                                   **self.tls.kwargs(target.tls_name), **kwargs)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._session is not None:
            await self._session.close()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # keep a reference: the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)
        return task

    async def abort_decode(self, decodes: list[TargetInfo], rid: str, delay_s: float = 0.0) -> None:
        """SGLang's /abort_request on every decode that may hold the request (Envoy may have retried it on the
        next one); an unknown rid is a no-op there."""
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        for d in decodes:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with self.post(d, "/abort_request", json={"rid": rid},
                                     timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                    await resp.read()

    # -- SGLang ---------------------------------------------------------------------------------------------

    async def sglang(self, plan: PdPlan, pair: Pair, body: bytes, path: str,
                     changes: Mapping[str, Any]) -> PairResult | None:
        cfg = plan.cfg
        decode = pair.decode.chosen
        d_info = pair.targets[decode.id]
        decodes = [pair.targets[c.id] for c in pair.decode.order[:2]]
        # SGLang answers a streamed request's headers at once (StreamingResponse), before its bootstrap.
        streamed = plan.stream
        for attempt, cand in enumerate(pair.prefill.order[:2]):
            p = pair.targets[cand.id]
            dp_size = sum(1 for t in pair.targets.values() if t.worker == p.worker)
            rid = uuid.uuid4().hex
            room = sglang_room(self.rng, p.rank, dp_size)
            fields: dict[str, Any] = {**changes, "bootstrap_host": p.host, "bootstrap_port": p.bootstrap_port,
                                      "bootstrap_room": room, "rid": rid}
            if p.rank is not None:
                fields["disagg_prefill_dp_rank"] = p.rank
            legs = PairLegs(self, engine=p.engine, prefill=p, decodes=decodes, rid=rid, phase=Phase.WAITING,
                            early_headers_s=cfg.dispatch_timeout_s if streamed else 0.0,
                            abort_window_s=cfg.bootstrap_timeout_s)
            sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            task = self.spawn(self._send(p, path, splice(body, fields), sent))
            done, _ = await asyncio.wait({sent, task}, timeout=cfg.dispatch_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if sent in done and not task.done():
                legs.prefill_task = task
                task.add_done_callback(legs.prefill_finished)
                legs.watchdog = self.spawn(legs._watch(cfg.bootstrap_timeout_s))
                decode_fields = dict(fields)
                if d_info.rank is not None:
                    decode_fields.update(engines.adapter(d_info.engine).rank_body(d_info.rank))
                return PairResult(legs, splice(body, decode_fields), {}, cand, decode, attempt > 0)
            task.cancel()
            PD_FAILURES.labels(p.engine, "prefill", "dispatch").inc()
            log.warning("PD prefill %s not reachable (%s); %s", p.id, _why(task, sent),
                        "re-picking the pair" if attempt == 0 else "giving up on PD for this request")
        return None

    async def _send(self, target: TargetInfo, path: str, body: bytes, sent: asyncio.Future[None]) -> int:
        """The prefill leg; its answer is drained and dropped (the client gets the decode's)."""
        with self._counted(target):
            async with self.post(target, path, data=body, headers={"content-type": "application/json"},
                                 trace_request_ctx={"sent": sent}) as resp:
                await resp.read()
                return resp.status

    def _counted(self, target: TargetInfo) -> contextlib.AbstractContextManager[None]:
        return self.leg(target.slot) if self.leg is not None else contextlib.nullcontext()

    # -- vLLM -----------------------------------------------------------------------------------------------

    async def vllm(self, plan: PdPlan, pair: Pair, body: bytes, doc: Mapping[str, Any], path: str,
                   changes: Mapping[str, Any]) -> PairResult | None:
        cfg = plan.cfg
        decode = pair.decode.chosen
        d_info = pair.targets[decode.id]
        request_id = f"cortex-{uuid.uuid4().hex}"
        for attempt, cand in enumerate(pair.prefill.order[:2]):
            p = pair.targets[cand.id]
            headers = {"content-type": "application/json", "x-request-id": request_id}
            if p.rank is not None:
                headers.update(engines.adapter(p.engine).rank_headers(p.rank))
            t0 = time.monotonic()
            try:
                with self._counted(p):
                    async with self.post(p, path, data=orjson.dumps(
                            vllm_prefill_body(doc, changes)), headers=headers,
                            timeout=aiohttp.ClientTimeout(total=cfg.prefill_timeout_s)) as resp:
                        raw = await resp.read()
                        status = resp.status
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                status, raw = 0, repr(exc).encode()
            if 200 <= status < 300:
                PD_LEG_SECONDS.labels(p.engine, "prefill").observe(time.monotonic() - t0)
                try:
                    answer = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    answer = {}
                params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                if not isinstance(params, dict):
                    # The decoder prefills locally (correct, only slower); SMG counts the same case.
                    PD_FAILURES.labels(p.engine, "prefill", "no_transfer_params").inc()
                legs = PairLegs(self, engine=p.engine, prefill=p, decodes=[d_info], rid=request_id,
                                phase=Phase.PREFILLED)
                fields = {**changes, "kv_transfer_params": params}
                return PairResult(legs, splice(body, fields), {"x-request-id": request_id}, cand, decode,
                                  attempt > 0)
            PD_FAILURES.labels(p.engine, "prefill", "dispatch" if status == 0 else f"http_{status // 100}xx").inc()
            log.warning("PD prefill %s failed (%s); %s", p.id, status or raw[:200].decode(errors="replace"),
                        "re-picking the pair" if attempt == 0 else "giving up on PD for this request")
        return None


def _why(task: asyncio.Task[int], sent: asyncio.Future[None]) -> str:
    if not task.done():
        return "not accepted within the dispatch timeout"
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    return repr(exc) if exc is not None else f"HTTP {task.result()} before the decode was sent"


async def _mark_sent(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    fut = (ctx.trace_request_ctx or {}).get("sent")
    if fut is not None and not fut.done():
        fut.set_result(None)
