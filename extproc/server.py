"""The ext_proc gRPC server: Envoy's per-request message stream in, a plan, header and body mutations out.

The router hands back one plan per request (extproc/plan.py); this module only maps it onto Envoy's mutations,
runs the PD legs it names (extproc/pd_dispatch.py) and, when a pair fails before the client got a byte, serves
the plan's precomputed fallback. It never asks the router for another decision.

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
import signal
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
from aiohttp import web
from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration

from cortex import api_paths, breaker_status, engines, extproc_tls, grpc_health, observation
from cortex import headers as H
from cortex.api_paths import EXPLAIN_PATH, HEALTH_PATH, MODELS_PATH, TENANT_VIEW_HEADER, explain_socket
from cortex.config import CortexConfig
from cortex.config_watch import ConfigWatcher
from cortex.envoy_config import ANY_CLUSTER, pool_cluster
from cortex.errors import ClientError
from cortex.piecewise_tokenize import SegmentEncoder
from cortex.tenancy.board import TenancyBoard
from cortex.upstream_tls import WorkerTls
from extproc import epp, inference_paths, isolation, metrics, response_ids, stream, structured_output
from extproc.admission import Admission, refusal
from extproc.answers import (
    EMPTY_BODY,
    EMPTY_HEADERS,
    as_answer,
    claim_facts,
    error,
    header,
    headers_answer,
    immediate,
    observe_claim,
    observe_facts,
    prompt_facts,
    set_body,
    status_of,
    tenant_facts,
    usage_options,
)
from extproc.breaker import State as BreakerState
from extproc.cluster_view import ClusterView, derived_load
from extproc.pd_dispatch import PdDispatcher, Phase, splice
from extproc.plan import RoutePlan
from extproc.policies import session
from extproc.policies.base import EXACT, LOAD_AWARE, Decision, active_of
from extproc.policies.explain import parts as explain_parts
from extproc.policies.transparent import REASON as TRANSPARENT
from extproc.prepare import NoWorker
from extproc.registry import ModelRegistry
from extproc.router import Router
from extproc.snapshot import Source
from extproc.stream_state import (
    DecodeFallback,
    HoldHeaders,
    PendingPair,
    PoolFacts,
    Seat,
    StreamIO,
    StreamState,
    Waiting,
)
from extproc.tenants import Tenant
from extproc.waiting_room import Entry, WaitingRoom, full

log = logging.getLogger("cortex.extproc")


# The event that failed a pair -> the x-cortex-pd fallback reason.
_FALLBACK_WHY = {"watchdog": "bootstrap_timeout", "prefill_failed": "prefill_failed", "decode_failed": "decode_failed"}
# Hop-by-hop or recomputed by Envoy: never copied from the fallback worker's answer.
_NOT_COPIED = frozenset({"content-length", "transfer-encoding", "content-encoding", "connection", "keep-alive",
                         "date", "server"})
UPKEEP_S = 0.1
"""Upkeep cadence (view refresh, prediction expiry) while requests flow."""
IDLE_UPKEEP_S = 1.0
"""Upkeep cadence once no request came for IDLE_AFTER_S: the first request after a pause refreshes the view
itself if the last refresh is older than UPKEEP_S (docs/performance.md, "What an idle replica costs")."""
IDLE_AFTER_S = 2.0



class ExtProc:
    def __init__(self, source: Source, cluster: ClusterView, router: Router, admission: Admission,
                 picker: bool = False) -> None:
        self.picker = picker
        """`cortex epp`: the endpoint picker of a gateway Cortex did not configure (extproc/epp.py)."""
        self.source = source
        """The config generation in force (the router reads the same reference)."""
        self.cluster = cluster
        self.router = router
        # Acting on a plan reports what was sent where, as the in-flight board does: a fallback that serves
        # records the prompt's blocks as predicted on its worker.
        self.predictions = router.predictions
        # The answers it sees feed the workers' breakers, which the router's decisions read.
        self.breakers = router.breakers
        self.pd = PdDispatcher(cluster.inflight, WorkerTls(self.cfg.upstream_tls))
        self.last_stream_at = 0.0
        """When the latest ext_proc stream (one per request) began (monotonic)."""
        self.admission = admission
        wr = self.cfg.admission.waiting_room
        self.room: WaitingRoom[Seat] = WaitingRoom(wr.max_requests, wr.max_bytes)
        """Requests waiting for a worker with room: this process's own (docs/tenancy/waiting-room.md)."""
        self.room_facts: dict[str, PoolFacts] = {}
        self.max_hold_s = self.cfg.longest_extproc_hold_s()
        """Envoy's max_message_timeout, fixed when Envoy started: a reload cannot lengthen a wait past it."""
        self._bands: set[int] = set()

    @property
    def cfg(self) -> CortexConfig:
        return self.source.current.cfg

    def reload(self, cfg: CortexConfig, registry: ModelRegistry, encoders: dict[int, SegmentEncoder]) -> None:
        self.router.reload(cfg, registry, encoders)  # swaps the one Source both read
        logging.getLogger("cortex.config").info("config reloaded: %d models, %d aliases", len(cfg.models),
                                                len(cfg.aliases))

    # -- the gRPC method ----------------------------------------------------------------------------------

    async def process(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        """The transport of one stream: each ProcessingRequest becomes an event for its machine
        (extproc/stream.py), each action it returns is performed here; what came of an action goes back in."""
        st = StreamState(gen=self.source.current)
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
            if self.picker:
                st.subset = epp.subset_of(req.metadata_context)
            answer = self.on_request_headers(st, req.request_headers)
            return stream.RequestHeaders(as_answer(answer), req.request_headers.end_of_stream, duplex, duplex_out)
        if which == "request_body":
            return stream.RequestBody(req.request_body.body, req.request_body.end_of_stream)
        if which == "request_trailers":
            return stream.RequestTrailers()
        if which == "response_headers":
            io.response = req
            if st.pd is not None:
                st.pd.legs.headers_arrived()  # aborts of the decode wait until extproc answered
            return stream.ResponseHeaders(self._response_outcome(st, io, self.on_response_headers(st, req)),
                                          time.monotonic())
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
                    more = machine.feed(stream.PairStarted(as_answer(await self._pd_pair(st, io.pending))))
                case stream.HoldHeaders():
                    assert st.pd is not None and io.response is not None
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(st.pd.legs.settled.wait(), action.wait_s)
                    settled = self._response_outcome(st, io, self._pd_settled(st, io.response))
                    assert not isinstance(settled, stream.Hold)
                    more = machine.feed(stream.Settled(settled))
                case stream.StartFallback():
                    assert io.fallback is not None and io.response is not None
                    done = await self._decode_fallback(st, io.response, io.fallback)
                    more = machine.feed(stream.FallbackDone(as_answer(done)))
                case stream.Stamp():
                    if st.pd is not None:
                        # After an immediate response, Envoy resets the decode itself; the abort follows once
                        # Envoy took that answer. Otherwise a failed pair's decode must not wait for a KV that
                        # never comes.
                        st.pd.legs.release_abort(delay_s=action.abort_delay_s)
                    assert io.response is not None
                    structured_output.ask_for_body(action.answer, st.answer_schema, io.response.response_headers,
                                                   (st.gen or self.source.current).cfg.extproc.max_body_bytes)
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
            self._room_changed()  # the client left while it waited
        if st.counted_slot is not None:
            self.cluster.inflight.dec(st.counted_slot)
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

    def on_request_headers(self, st: StreamState, headers: Any) -> pb.ProcessingResponse:
        gen = st.gen or self.source.current  # pinned when the stream began
        tenant_header = gen.tenants.header
        authorization = tenant_value = None
        session_headers = gen.cfg.session.headers
        sessions: dict[str, str] = {}
        for h in headers.headers.headers:
            key = h.key
            if key == ":path":
                path = (h.raw_value or h.value.encode()).decode("latin-1")
                st.path, _, st.query = path.partition("?")
            elif key == ":method":
                st.method = (h.raw_value or h.value.encode()).decode("latin-1")
            elif key == "authorization":
                authorization = (h.raw_value or h.value.encode()).decode("latin-1")
            elif key == tenant_header:
                tenant_value = (h.raw_value or h.value.encode()).decode("latin-1")
            elif key in session_headers:
                sessions[key] = (h.raw_value or h.value.encode()).decode("utf-8", "replace")
            elif key in epp.LLMD_HEADERS:
                if st.llmd is None:
                    st.llmd = {}
                epp.llmd_value(st.llmd, key, (h.raw_value or h.value.encode()).decode("utf-8", "replace").strip())
            elif key == epp.TEST_SELECTION and self.picker and gen.cfg.epp.conformance_test:
                st.test_pick = (h.raw_value or h.value.encode()).decode("latin-1")
        if st.llmd is not None and tenant_value is None:
            tenant_value = epp.fairness_tenant(st.llmd, tenant_header)
        if st.method == "GET" and st.path == HEALTH_PATH:
            # Answered here, so a 200 proves the whole chain Envoy -> extproc works.
            return immediate(200, orjson.dumps({"status": "ok", "ledger_view": self.cluster.synced}))
        try:
            st.tenant = gen.tenants.identify(authorization, tenant_value)
            if st.llmd is not None:
                st.priority = epp.priority_of(st.llmd, gen.cfg.admission.objectives)
        except ClientError as exc:  # before any routing work
            metrics.ADMISSION_REJECTIONS.labels("", "unauthenticated").inc()
            return error(exc, st)
        if sessions:  # the first configured header present and not blank
            st.session = next((k for n in session_headers if (k := session.key_of(sessions.get(n)))), None)
        if st.method == "GET" and st.path == MODELS_PATH:
            return immediate(200, gen.registry.models_body)
        inference = st.method == "POST" and st.path in inference_paths.PATHS
        # Every request a worker will see is admitted, before Envoy has even buffered a body: the rate and
        # concurrency limits hold on /tokenize, stored responses and the rest as on the inference paths (a limit
        # that held only there would be one a client walks around). Token limits settle on inference usage.
        try:
            st.ticket = self.admission.admit(st.tenant)
        except ClientError as exc:
            return error(exc, st)
        wants_body = inference or (st.method == "POST" and st.path == EXPLAIN_PATH and
                                   gen.cfg.extproc.public_route_explain)
        if wants_body and headers.end_of_stream:
            return error(ClientError(400, "request body is required"), st)
        if not wants_body:
            # Not an inference request: no body work, least-loaded worker of the whole fleet.
            self._route_any(st)
            return self._routing_response(st, "request_headers")
        return EMPTY_HEADERS

    def on_request_body(self, st: StreamState, body: bytes,
                        released: bool = False) -> pb.ProcessingResponse | PendingPair | Waiting:
        """`released`: it comes out of the waiting room (routed anew, and never sent back in)."""
        gen = st.gen or self.source.current  # pinned when the stream began
        explain = st.path == EXPLAIN_PATH and gen.cfg.extproc.public_route_explain
        spec = inference_paths.PATHS.get(st.path)
        if spec is None and not explain:
            return self._unrouted_body(st, body)
        t0 = time.perf_counter()
        if st.test_pick is not None:
            return self._test_pick(st, st.test_pick)
        try:
            if explain:
                return self._explain(st, body)
            assert spec is not None
            registry = gen.registry
            parsed = inference_paths.parse(spec.path, body, registry)
            if st.llmd is not None and (target := st.llmd.get(epp.REWRITE)):
                # llm-d's model rewrite: the body names the target from here on (what routing and the worker see).
                body = splice(body, {"model": target})
                parsed = inference_paths.parse(spec.path, body, registry)
                st.llmd.pop(epp.REWRITE)  # once: a request released from the waiting room comes through again
                st.rewritten = True
            parsed.session_key = st.session
            salted = isolation.isolate(parsed, st.tenant)  # before routing: Cortex's keys follow the salt
            st.answer_schema = structured_output.check_request(gen.cfg.structured_output, parsed,
                                                               gen.registry)
            if not released and self.room.waiting(parsed.model) and gen.cfg.admission.waiting_room.enabled:
                return self._enter_room(st, parsed.model, body)  # behind the requests already waiting for it
            result = self.router.route(parsed)
        except NoWorker as exc:
            if released or not gen.cfg.admission.waiting_room.enabled:
                return error(exc, st)
            # Scale from zero: it waits for a worker to appear.
            self.room_facts[parsed.model] = PoolFacts(exc.model, frozenset(), frozenset())
            return self._enter_room(st, parsed.model, body)
        except ClientError as exc:
            return error(exc, st)
        except Exception:  # never fail the request because routing failed: Envoy's balancing takes it
            log.exception("routing failed; request continues on the fallback route")
            metrics.INTERNAL_ERRORS.inc()
            st.fallback_reason = "extproc_error"
            return self._undecided(st, body)
        # Whatever commits the request to a worker (counts, reservations) comes after this: a waiting request comes
        # through here again when it is released.
        if st.subset is not None and (result.pd is None or result.pd.pair is None):
            narrowed = epp.within(result.decision, st.subset)
            if narrowed is None:
                return error(refusal(st.tenant.id if st.tenant else "", "no_endpoints", 503,
                                           "None of the endpoints the gateway allows serves this model.", 1), st)
            result = replace(result, decision=narrowed)  # a new plan: a plan is never changed
        if not released and self._must_wait(parsed.model, result):
            return self._enter_room(st, parsed.model, body)
        metrics.observe_decision(result, time.perf_counter() - t0, self.cluster.block_size)
        if st.ticket is not None:
            try:
                output = parsed.max_output
                self.admission.reserve(st.ticket, result.prompt_tokens + parsed.more_prompt_tokens,
                                       result.decision.hit_tokens,
                                       output if output is not None else gen.cfg.admission.default_max_tokens)
            except ClientError as exc:
                return error(exc, st)
        changes = {**result.changes, **salted}  # every worker gets the salt: single, both PD legs, the fallback
        plan = result.pd
        if plan is not None and plan.pair is not None:
            return PendingPair(result, plan, parsed.body or {}, body, changes, plan.cfg.start_budget_s(plan.engine))
        if plan is not None:
            st.pd_note = f"skipped:{plan.skip}"
            metrics.PD_DECISIONS.labels(plan.engine, st.pd_note).inc()
        injected = None
        observe = gen.cfg.observe
        if spec is not None and spec.stream_options and observe.enabled and observe.stream_usage:
            injected = usage_options(parsed.stream, parsed.body)
        if injected is not None:
            changes = {**changes, "stream_options": injected}
        response = self._single(st, result.decision, result.model, body, changes)
        observe_facts(response, {observation.MODEL: result.model, observation.STREAM: parsed.stream,
                            observation.USAGE_INJECTED: injected is not None, **prompt_facts(result),
                            **tenant_facts(st)})
        return response

    def _single(self, st: StreamState, decision: Decision, model: str, body: bytes,
                changes: dict[str, object]) -> pb.ProcessingResponse:
        st.decision = decision
        self._count(st, decision.chosen.slot)
        self.breakers.release(st.trial)
        st.trial = self.breakers.dispatched(decision.chosen.address, time.monotonic())
        response = self._routing_response(st, "request_body", pool_cluster(model))
        chosen = decision.chosen
        if chosen.rank is not None and (placed := engines.adapter(chosen.engine).rank_body(chosen.rank)):
            changes = {**changes, **placed}  # an engine that pins a DP rank from the body only (SGLang)
        if changes or st.rewritten:
            set_body(response, splice(body, changes))
        return response

    async def _pd_pair(self, st: StreamState, pending: PendingPair) -> pb.ProcessingResponse:
        """Send the prefill leg, then hand Envoy the decode leg; a pair that cannot start falls back to a worker
        that serves the request alone, or to a clear error when there is none."""
        result, plan, body, changes = pending.result, pending.plan, pending.body, pending.changes
        pair = plan.pair
        assert pair is not None
        try:
            if engines.adapter(plan.engine).pd_legs == "concurrent":
                started = await self.pd.sglang(plan, pair, body, st.path, changes)
            else:
                started = await self.pd.vllm(plan, pair, body, pending.doc, st.path, changes)
        except Exception:  # never fail the request because orchestration raised: a single worker takes it
            log.exception("PD dispatch failed")
            metrics.INTERNAL_ERRORS.inc()
            started = None
        if started is None:
            st.pd_note = "fallback:prefill_failed"
            metrics.PD_DECISIONS.labels(plan.engine, st.pd_note).inc()
            fallback = result.fallback
            if fallback is None:
                return error(ClientError(
                    502, f"prefill/decode pair for model `{result.model}` could not start: prefill worker(s) "
                         f"{', '.join(c.id for c in pair.prefill.order[:2])} failed and no worker serves the "
                         "model alone", reason="pd_prefill_failed"))
            # Nothing was sent to a decoder yet: Envoy serves the request on one worker, streaming as usual.
            decision = fallback.without(frozenset(pair.targets[c.id].worker for c in pair.prefill.order[:2]))
            self._predict(result, decision)
            return self._single(st, decision, result.model, body, changes)
        st.pd = started
        st.pd_pending = pending
        st.pd_note = "pair:repicked" if started.repicked else "pair"
        st.pd_prefill_decision = pair.prefill
        metrics.PD_DECISIONS.labels(plan.engine, st.pd_note).inc()
        # The decode leg: the decode pool's order, so a failed connect goes to the next decoder with the same room
        # or transfer params (the first never saw them); no retry on 5xx or reset (x-cortex-pd route).
        st.decision = pair.decode
        self._count(st, started.decode.slot)
        response = self._routing_response(st, "request_body", pool_cluster(result.model))
        common = response.request_body.response
        common.header_mutation.set_headers.append(header(H.PD_ROUTE, "1"))
        for k, v in started.decode_headers.items():
            common.header_mutation.set_headers.append(header(k, v))
        set_body(response, started.decode_body)
        observe_facts(response, {observation.MODEL: result.model, observation.STREAM: pending.doc.get("stream") is True,
                            observation.USAGE_INJECTED: False, **prompt_facts(result), **tenant_facts(st)})
        return response

    def _predict(self, result: RoutePlan, decision: Decision) -> None:
        """The fallback's worker is about to hold the prompt: siblings follow it (as a committed decision does)."""
        fallback = result.fallback
        if fallback is not None and fallback.keys and decision.chosen.ledger_trusted:
            self.predictions.record(decision.chosen.slot, fallback.keys)

    def on_response_headers(self, st: StreamState,
                            req: Any) -> pb.ProcessingResponse | DecodeFallback | HoldHeaders:
        served = epp.served(req)
        headers = []
        d = st.decision
        if not served and d is not None and st.sent == 1:
            served = d.chosen.address  # the only endpoint named: a retry can go nowhere else
        if st.pd is None:
            self._answered(st, req, served)
        if d is None:
            info = self.cluster.by_address.get(served)
            mode = "fallback_p2c"
            reason = st.fallback_reason or "routed_by_envoy"
            headers.append(header(H.CACHE_HIT_TOKENS, "0"))
            if info is not None:
                headers.append(header(H.ASSIGNED_WORKER, info.id))
        elif st.pd is not None:
            return self._pd_response_headers(st, req, served)
        else:
            chosen = d.chosen
            worker = chosen
            if not served and self.picker:
                # A gateway that says neither which endpoint served nor sends one endpoint only: the hit is not
                # proven (a retry may have gone to a fallback).
                headers += [header(H.ASSIGNED_WORKER, chosen.id), header(H.CACHE_HIT_TOKENS, "0"),
                            header(H.MATCH_MODE, d.mode), header(H.ROUTE_REASON, f"unconfirmed:{d.reason}")]
                return self._answer_headers(st, req, headers, served)
            if served and served != chosen.address:
                # Envoy retried on the next worker of the list: report what really happened.
                worker = next((c for c in d.order if c.address == served), chosen)
                if worker is not chosen:
                    self._count(st, worker.slot)
            mode, reason = d.mode, d.reason
            hit = d.hit_tokens if worker is chosen else 0
            if worker is not chosen:
                reason = f"retried:{reason}"
                mode = mode if mode != EXACT else LOAD_AWARE
            headers += [header(H.ASSIGNED_WORKER, worker.id), header(H.CACHE_HIT_TOKENS, str(hit))]
        headers += [header(H.MATCH_MODE, mode), header(H.ROUTE_REASON, reason)]
        if st.pd_note:
            headers.append(header(H.PD, st.pd_note))
        return self._answer_headers(st, req, headers, served)

    def _answered(self, st: StreamState, req: Any, served: str) -> None:
        """Feed the workers' breakers with this answer: the worker that served failed with a 5xx (its own, or Envoy's
        after a reset there); a first choice Envoy retried past failed too (a reset, a refused stream or a 5xx are
        the only causes of a retry). A PD pair's legs are judged by the pair's own handling (docs/pd.md)."""
        breakers = self.breakers
        now = time.monotonic()
        d = st.decision
        if d is not None and served and served != d.chosen.address:
            breakers.record(d.chosen.address, False, now)
        if served:
            breakers.record(served, not status_of(req).startswith(b"5"), now)
        breakers.release(st.trial)

    def _answer_headers(self, st: StreamState, req: Any, headers: list[HeaderValueOption],
                        served: str) -> pb.ProcessingResponse:
        response = headers_answer(st, req, headers, self.cfg.extproc.routing_headers)
        observe_claim(response, headers)
        if self.picker and self.cfg.epp.conformance_test:
            # The conformance suite checks where its request went (its verifier plugin's header).
            response.response_headers.response.header_mutation.set_headers.append(
                header(epp.TEST_SERVED, served or "fail: missing envoy lb metadata"))
        return response

    def _pd_response_headers(self, st: StreamState, req: Any,
                             served: str) -> pb.ProcessingResponse | DecodeFallback | HoldHeaders:
        pair, prefill = st.pd, st.pd_prefill_decision
        assert pair is not None and prefill is not None and st.decision is not None
        status = status_of(req)
        failed = not status.startswith(b"2")
        pair.legs.event("decode_failed" if failed else "decode_ok")
        if status.startswith(b"5") or (not failed and pair.legs.phase is Phase.FAILED):
            # A 4xx is the request's own fault: another worker would refuse it too. A 2xx from a pair that already
            # failed (its decode was aborted) would end early: that falls back too.
            fallback = self._pd_fallback(st)
            if fallback is not None:
                return fallback
        elif not failed and pair.legs.phase is Phase.DECODE_STARTED and st.pd_pending is not None:
            cfg = st.pd_pending.plan.cfg
            # The watchdog settles the pair by then; one second more covers its scheduling.
            return HoldHeaders(pair.legs.started + cfg.bootstrap_timeout_s + 1.0)
        return self._pd_pair_headers(st, req)

    def _pd_settled(self, st: StreamState, req: Any) -> pb.ProcessingResponse | DecodeFallback:
        """Held decode headers, once the prefill side is over: a failed pair falls back, a good one streams."""
        assert st.pd is not None
        if st.pd.legs.phase is Phase.FAILED:
            fallback = self._pd_fallback(st)
            if fallback is not None:
                return fallback
        return self._pd_pair_headers(st, req)

    def _pd_fallback(self, st: StreamState) -> DecodeFallback | None:
        """Seed 000 §2.4: a pair that failed before the first byte falls back to one worker from a cold start. The
        decoder(s) that answered are left out when others exist; so is the prefill worker when the pair failed
        on its side."""
        pair, pending = st.pd, st.pd_pending
        if pair is None or pending is None:
            return None
        why = _FALLBACK_WHY.get(pair.legs.failure, "decode_failed")
        exclude = {d.worker for d in pair.legs.decodes}
        if why != "decode_failed":
            exclude.add(pair.legs.prefill.worker)
        fallback = pending.result.fallback
        return DecodeFallback(why, fallback.without(frozenset(exclude))) if fallback is not None else None

    def _pd_pair_headers(self, st: StreamState, req: Any) -> pb.ProcessingResponse:
        pair, prefill = st.pd, st.pd_prefill_decision
        assert pair is not None and prefill is not None and st.decision is not None
        served = epp.served(req)
        decode = next((c for c in st.decision.order if c.address == served), pair.decode)
        if decode is not pair.decode:
            self._count(st, decode.slot)
        # The hit is the prefill side's: it computes the prompt, and both engines report its cached tokens in
        # the decode's usage. A re-picked prefill was not the one the ledger proved.
        hit = prefill.hit_tokens if not pair.repicked else 0
        mode = prefill.mode if not pair.repicked or prefill.mode != EXACT else LOAD_AWARE
        headers = [header(H.ASSIGNED_WORKER, f"prefill={pair.legs.prefill.id},decode={decode.id}"),
                   header(H.CACHE_HIT_TOKENS, str(hit)), header(H.MATCH_MODE, mode),
                   header(H.ROUTE_REASON, f"pd:{prefill.reason}"), header(H.PD, st.pd_note)]
        response = headers_answer(st, req, headers, self.cfg.extproc.routing_headers)
        if pair.legs.failure and not status_of(req).startswith(b"2"):
            # The pair failed and no single worker took over: the error (often Envoy's, for the decode leg Cortex
            # cut) says why in the pair's terms, for every caller.
            reason = f"pd_{_FALLBACK_WHY.get(pair.legs.failure, 'decode_failed')}"
            response.response_headers.response.header_mutation.set_headers.extend(
                [header(H.DROPPED_REASON, reason), header(H.LLMD_DROPPED_REASON, reason)])
        # The decode worker answers (and reports the usage); the pair's prefill is kept beside it.
        observe_facts(response, {**claim_facts(headers), observation.WORKER: decode.id,
                            observation.PREFILL: pair.legs.prefill.id})
        return response

    async def _decode_fallback(self, st: StreamState, req: Any, fb: DecodeFallback) -> pb.ProcessingResponse:
        """Serve a request whose pair failed before the client got a byte on one worker, from a cold start.

        Envoy cannot send a request upstream again once it answered (ext_proc has no restart), so extproc sends it
        itself, with the client's own body (no room, no transfer params), and answers with the worker's whole
        response as an immediate response: a streamed request gets its SSE events at once, at the end. One more
        worker is tried after a failed connect or a 5xx, as Envoy's route does. When none answers, the pair's
        own error goes to the client."""
        pending, pair = st.pd_pending, st.pd
        assert pending is not None and pair is not None
        plan = pending.plan
        st.pd_note = f"fallback:{fb.why}"
        metrics.PD_DECISIONS.labels(plan.engine, st.pd_note).inc()
        decision = fb.decision
        self._predict(pending.result, decision)
        timeout = aiohttp.ClientTimeout(total=plan.cfg.fallback_timeout_s, sock_connect=2.0)
        tried: set[str] = set()
        for cand in decision.order:
            if cand.address in tried or len(tried) == 2:
                continue
            tried.add(cand.address)
            self._count(st, cand.slot)
            changes = dict(pending.changes)
            headers = {"content-type": "application/json"}
            if cand.rank is not None:
                eng = engines.adapter(cand.engine)
                changes.update(eng.rank_body(cand.rank))
                headers.update(eng.rank_headers(cand.rank))
            target = self.cluster.by_address.get(cand.address)
            if target is None:  # left the fleet meanwhile: how to reach it (TLS or not) is no longer known
                continue
            try:
                async with self.pd.post(target, st.path, data=splice(pending.body, changes),
                                        headers=headers, timeout=timeout) as resp:
                    status, resp_headers = resp.status, resp.headers
                    body = await _read_capped(resp, self.cfg.extproc.max_body_bytes)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                log.warning("PD fallback on %s failed: %r", cand.id, exc)
                continue
            if status >= 500 or body is None:
                log.warning("PD fallback on %s answered HTTP %d%s", cand.id, status,
                            "" if body is not None else " larger than extproc.max_body_bytes")
                continue
            log.info("PD pair prefill=%s failed (%s); served alone on %s", pair.legs.prefill.id, fb.why, cand.id)
            chosen = cand is decision.chosen
            mode = decision.mode if chosen or decision.mode != EXACT else LOAD_AWARE
            shown = isolation.sees_routing(st.tenant)
            hidden = set() if shown else set(isolation.upstream_cortex_headers(k.lower() for k in resp_headers))
            out = [header(k.lower(), v) for k, v in resp_headers.items()
                   if k.lower() not in _NOT_COPIED and k.lower() not in hidden]
            routing = [header(H.ASSIGNED_WORKER, cand.id),
                       header(H.CACHE_HIT_TOKENS, str(decision.hit_tokens if chosen else 0)),
                       header(H.MATCH_MODE, mode),
                       header(H.ROUTE_REASON, decision.reason if chosen else f"retried:{decision.reason}"),
                       header(H.PD, st.pd_note)]
            response = pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
                status=HttpStatus(code=status),
                headers=pb.HeaderMutation(set_headers=out + routing if shown else out), body=body,
                details="cortex_pd_fallback"))
            observe_claim(response, routing)
            return response
        log.warning("PD pair prefill=%s failed (%s) and no single worker answered; the pair's error stands",
                    pair.legs.prefill.id, fb.why)
        st.pd_note = f"fallback_failed:{fb.why}"
        metrics.PD_DECISIONS.labels(plan.engine, st.pd_note).inc()
        return self._pd_pair_headers(st, req)

    # -- the waiting room (docs/tenancy/waiting-room.md) ------------------------------------------------------

    def _full(self, active: float, waiting: float) -> bool:
        cfg = self.cfg
        return full(active, waiting, cfg.scheduler.high_watermark, cfg.admission.waiting_room.queue_depth)

    def _must_wait(self, pool: str, result: RoutePlan) -> bool:
        """Every worker the request could go to is full: the policy's first choice is (it takes a full worker only
        when no other is left in its tier). A model another scheduler places is never held."""
        d = result.decision
        if not self.cfg.admission.waiting_room.enabled or d.reason == TRANSPARENT:
            return False
        chosen = d.chosen
        if not self._full(active_of(chosen), chosen.engine_waiting):
            return False
        self.room_facts[pool] = PoolFacts(result.model, frozenset(c.slot for c in d.order),
                                          frozenset(t.slot for t in self.cluster.targets.get(result.model, ())))
        return True

    def _enter_room(self, st: StreamState, pool: str, body: bytes) -> pb.ProcessingResponse | Waiting:
        gen = self.source.current
        wr = gen.cfg.admission.waiting_room
        tenant = st.tenant or gen.tenants.default
        room = self.room
        room.max_requests, room.max_bytes = wr.max_requests, wr.max_bytes
        # Envoy's deadline for the message was fixed at start: a TTL raised by a reload waits no longer than it.
        ttl = max(1.0, min(wr.ttl_s, self.max_hold_s - gen.cfg.longest_extproc_hold_s(waiting_room=False)))
        seat = Seat(st, body, asyncio.get_running_loop().create_future())
        displaced: list[Entry[Seat]] = []
        now = time.monotonic()
        band = st.priority if st.priority is not None else tenant.priority  # an llm-d objective's, else its tenant's
        entry = room.offer(pool, tenant.id, band, tenant.weight, len(body), now, ttl, seat, displaced)
        for gone in displaced:  # a full room made way for this one (extproc/waiting_room.py: victim)
            metrics.QUEUE_WAIT_SECONDS.labels(str(gone.band)).observe(now - gone.arrived)
            if not gone.payload.answer.done():
                gone.payload.answer.set_result(self._dropped(gone.payload.st, "queue_full"))
        if entry is None:
            return self._dropped(st, "queue_full")
        st.waiting = entry
        self._room_changed()
        self.wake()  # load may have fallen since the last wake: the head (maybe this one) goes at once
        return Waiting(entry)

    def wake(self) -> None:
        """Expire what waited too long, then release, pool by pool, as long as the pool has room: each released
        request is routed anew, with the ledger and loads as they are now, and answered. Runs from the upkeep loop
        (every UPKEEP_S while requests wait), when a stream ends and when a request enters."""
        room = self.room
        if not room:
            return
        now = time.monotonic()
        changed = False
        for gone in room.expire(now):
            changed = True
            metrics.QUEUE_WAIT_SECONDS.labels(str(gone.band)).observe(now - gone.arrived)
            seat = gone.payload
            if not seat.answer.done():
                seat.answer.set_result(self._dropped(seat.st, "queue_ttl"))
        for pool in room.pools():
            while (e := room.peek(pool)) is not None and self._has_room(pool):
                room.release(e)
                changed = True
                seat = e.payload
                seat.st.queued_s = time.monotonic() - e.arrived
                metrics.QUEUE_WAIT_SECONDS.labels(str(e.band)).observe(seat.st.queued_s)
                # Routed here, not once its stream resumes: the next one's check must see this one counted.
                answer = self.on_request_body(seat.st, seat.body, released=True)
                assert not isinstance(answer, Waiting)  # a released request is never sent back in
                if not seat.answer.done():
                    seat.answer.set_result(answer)
                if isinstance(answer, PendingPair):
                    break  # a pair's decode is counted once it starts: one per wake, so the check stays true
        if changed:
            self._room_changed()

    def _has_room(self, pool: str) -> bool:
        """One of the pool's workers (or one that joined its model since) is not full, by the figures routing
        uses (candidates.py: the larger of the engine's count and Cortex's in-flight count)."""
        facts = self.room_facts.get(pool)
        if facts is None:
            return True
        totals = self.cluster.inflight.totals()
        alive = self.cluster.alive
        for t in self.cluster.targets.get(facts.model, ()):
            if t.healthy and (t.slot in facts.slots or t.slot not in facts.known):
                load = derived_load(t.engine_load, t.load_inflight, float(totals[t.slot])) if alive else None
                active = max(load or 0.0, float(totals[t.slot]))
                if not self._full(active, t.engine_waiting if load is not None else 0.0):
                    return True
        return False

    def _room_changed(self) -> None:
        depth = self.room.depth()
        self._bands.update(depth)
        for band in self._bands:
            metrics.QUEUE_DEPTH.labels(str(band)).set(depth.get(band, 0))

    def _dropped(self, st: StreamState, reason: str) -> pb.ProcessingResponse:
        """503 from the waiting room: full at arrival, or no worker had room within the time-to-live."""
        tenant = st.tenant or self.source.current.tenants.default
        retry = self.cfg.admission.retry_after_s
        if reason == "queue_full":
            message = f"Every worker serving this model is busy and the waiting room is full; retry after {retry} s."
        else:
            message = ("Every worker serving this model stayed busy (or none was up) for as long as a request may "
                       f"wait; retry after {retry} s.")
        return error(refusal(tenant.id, reason, 503, message, retry), st)

    # -- helpers --------------------------------------------------------------------------------------------

    def _count(self, st: StreamState, slot: int) -> None:
        if st.counted_slot is not None:
            self.cluster.inflight.dec(st.counted_slot)
        self.cluster.inflight.inc(slot)
        st.counted_slot = slot

    def _route_any(self, st: StreamState) -> None:
        st.decision = self.router.route_any(response_ids.tag_of(response_ids.in_path(st.path)))
        if st.decision is not None:
            self._count(st, st.decision.chosen.slot)

    def _routing_response(self, st: StreamState, phase: str, pool: str = ANY_CLUSTER) -> pb.ProcessingResponse:
        if st.decision is None and not self.picker:
            return EMPTY_HEADERS if phase == "request_headers" else EMPTY_BODY
        headers: list[HeaderValueOption] = []
        endpoints = ""
        if st.decision is not None:
            # One entry per address: a retry must go to another worker, not another rank of the failed one.
            endpoints = epp.destination([c.address for c in st.decision.order],
                                        self.cfg.epp.fallback_endpoints if self.picker else None)
            st.sent = endpoints.count(",") + 1
            headers += [header(H.POOL, pool), header(H.ENDPOINTS, endpoints)]
            chosen = st.decision.chosen
            if chosen.rank is not None:
                ranked = engines.adapter(chosen.engine).rank_headers(chosen.rank)
                headers.extend(header(k, v) for k, v in ranked.items())
        mutation = pb.HeaderMutation(set_headers=headers)
        if self.picker:
            # A gateway Cortex did not configure forwards a client's own copies of these.
            mutation.remove_headers.extend(epp.reserved_removals(headers))
        common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        if phase == "request_headers":
            response = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
        else:
            response = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
        if self.picker and endpoints:
            response.dynamic_metadata.update({epp.LB_NAMESPACE: {epp.DESTINATION: endpoints}})
        return response

    def _undecided(self, st: StreamState, body: bytes) -> pb.ProcessingResponse:
        """Routing failed inside Cortex. Behind its own Envoy, Envoy balances the request. As a picker, the
        InferencePool's failure mode says: FailOpen sends it to the least loaded endpoint, FailClose refuses it."""
        if not self.picker:
            return EMPTY_BODY
        if self.cfg.epp.failure_mode == "FailClose":
            return error(ClientError(503, "The endpoint picker could not decide for this request.",
                                           reason="picker_failed"), st)
        self._route_any(st)
        return self._routing_response(st, "request_body")

    def _test_pick(self, st: StreamState, listed: str) -> pb.ProcessingResponse:
        """The conformance suite's selection (epp.conformance_test): the listed endpoints, in order, the first picked;
        503 when none is known."""
        self._route_any(st)
        d = st.decision
        picked = epp.pick_listed(listed, [c.address for c in d.order]) if d is not None else []
        if d is None or not picked:
            return error(refusal(st.tenant.id if st.tenant else "", "no_endpoints", 503,
                                       "No endpoint named by test-epp-endpoint-selection is known.", 1), st)
        order = tuple(next(c for c in d.order if c.address == a) for a in picked)
        st.decision = Decision(order, LOAD_AWARE, "conformance_test_selection")
        self._count(st, order[0].slot)
        return self._routing_response(st, "request_body")

    def _unrouted_body(self, st: StreamState, body: bytes) -> pb.ProcessingResponse:
        """A body on a path that is no inference (/tokenize, ...): salted all the same for an isolated tenant, so no
        endpoint shares or probes another tenant's cache (extproc/isolation.py)."""
        try:
            salted = isolation.salt_unrouted(body, st.tenant)
        except ClientError as exc:
            return error(exc, st)
        if salted is None:
            return EMPTY_BODY
        response = pb.ProcessingResponse(request_body=pb.BodyResponse())
        set_body(response, splice(body, salted))
        return response

    def _explain(self, st: StreamState, body: bytes) -> pb.ProcessingResponse:
        if not isolation.sees_routing(st.tenant):
            raise ClientError(403, "Route explain is open only to tenants marked trusted.")
        query = dict(p.partition("=")[::2] for p in st.query.split("&"))
        return immediate(200, self.explain(body, st.tenant, st.session, query.get("tokens") == "1", query.get("path")))

    def explain(self, body: bytes, tenant: Tenant | None, session_key: str | None, with_tokens: bool,
                path: str | None = None) -> bytes:
        """The decision a request would get, as JSON, nothing forwarded: the same `route` real traffic takes, in
        the tenant's own view (its salted blocks). `path`: the inference path it would come on (`?path=`; default:
        a chat completion when the body has messages, else a completion). Raises ClientError for a body that
        would be refused."""
        try:
            raw = orjson.loads(body)
        except orjson.JSONDecodeError:
            raw = None
        if path not in inference_paths.PATHS:  # a chat or a completion, by its body
            path = api_paths.CHAT if isinstance(raw, dict) and "messages" in raw else api_paths.COMPLETIONS
        parsed = inference_paths.parse(path, body, self.source.current.registry)
        parsed.session_key = session_key
        isolation.isolate(parsed, tenant)
        result = self.router.route(parsed, commit=False)
        d = result.decision
        why = explain_parts(d, self.cfg.scheduler.rule, self.cfg.scheduler, self.cluster.block_size)
        now = time.monotonic()
        doc: dict[str, Any] = {
            "prompt_tokens": result.prompt_tokens,
            "prompt_truncated_for_routing": result.truncated,
            "model": result.model,
            "lora": result.lora,
            "block_size": self.cluster.block_size,
            "chosen": d.chosen.id,
            "order": [c.id for c in d.order],
            "mode": d.mode,
            "reason": d.reason,
            "cache_hit_tokens": d.hit_tokens,
            "workers": [{"id": c.id, "matched_tokens": d.matched_tokens.get(c.id),
                         **({"window_withheld_tokens": result.withheld[c.slot] * self.cluster.block_size}
                            if c.slot in result.withheld else {}),
                         **({"lower_tier_tokens": {m: n * self.cluster.block_size for m, n in c.tier_media},
                             "lower_tier_claimed_tokens": c.tier_claimed * self.cluster.block_size}
                            if c.tier_media else {}),
                         "predicted_tokens": c.predicted_blocks * self.cluster.block_size,
                         "ledger_trusted": c.ledger_trusted, "engine_load": c.engine_load,
                         "inflight": c.inflight, "suspect": c.suspect, "hot": c.hot, "kv_usage": c.kv_usage,
                         "breaker": self.breakers.state(c.address, now).value,
                         "kv_capacity_tokens": c.kv_capacity_tokens, "evicted_tokens_per_s": c.evicted_tokens_per_s,
                         "last_sent": None if c.last_sent is None else
                         {"age_s": round(c.last_sent.age_s, 3), "evicted_tokens_since": c.last_sent.evicted_tokens},
                         "score": why[c.id],
                         **({"time_model": d.estimates[c.id].to_json()} if c.id in d.estimates else {})}
                        for c in d.order],
            "timings_ms": {k: round(getattr(result.timings, k) * 1000, 3)
                           for k in ("tokenize_s", "hash_s", "lookup_s", "score_s")},
        }
        if with_tokens:
            doc["token_ids"] = result.token_ids
        return orjson.dumps(doc)

    async def explain_http(self, request: web.Request) -> web.Response:
        """Route explain for ingest's admin port (cortex/api_paths.py: explain_socket): ingest checked the admin
        token; the admin may ask for a tenant's view."""
        gen = self.source.current
        name = request.headers.get(TENANT_VIEW_HEADER)
        tenant = gen.tenants.by_id.get(name) if name else gen.tenants.default
        if tenant is None:
            return _json_error(ClientError(404, "No tenant of that id is configured.", TENANT_VIEW_HEADER))
        headers = {k.lower(): v for k, v in request.headers.items()}
        key = next((k for n in gen.cfg.session.headers if (k := session.key_of(headers.get(n)))), None)
        try:
            doc = self.explain(await request.read(), tenant, key, request.query.get("tokens") == "1",
                               request.query.get("path"))
        except ClientError as exc:
            return _json_error(exc)
        return web.Response(body=doc, content_type="application/json")


