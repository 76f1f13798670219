"""The ext_proc gRPC server: Envoy's per-request message stream in, a plan, header and body mutations out.

The router hands back one plan per request (extproc/plan.py); acting on it is the phases' beside this module:
extproc/acting.py (commit, Envoy's mutations), extproc/pd_act.py (the PD legs, the fallback of a failed pair),
extproc/responses.py (the response-headers phase), extproc/room_glue.py (the waiting room), all built with
extproc/answers.py. It never asks the router for another decision. The process around it is extproc/serve.py.

One stream per HTTP request (envoy-extproc.md §1): request headers (answered at once; Envoy sends the
body without waiting), the buffered request body (parse, route, answer with the pool and the ordered
endpoint list, or an immediate OpenAI-style error), then the response headers (stamp the x-cortex-*
headers for the worker that really served, which differs from the first choice after a retry). The
stream stays open until the HTTP request ends, so the in-flight count is released in `finally`.

The stream's framing and phase order are a sans-IO machine (extproc/stream.py): `process` is its transport,
turning each ProcessingRequest into an event and performing the actions the machine returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import replace
from typing import Any

import grpc
import orjson
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.duration_pb2 import Duration

from cortex import observation
from cortex.api_paths import EXPLAIN_PATH, HEALTH_PATH, MODELS_PATH, TOKENIZER_PATHS
from cortex.config import CortexConfig
from cortex.errors import ClientError
from cortex.piecewise.segment_encoder import SegmentEncoder
from extproc import (
    epp,
    gateway_mode,
    inference_paths,
    isolation,
    metrics,
    pd_act,
    request_head,
    responses,
    route_explain,
    stream,
    structured_output,
)
from extproc.acting import Acting
from extproc.admission import Admission, refusal
from extproc.answers import (
    EMPTY_HEADERS,
    as_answer,
    error,
    immediate,
    observe_facts,
    prompt_facts,
    tenant_facts,
    usage_options,
)
from extproc.cluster_view import ClusterView
from extproc.pd_dispatch import splice
from extproc.prepare import NoWorker
from extproc.registry import ModelRegistry
from extproc.room_glue import RoomGlue
from extproc.router import Router
from extproc.snapshot import Source
from extproc.stream_state import (
    Admitted,
    DecodeFallback,
    HoldHeaders,
    PendingPair,
    PoolFacts,
    StreamIO,
    StreamState,
    Waiting,
)
from extproc.tenants import Tenant

log = logging.getLogger("cortex.extproc")


UPKEEP_S = 0.1
"""Upkeep cadence (view refresh, prediction expiry) while requests flow (extproc/serve.py)."""


class ExtProc:
    def __init__(self, source: Source, cluster: ClusterView, router: Router, admission: Admission,
                 picker: bool = False) -> None:
        self.mode = gateway_mode.of(picker)
        """The gateway it answers (extproc/gateway_mode.py): `picker`, `cortex epp`'s, one Cortex did not configure."""
        self.act = Acting(source, cluster, router, self.mode)
        """Commits a request to a worker and maps its plan onto Envoy's answer (shared with the phases beside)."""
        self.source = source
        """The config generation in force (the router reads the same reference)."""
        self.cluster = cluster
        self.router = router
        self.breakers = router.breakers
        self.pd = self.act.pd
        self.last_stream_at = 0.0
        """When the latest ext_proc stream (one per request) began (monotonic)."""
        self.admission = admission
        self.max_hold_s = self.cfg.longest_extproc_hold_s()
        """Envoy's max_message_timeout, fixed when Envoy started: a reload cannot lengthen a wait past it."""
        self.room_glue = RoomGlue(self.act, self.max_hold_s)
        self.room = self.room_glue.room
        """Requests waiting for a worker with room: this process's own (docs/tenancy/waiting-room.md)."""

    @property
    def cfg(self) -> CortexConfig:
        return self.source.current.cfg

    def reload(self, cfg: CortexConfig, registry: ModelRegistry, encoders: dict[int, SegmentEncoder]) -> None:
        self.router.reload(cfg, registry, encoders)  # swaps the one Source both read
        logging.getLogger("cortex.config").info("config reloaded: %d models, %d aliases", len(cfg.models),
                                                len(cfg.aliases))

    # -- the gRPC method ----------------------------------------------------------------------------------

    async def process(self, requests: Any, context: grpc.aio.ServicerContext | None,
                      st: StreamState | None = None) -> Any:
        """The transport of one stream: each ProcessingRequest becomes an event for its machine
        (extproc/stream.py), each action it returns is performed here; what came of an action goes back in. `st`:
        the stream's state, for a caller that reads it (the HTTP exchange, extproc/http_transport.py)."""
        st = st if st is not None else StreamState(gen=self.source.current)
        now = time.monotonic()
        self.last_stream_at = now
        if now - self.cluster.refreshed_at > UPKEEP_S:
            # The upkeep is on its idle cadence: bring the view up to date before routing on it.
            try:
                self.cluster.refresh()
            except Exception:
                log.exception("view refresh before a request failed; the upkeep retries")
        cfg = self.source.current.cfg if st.gen is None else st.gen.cfg
        machine: stream.Stream[pb.ProcessingResponse] = stream.Stream(stream.Limits(
            cfg.extproc.max_body_bytes, cfg.extproc.message_timeout_ms / 1000, self.max_hold_s))
        io = StreamIO()
        try:
            async for req in requests:
                event = self._event(st, io, req)
                if event is None:
                    continue
                async with contextlib.aclosing(self._perform(st, io, machine, machine.feed(event))) as outs:
                    async for out in outs:
                        yield out
        finally:
            # Runs on a clean end, on cancellation and on GeneratorExit: the request is over either way.
            for action in machine.feed(stream.Closed()):
                if isinstance(action, stream.Release):
                    self._release(st)

    def _event(self, st: StreamState, io: StreamIO,
               req: Any) -> stream.Event[pb.ProcessingResponse] | None:
        """Decode one ProcessingRequest into the machine's event (the headers phases ask the decision core here:
        nothing precedes their decision)."""
        which = req.WhichOneof("request")
        if which == "request_headers":
            duplex, duplex_out = epp.duplex_modes(req)
            answer = self.on_request_headers(st, req.request_headers, self.mode.subset(req))
            return stream.RequestHeaders(as_answer(answer), req.request_headers.end_of_stream, duplex, duplex_out)
        if which == "request_body":
            return stream.RequestBody(req.request_body.body, req.request_body.end_of_stream)
        if which == "request_trailers":
            return stream.RequestTrailers()
        if which == "response_headers":
            io.response = req
            if st.pd is not None:
                st.pd.legs.headers_arrived()  # aborts of the decode wait until extproc answered
            answer = responses.on_response_headers(self.act, st, req)
            return stream.ResponseHeaders(self._response_outcome(st, io, answer), time.monotonic())
        if which == "response_body":
            return stream.ResponseBody(req.response_body.body, req.response_body.end_of_stream)
        if which == "response_trailers":
            return stream.ResponseTrailers()
        return None

    def _body_outcome(self, io: StreamIO, answer: pb.ProcessingResponse | PendingPair | Waiting
                      ) -> stream.Answer[pb.ProcessingResponse] | stream.Wait | stream.Pair:
        if isinstance(answer, Waiting):
            io.seat = answer.entry.payload
            return stream.Wait(ready=io.seat.answer.done())
        if isinstance(answer, PendingPair):
            io.pending = answer
            return stream.Pair(answer.wait_s)
        return as_answer(answer)

    def _response_outcome(self, st: StreamState, io: StreamIO,
                          answer: pb.ProcessingResponse | DecodeFallback | HoldHeaders
                          ) -> stream.Answer[pb.ProcessingResponse] | stream.Hold | stream.Fallback:
        if isinstance(answer, HoldHeaders):
            return stream.Hold(answer.until)
        if isinstance(answer, DecodeFallback):
            io.fallback = answer
            assert st.pd_pending is not None
            return stream.Fallback(st.pd_pending.plan.cfg.fallback_timeout_s)
        return as_answer(answer)

    async def _perform(self, st: StreamState, io: StreamIO, machine: stream.Stream[pb.ProcessingResponse],
                       actions: list[stream.Action[pb.ProcessingResponse]]) -> Any:
        """Perform the machine's actions in order, feeding back what the awaited ones came to."""
        todo = deque(actions)
        while todo:
            action = todo.popleft()
            more: list[stream.Action[pb.ProcessingResponse]] = []
            match action:
                case stream.Send():
                    yield action.answer
                case stream.SendSplit():
                    for part in epp.split_body_answer(action.headers or EMPTY_HEADERS, action.answer, action.body,
                                                      action.end_of_stream):
                        yield part
                case stream.Refuse():
                    yield error(ClientError(action.status, action.message), st)
                case stream.Extend():
                    yield pb.ProcessingResponse(override_message_timeout=Duration(seconds=action.seconds))
                case stream.Decide():
                    more = machine.feed(stream.Decided(self._body_outcome(io, self.on_request_body(st, action.body))))
                case stream.AwaitRoom():
                    assert io.seat is not None
                    released = await io.seat.answer
                    outcome = self._body_outcome(io, released)
                    assert not isinstance(outcome, stream.Wait)  # a released request is never sent back in
                    more = machine.feed(stream.Released(outcome))
                case stream.StartPair():
                    assert io.pending is not None
                    started = await pd_act.start_pair(self.act, st, io.pending)
                    more = machine.feed(stream.PairStarted(as_answer(started)))
                case stream.HoldHeaders():
                    assert st.pd is not None and io.response is not None
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(st.pd.legs.settled.wait(), action.wait_s)
                    settled = self._response_outcome(st, io, pd_act.settled(self.act, st, io.response))
                    assert not isinstance(settled, stream.Hold)
                    more = machine.feed(stream.Settled(settled))
                case stream.StartFallback():
                    assert io.fallback is not None and io.response is not None
                    done = await pd_act.decode_fallback(self.act, st, io.response, io.fallback)
                    more = machine.feed(stream.FallbackDone(as_answer(done)))
                case stream.Stamp():
                    if st.pd is not None:
                        # After an immediate response, Envoy resets the decode itself; the abort follows once
                        # Envoy took that answer. Otherwise a failed pair's decode must not wait for a KV that
                        # never comes.
                        st.pd.legs.release_abort(delay_s=action.abort_delay_s)
                    assert io.response is not None
                    structured_output.ask_for_body(action.answer, st.answer_schema, io.response.response_headers,
                                                   self.act.cfg_of(st).extproc.max_body_bytes)
                    yield action.answer
                case stream.Echo():
                    yield epp.echo_response_chunk(action.data, action.end_of_stream)
                case stream.AckResponseBody():
                    if st.answer_schema is not None:  # sent only when ask_for_body asked for it
                        structured_output.check_answer(st.answer_schema, action.data)
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                case stream.AckTrailers():
                    if action.which == "request":
                        yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                    else:
                        yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
                case stream.Release():
                    self._release(st)
            todo.extendleft(reversed(more))

    def _release(self, st: StreamState) -> None:
        """What the request held, let go once (a clean end, the client gone, or a cancelled stream)."""
        if st.released:
            return
        st.released = True
        if st.waiting is not None and self.room.cancel(st.waiting):
            self.room_glue.changed()  # the client left while it waited
        if st.counted_slot is not None:
            self.router.let_go(st.counted_slot)
        self.router.settle(st.queued)
        if st.pd is not None:
            st.pd.legs.release_abort()  # the client left while the decode's headers were held
            st.pd.legs.event("stream_end")
        self.admission.release(st.ticket)
        self.breakers.release(st.trial)
        if st.counted_slot is not None and self.room:
            try:
                self.wake()  # a worker may have room for a waiting request now
            except Exception:
                log.exception("waiting room wake-up failed; the upkeep retries")

    # -- phases ---------------------------------------------------------------------------------------------

    def on_request_headers(self, st: StreamState, headers: Any,
                           subset: tuple[str, ...] | None = None) -> pb.ProcessingResponse:
        gen = self.act.gen_of(st)  # pinned when the stream began
        st.head = head = request_head.read(
            ((h.key, h.raw_value or h.value.encode()) for h in headers.headers.headers), gen.tenants.header,
            gen.cfg.session.headers, self.mode.test_selection(gen.cfg), subset)
        if head.method == "GET" and head.path == HEALTH_PATH:
            # Answered here, so a 200 proves the whole chain Envoy -> extproc works.
            return immediate(200, orjson.dumps({"status": "ok", "ledger_view": self.cluster.synced}))
        try:
            st.tenant = gen.tenants.identify(head.authorization, head.tenant_value)
            if head.llmd is not None:
                st.priority = epp.priority_of(head.llmd, gen.cfg.admission.objectives)
        except ClientError as exc:  # before any routing work
            metrics.ADMISSION_REJECTIONS.labels("", "unauthenticated").inc()
            return error(exc, st)
        if head.method == "GET" and head.path == MODELS_PATH:
            return immediate(200, gen.registry.models_body)
        inference = head.method == "POST" and head.path in inference_paths.PATHS
        # Every request a worker will see is admitted, before Envoy has even buffered a body: the rate and
        # concurrency limits hold on /tokenize, stored responses and the rest as on the inference paths (a limit
        # that held only there would be one a client walks around). Token limits settle on inference usage.
        try:
            st.ticket = self.admission.admit(st.tenant)
        except ClientError as exc:
            return error(exc, st)
        wants_body = inference or (head.method == "POST" and head.path in TOKENIZER_PATHS) or (
            head.method == "POST" and head.path == EXPLAIN_PATH and gen.cfg.extproc.public_route_explain)
        if wants_body and headers.end_of_stream:
            return error(ClientError(400, "request body is required"), st)
        if not wants_body:
            # Not an inference request: no body work, least-loaded worker of the whole fleet.
            self.act.route_any(st)
            return self.act.routing_response(st, "request_headers")
        return EMPTY_HEADERS

    def on_request_body(self, st: StreamState, body: bytes) -> pb.ProcessingResponse | PendingPair | Waiting:
        gen = self.act.gen_of(st)  # pinned when the stream began
        explain = st.head.path == EXPLAIN_PATH and gen.cfg.extproc.public_route_explain
        spec = inference_paths.PATHS.get(st.head.path)
        if spec is None and not explain:
            if st.head.method == "POST" and st.head.path in TOKENIZER_PATHS:
                return self.act.tokenizer_body(st, body)
            return self.act.unrouted_body(st, body)
        if st.head.test_pick is not None:
            return self.act.test_pick(st, st.head.test_pick)
        try:
            if explain:
                return self._explain(st, body)
            assert spec is not None
            st.admitted = admitted = self._admit(st, spec, body)
        except ClientError as exc:
            return error(exc, st)
        except Exception:  # never fail the request because routing failed: Envoy's balancing takes it
            return self._undecided(st, body)
        model = admitted.parsed.model
        if self.room.waiting(model) and gen.cfg.admission.waiting_room.enabled:
            return self._wait(st, model)  # behind the requests already waiting for it
        return self.route(st)

    def _admit(self, st: StreamState, spec: inference_paths.InferencePath, body: bytes) -> Admitted:
        """Parse the body, apply llm-d's model rewrite and the tenant's isolation salt, check a structured-output
        schema: once per request, whether it is routed now or after waiting."""
        t0 = time.perf_counter()
        gen = self.act.gen_of(st)
        registry = gen.registry
        parsed = inference_paths.parse(spec.path, body, registry)
        rewritten = False
        if st.head.llmd is not None and (target := st.head.llmd.get(epp.REWRITE)):
            # llm-d's model rewrite: the body names the target from here on (what routing and the worker see).
            body = splice(body, {"model": target})
            parsed = inference_paths.parse(spec.path, body, registry)
            rewritten = True
        parsed.session_key = st.head.session
        salted = isolation.isolate(parsed, st.tenant)  # before routing: Cortex's keys follow the salt
        schema = structured_output.check_request(gen.cfg.structured_output, parsed, registry)
        return Admitted(spec, parsed, body, salted, rewritten, schema, time.perf_counter() - t0)

    def _undecided(self, st: StreamState, body: bytes) -> pb.ProcessingResponse:
        log.exception("routing failed; request continues on the fallback route")
        metrics.INTERNAL_ERRORS.inc()
        st.fallback_reason = "extproc_error"
        return self.act.undecided(st, body)

    def route(self, st: StreamState, released: bool = False) -> pb.ProcessingResponse | PendingPair | Waiting:
        """Decide an admitted request (`st.admitted`) and act on the decision. `released`: it comes out of the
        waiting room (decided anew on the view as it is now, and never sent back in)."""
        admitted = st.admitted
        assert admitted is not None  # the body phase admits before it routes
        gen = self.act.gen_of(st)
        parsed, body = admitted.parsed, admitted.body
        t0 = time.perf_counter()
        try:
            result = self.router.decide(parsed, gen=gen)  # committed below, once nothing holds or refuses it
        except NoWorker as exc:
            if released or not gen.cfg.admission.waiting_room.enabled:
                return error(exc, st)
            # Scale from zero: it waits for a worker to appear.
            self.room_glue.facts[parsed.model] = PoolFacts(exc.model, frozenset(), frozenset())
            return self._wait(st, parsed.model)
        except ClientError as exc:
            return error(exc, st)
        except Exception:  # never fail the request because routing failed: Envoy's balancing takes it
            return self._undecided(st, body)
        # Whatever commits the request to a worker (the plan's effects, counts, reservations) comes after this: a
        # waiting request is decided again when it is released, a refused one never commits.
        if st.head.subset is not None and (result.pd is None or result.pd.pair is None):
            narrowed = epp.within(result.decision, st.head.subset)
            if narrowed is None:
                return error(refusal(st.tenant.id if st.tenant else "", "no_endpoints", 503,
                                     "None of the endpoints the gateway allows serves this model.", 1), st)
            # A new plan (a plan is never changed); another worker than the one the effects name: only the hot
            # flags are still true.
            effects = result.effects if narrowed.chosen.slot == result.decision.chosen.slot else \
                result.effects.flags_only()
            result = replace(result, decision=narrowed, effects=effects)
        if not released and self.room_glue.must_wait(parsed.model, result):
            return self._wait(st, parsed.model)
        metrics.observe_decision(result, admitted.parse_s + time.perf_counter() - t0, self.cluster.block_size)
        if st.ticket is not None:
            try:
                output = parsed.max_output
                self.admission.reserve(st.ticket, result.prompt_tokens + parsed.more_prompt_tokens,
                                       result.decision.hit_tokens,
                                       output if output is not None else gen.cfg.admission.default_max_tokens)
            except ClientError as exc:
                return error(exc, st)
        st.queued = self.router.commit(result)
        # Every worker gets the salt: single, both PD legs, the fallback.
        changes = {**result.changes, **admitted.salted}
        plan = result.pd
        if plan is not None and plan.pair is not None:
            return PendingPair(result, plan, parsed.body or {}, body, changes, plan.cfg.start_budget_s(plan.engine))
        if plan is not None:
            st.pd_note = f"skipped:{plan.skip}"
            metrics.PD_DECISIONS.labels(plan.engine, st.pd_note).inc()
        injected = None
        observe = gen.cfg.observe
        if admitted.spec.stream_options and observe.enabled and observe.stream_usage:
            injected = usage_options(parsed.stream, parsed.body)
        if injected is not None:
            changes = {**changes, "stream_options": injected}
        response = self.act.single(st, result.decision, result.model, body, changes)
        observe_facts(response, {observation.MODEL: result.model, observation.STREAM: parsed.stream,
                                 observation.USAGE_INJECTED: injected is not None, **prompt_facts(result),
                                 **tenant_facts(st)})
        return response

    def _explain(self, st: StreamState, body: bytes) -> pb.ProcessingResponse:
        return route_explain.answer(self.act, st, body)

    def explain(self, body: bytes, tenant: Tenant | None, session_key: str | None, with_tokens: bool,
                path: str | None = None) -> bytes:
        """Route explain (extproc/route_explain.py): the decision this request would get, nothing committed."""
        return route_explain.explain(self.act, body, tenant, session_key, with_tokens, path)

    async def explain_http(self, request: web.Request) -> web.Response:
        return await route_explain.explain_http(self.act, request)

    def _wait(self, st: StreamState, pool: str) -> pb.ProcessingResponse | Waiting:
        """Seat the request in the waiting room, then wake it: load may have fallen since the last wake, so the
        head (maybe this one) goes at once."""
        seated = self.room_glue.enter(st, pool)
        if isinstance(seated, Waiting):
            self.wake()
        return seated

    def wake(self) -> None:
        """Expire what waits in the room and route what it releases (RoomGlue.releases), each decided anew from what its
        stream admitted, `st.admitted` (released: never sent back in)."""
        releases = self.room_glue.releases()
        with contextlib.suppress(StopIteration):
            seat = next(releases)
            while True:
                try:
                    answer = self.route(seat.st, released=True)
                except Exception:  # released from the room, it is answered whatever failed: the gateway's fallback
                    answer = self._undecided(seat.st, seat.st.admitted.body if seat.st.admitted else b"")
                seat = releases.send(answer)
