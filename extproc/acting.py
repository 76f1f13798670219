"""Acting on a plan: commit the request to a worker (its in-flight count, its slot of a half-open breaker, the
predictions a served fallback makes) and map the decision onto Envoy's answer (the ordered endpoint list, the
pool, a DP rank, the body's changes). The phases (extproc/server.py, extproc/pd_act.py, extproc/responses.py)
share one `Acting` per process; it never asks the router for a second decision."""

from __future__ import annotations

import time

from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from cortex import engines
from cortex import headers as H
from cortex.config import CortexConfig
from cortex.envoy_config import ANY_CLUSTER, pool_cluster
from cortex.errors import ClientError
from cortex.upstream_tls import WorkerTls
from extproc import epp, inference_paths, isolation, response_ids
from extproc.admission import refusal
from extproc.answers import EMPTY_BODY, EMPTY_HEADERS, error, header, set_body
from extproc.cluster_view import ClusterView
from extproc.gateway_mode import EnvoyMode, GatewayMode
from extproc.pd_dispatch import PdDispatcher, splice
from extproc.policies.base import LOAD_AWARE, Decision
from extproc.prepare import NoWorker
from extproc.router import Router
from extproc.snapshot import Generation, Source
from extproc.stream_state import StreamState


class Acting:
    def __init__(self, source: Source, cluster: ClusterView, router: Router, mode: GatewayMode | None = None) -> None:
        self.mode = mode or EnvoyMode()
        """The gateway it answers: Cortex's own Envoy or, `cortex epp`, one it did not configure."""
        self.source = source
        """The config generation in force (the router reads the same reference)."""
        self.cluster = cluster
        self.router = router
        # The answers it sees feed the workers' breakers, which the router's decisions read.
        self.breakers = router.breakers
        self.pd = PdDispatcher(router.leg, WorkerTls(self.cfg.upstream_tls))

    @property
    def cfg(self) -> CortexConfig:
        return self.source.current.cfg

    def gen_of(self, st: StreamState) -> Generation:
        """The generation `st` was identified under (its stream pinned it at the headers): what a request is told
        and where it may go follow the rules it came in under, whatever a reload swapped since. The waiting room
        and the breakers are shared by every stream and follow the generation in force."""
        return st.gen or self.source.current

    def cfg_of(self, st: StreamState) -> CortexConfig:
        return self.gen_of(st).cfg

    def single(self, st: StreamState, decision: Decision, model: str, body: bytes,
               changes: dict[str, object]) -> pb.ProcessingResponse:
        st.decision = decision
        self.count(st, decision.chosen.slot)
        self.breakers.release(st.trial)
        st.trial = self.breakers.dispatched(decision.chosen.address, time.monotonic())
        response = self.routing_response(st, "request_body", pool_cluster(model))
        chosen = decision.chosen
        if chosen.rank is not None and (placed := engines.adapter(chosen.engine).rank_body(chosen.rank)):
            changes = {**changes, **placed}  # an engine that pins a DP rank from the body only (SGLang)
        if changes or (st.admitted is not None and st.admitted.rewritten):
            set_body(response, splice(body, changes))
        return response

    def count(self, st: StreamState, slot: int) -> None:
        st.counted_slot = self.router.hold(slot, st.counted_slot)

    def route_any(self, st: StreamState) -> None:
        st.decision = self.router.route_any(response_ids.tag_of(response_ids.in_path(st.head.path)), st.gen)
        if st.decision is not None:
            self.count(st, st.decision.chosen.slot)

    def routing_response(self, st: StreamState, phase: str, pool: str = ANY_CLUSTER) -> pb.ProcessingResponse:
        if st.decision is None and not self.mode.answers_undecided:
            return EMPTY_HEADERS if phase == "request_headers" else EMPTY_BODY
        headers: list[HeaderValueOption] = []
        endpoints = ""
        if st.decision is not None:
            # One entry per address: a retry must go to another worker, not another rank of the failed one.
            endpoints = self.mode.destination([c.address for c in st.decision.order], self.cfg_of(st))
            st.sent = endpoints.count(",") + 1
            headers += [header(H.POOL, pool), header(H.ENDPOINTS, endpoints)]
            chosen = st.decision.chosen
            if chosen.rank is not None:
                ranked = engines.adapter(chosen.engine).rank_headers(chosen.rank)
                headers.extend(header(k, v) for k, v in ranked.items())
        mutation = pb.HeaderMutation(set_headers=headers, remove_headers=self.mode.removals(headers))
        common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        if phase == "request_headers":
            response = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
        else:
            response = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
        self.mode.dress(response, endpoints)
        return response

    def undecided(self, st: StreamState, body: bytes) -> pb.ProcessingResponse:
        """Routing failed inside Cortex: the gateway mode says what becomes of the request."""
        match self.mode.undecided(self.cfg_of(st)):
            case "gateway":
                return EMPTY_BODY
            case "refuse":
                return error(ClientError(503, "The endpoint picker could not decide for this request.",
                                         reason="picker_failed"), st)
        self.route_any(st)
        return self.routing_response(st, "request_body")

    def test_pick(self, st: StreamState, listed: str) -> pb.ProcessingResponse:
        """The conformance suite's selection (epp.conformance_test): the listed endpoints, in order, the first picked;
        503 when none is known."""
        self.route_any(st)
        d = st.decision
        picked = epp.pick_listed(listed, [c.address for c in d.order]) if d is not None else []
        if d is None or not picked:
            return error(refusal(st.tenant.id if st.tenant else "", "no_endpoints", 503,
                                 "No endpoint named by test-epp-endpoint-selection is known.", 1), st)
        order = tuple(next(c for c in d.order if c.address == a) for a in picked)
        st.decision = Decision(order, LOAD_AWARE, "conformance_test_selection")
        self.count(st, order[0].slot)
        return self.routing_response(st, "request_body")

    def tokenizer_body(self, st: StreamState, body: bytes) -> pb.ProcessingResponse:
        """A tokenizer endpoint (api_paths.TOKENIZER_PATHS): no inference, but only a worker of the body's model
        tokenizes as that model does, so it goes to the least loaded of them (an alias named as the model it
        resolved to), salted as any unrouted body is."""
        registry = self.gen_of(st).registry
        try:
            salted = isolation.salt_unrouted(body, st.tenant) or {}
            resolved, decision = self.router.route_tokenizer(
                st.head.path, inference_paths.tokenizer_model(body, registry), st.gen)
        except ClientError as exc:
            return error(exc, st)
        if decision is None:
            return error(NoWorker(resolved.model, f"no healthy worker serves model `{resolved.model}`"), st)
        st.decision = decision
        self.count(st, decision.chosen.slot)
        response = self.routing_response(st, "request_body", pool_cluster(resolved.model))
        changes = {**salted, **({"model": resolved.model} if resolved.alias is not None else {})}
        if changes:
            set_body(response, splice(body, changes))
        return response

    def unrouted_body(self, st: StreamState, body: bytes) -> pb.ProcessingResponse:
        """A body on a path that is no inference nor a tokenizer path: salted all the same for an isolated tenant, so no
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