def _json_error(exc: ClientError) -> web.Response:
    return web.Response(status=exc.status, body=exc.body(), content_type="application/json")



async def _read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None past `limit` bytes (it could not travel back to Envoy in one message)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def serve(cfg: CortexConfig, index: int, config_path: Path | None = None, picker: bool = False) -> None:
    cluster = ClusterView(cfg, cfg.view_path(), index)
    cluster.refresh()
    registry = ModelRegistry(cfg)
    source = Source(cfg, registry)
    status_file = breaker_status.path(cfg.runtime_path(), index)

    def on_breaker(address: str, old: BreakerState, new: BreakerState) -> None:
        info = cluster.by_address.get(address)
        worker = info.worker if info is not None else address
        (log.warning if new is BreakerState.OPEN else log.info)(
            "worker %s (%s): circuit breaker %s -> %s", worker, address, old.value, new.value)
        metrics.breaker_transition(worker, old, new)
        try:
            breaker_status.write(status_file, router.breakers.snapshot(time.monotonic()))
        except OSError:
            log.exception("writing the breaker status file failed")

    router = Router(cfg, cluster, registry, source, on_breaker=on_breaker)
    try:
        breaker_status.write(status_file, {})  # a restarted process starts with every breaker closed: say so
    except OSError:
        log.exception("writing the breaker status file failed")
    board = TenancyBoard(cfg.runtime_path() / "tenancy", f"x{index}", cfg.extproc.process_count())
    app = ExtProc(source, cluster, router, Admission(cfg, board), picker=picker)
    # A bad edit is logged and ignored; listener, port and process-count changes need a restart.
    def prepare(c: CortexConfig) -> tuple[CortexConfig, ModelRegistry, dict[int, SegmentEncoder]]:
        # In the watcher's thread: tokenizers load and new encoders prove themselves off the event loop.
        registry = ModelRegistry(c, source.current.registry)
        return c, registry, router.segments.build(registry.bundles.values())

    watcher = ConfigWatcher(config_path, prepare)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", cfg.extproc.max_body_bytes + (1 << 20)),
        ("grpc.max_send_message_length", cfg.extproc.max_body_bytes + (1 << 20)),
    ])
    handler = grpc.method_handlers_generic_handler("envoy.service.ext_proc.v3.ExternalProcessor", {
        "Process": grpc.stream_stream_rpc_method_handler(
            app.process, request_deserializer=pb.ProcessingRequest.FromString,
            response_serializer=pb.ProcessingResponse.SerializeToString),
    })
    # Latched once this process has read ingest's target list: from then on it routes (by load while ingest
    # restarts), so Envoy keeps sending it streams; before, Envoy must not (cortex/grpc_health.py).
    served = cluster.synced

    def health(service: str) -> int | None:
        if service in ("", grpc_health.EXT_PROC):
            return grpc_health.SERVING if served else grpc_health.NOT_SERVING
        if service == grpc_health.LEDGER_VIEW:
            return grpc_health.SERVING if cluster.synced else grpc_health.NOT_SERVING
        return None

    server.add_generic_rpc_handlers((handler, grpc_health.handler(health)))
    port = cfg.extproc.base_port + index
    if cfg.extproc.tls is None:
        server.add_insecure_port(f"{cfg.extproc.host}:{port}")
    else:
        cert, key = extproc_tls.files(cfg)
        server.add_secure_port(f"{cfg.extproc.host}:{port}",
                               grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())]))
        # Local health checks (ingest's readiness, the supervisor's start gate) come here, not through the
        # certificate the gateway does not check either (cortex/extproc_tls.py).
        local = extproc_tls.local_socket(cfg.runtime_path(), index)
        local.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        local.unlink(missing_ok=True)
        server.add_insecure_port(f"unix:{local}")
    await server.start()
    # A restarted process finds ingest's view at once: it serves from here, and says so as a first start does.
    (log.info if served else log.debug)("extproc %d %s on %s:%d (%d models)", index,
                                        "serving" if served else "listening", cfg.extproc.host, port,
                                        len(registry.bundles))

    async def upkeep() -> None:
        nonlocal served
        polled_at = time.monotonic()
        while True:
            # Until it serves, and while requests flow, every UPKEEP_S; an idle process wakes less often.
            idle = served and time.monotonic() - app.last_stream_at > IDLE_AFTER_S and not app.room
            await asyncio.sleep(IDLE_UPKEEP_S if idle else UPKEEP_S)
            try:
                cluster.refresh()
                if not served and cluster.synced:
                    served = True
                    log.info("extproc %d serving on %s:%d (%d models)", index, cfg.extproc.host, port,
                             len(registry.bundles))
                router.upkeep()
                app.wake()  # released as loads fall; expired at their time-to-live
                if time.monotonic() - polled_at >= 1.0:
                    polled_at = time.monotonic()
                    change = await watcher.poll()
                    if change is not None:
                        app.reload(*change)
            except Exception:
                log.exception("extproc upkeep failed")

    task = asyncio.create_task(upkeep())
    explain_site = None
    if index == 0 and cfg.extproc.route_explain:
        # Route explain for ingest's admin port: a socket only this host's processes (of this user) reach.
        explain_app = web.Application()
        explain_app.add_routes([web.post(EXPLAIN_PATH, app.explain_http)])
        explain_site = web.AppRunner(explain_app, access_log=None)
        await explain_site.setup()
        sock = explain_socket(cfg.runtime_path())
        sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        sock.unlink(missing_ok=True)
        await web.UnixSite(explain_site, str(sock)).start()
        sock.chmod(0o600)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await server.stop(grace=2)
    if explain_site is not None:
        await explain_site.cleanup()
    await app.pd.close()


def run(cfg: CortexConfig, index: int, config_path: Path | None = None, picker: bool = False) -> int:
    if index > 0:
        # Every extproc process loads the same tokenizers and applies (or refuses) the same config edits: process
        # 0 tells the person once. The others keep their warnings (and, but for config refusals, errors).
        for name in ("cortex.piecewise_tokenize", "cortex.fast_bpe"):
            logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger("cortex.config").setLevel(logging.CRITICAL)
    metrics.START_TIME.labels(str(index)).set_to_current_time()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(cfg, index, config_path, picker))
    return 0

