"""The response-headers phase: which worker really served (Envoy's report, or the only endpoint named), the
workers' breakers fed with the answer, and the x-cortex-* claim headers stamped for it (a PD pair's in
extproc/pd_act.py). It decides nothing: it reports what happened to the plan extproc/acting.py acted on."""

from __future__ import annotations

import time
from typing import Any

from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from cortex import headers as H
from extproc import epp, pd_act
from extproc.acting import Acting
from extproc.answers import header, headers_answer, observe_claim, status_of
from extproc.policies.base import EXACT, LOAD_AWARE
from extproc.stream_state import DecodeFallback, HoldHeaders, StreamState


def on_response_headers(act: Acting, st: StreamState,
                        req: Any) -> pb.ProcessingResponse | DecodeFallback | HoldHeaders:
    served = epp.served(req)
    d = st.decision
    if not served and d is not None and st.sent == 1:
        served = d.chosen.address  # the only endpoint named: a retry can go nowhere else
    if st.pd is None:
        answered(act, st, req, served)
    elif d is not None:
        return pd_act.response_headers(act, st, req, served)
    if d is not None and served and served != d.chosen.address and not act.mode.unconfirmed(served):
        worker = next((c for c in d.order if c.address == served), d.chosen)
        if worker is not d.chosen:
            act.count(st, worker.slot)  # Envoy retried on the next worker of the list
    return answer_headers(act, st, req, claim_headers(act, st, served), served)


def claim_headers(act: Acting, st: StreamState, served: str) -> list[HeaderValueOption]:
    """The x-cortex-* claim headers for a request (not a PD pair's) that `served` answered ('' when not known)."""
    headers = []
    d = st.decision
    if d is None:
        info = act.cluster.by_address.get(served)
        mode = "fallback_p2c"
        reason = st.fallback_reason or "routed_by_envoy"
        headers.append(header(H.CACHE_HIT_TOKENS, "0"))
        if info is not None:
            headers.append(header(H.ASSIGNED_WORKER, info.id))
    else:
        chosen = d.chosen
        worker = chosen
        if act.mode.unconfirmed(served):
            # A gateway that says neither which endpoint served nor sends one endpoint only: the hit is not
            # proven.
            return [header(H.ASSIGNED_WORKER, chosen.id), header(H.CACHE_HIT_TOKENS, "0"),
                    header(H.MATCH_MODE, d.mode), header(H.ROUTE_REASON, f"unconfirmed:{d.reason}")]
        if served and served != chosen.address:
            # Envoy retried on the next worker of the list: report what really happened.
            worker = next((c for c in d.order if c.address == served), chosen)
        mode, reason = d.mode, d.reason
        hit = d.hit_tokens if worker is chosen else 0
        if worker is not chosen:
            reason = f"retried:{reason}"
            mode = mode if mode != EXACT else LOAD_AWARE
        headers += [header(H.ASSIGNED_WORKER, worker.id), header(H.CACHE_HIT_TOKENS, str(hit))]
    headers += [header(H.MATCH_MODE, mode), header(H.ROUTE_REASON, reason)]
    if st.pd_note:
        headers.append(header(H.PD, st.pd_note))
    return headers


def answered(act: Acting, st: StreamState, req: Any, served: str) -> None:
    """Feed the workers' breakers with this answer: the worker that served failed with a 5xx (its own, or Envoy's
    after a reset there); a first choice Envoy retried past failed too (a reset, a refused stream or a 5xx are
    the only causes of a retry). A PD pair's legs are judged by the pair's own handling (docs/pd.md)."""
    breakers = act.breakers
    now = time.monotonic()
    d = st.decision
    if d is not None and served and served != d.chosen.address:
        breakers.record(d.chosen.address, False, now)
    if served:
        breakers.record(served, not status_of(req).startswith(b"5"), now)
    breakers.release(st.trial)


def answer_headers(act: Acting, st: StreamState, req: Any, headers: list[HeaderValueOption],
                   served: str) -> pb.ProcessingResponse:
    response = headers_answer(st, req, headers, act.cfg_of(st).extproc.routing_headers)
    observe_claim(response, headers)
    act.mode.stamp(response, served, act.cfg_of(st))
    return response
