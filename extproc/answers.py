"""Envoy's answers, built: the header options, immediate responses and errors, body mutations, and the facts
extproc hands the observation (cortex/observation.py) in an answer's dynamic metadata. Pure protobuf building:
no routing state, no I/O (the transport in extproc/server.py and the phases beside it call these)."""

from __future__ import annotations

from typing import Any

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus

from cortex import headers as H
from cortex import observation
from cortex.errors import ClientError
from extproc import isolation, metrics, stream
from extproc.plan import RoutePlan
from extproc.stream_state import StreamState

_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
EMPTY_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
EMPTY_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())


def header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def immediate(status: int, body: bytes, content_type: str = "application/json") -> pb.ProcessingResponse:
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=[header("content-type", content_type)]),
        body=body, details="cortex"))



def as_answer(response: pb.ProcessingResponse) -> stream.Answer[pb.ProcessingResponse]:
    return stream.Answer(response, response.HasField("immediate_response"))



def set_body(response: pb.ProcessingResponse, new_body: bytes) -> None:
    common = response.request_body.response
    common.body_mutation.body = new_body
    # Envoy does not fix Content-Length after a body mutation; a stale one makes it answer 500.
    common.header_mutation.set_headers.append(header("content-length", str(len(new_body))))


def error(exc: ClientError, st: StreamState | None = None) -> pb.ProcessingResponse:
    """The OpenAI-style error answer for a refused request (counted; its tenant and reason go to the request log)."""
    metrics.CLIENT_ERRORS.labels(str(exc.status)).inc()
    response = immediate(exc.status, exc.body())
    for k, v in exc.headers.items():
        response.immediate_response.headers.set_headers.append(header(k, v))
    if st is not None and st.tenant is not None:
        # The request log says whose request was refused, and why.
        observe_facts(response, {observation.TENANT: st.tenant.id, observation.DROPPED: exc.reason})
    return response


def usage_options(stream: bool, body: dict[str, Any] | None) -> dict[str, Any] | None:
    """The stream_options to send when the engine must be asked for a stream's usage on the client's behalf
    (cortex/observe.lua cuts that usage event out again), else None (not a stream, or the client asked).
    continuous_usage_stats is turned off: without include_usage the client would have had no usage in its chunks
    either. Not for a PD pair: its legs are built by extproc itself."""
    if not stream:
        return None
    options = (body or {}).get("stream_options")
    options = options if isinstance(options, dict) else {}
    if options.get("include_usage") is True:
        return None
    return {**options, "include_usage": True, "continuous_usage_stats": False}


def observe_facts(response: pb.ProcessingResponse, facts: dict[str, Any]) -> None:
    """extproc's facts about this request, for the observation (cortex/observation.py)."""
    response.dynamic_metadata.update({observation.NAMESPACE: facts})


def prompt_facts(result: RoutePlan) -> dict[str, Any]:
    # The ids as one string: a protobuf list of 64 numbers costs ~40 µs to build, the string ~3.
    facts = {observation.PROMPT_HASH: result.prompt_hash, observation.FIRST_IDS: ",".join(map(str, result.head_ids)),
             observation.PROMPT_TOKENS: result.prompt_tokens}
    est = result.decision.estimates.get(result.decision.chosen.id)
    if est is not None:  # what the observer calibrates the worker's predictions by (cortex/calibration.py)
        facts[observation.PREDICTED_TTFT] = round(est.ttft_ms, 1)
    if result.alias is not None:  # per-target series of a canary (observe/metrics.py)
        facts[observation.ALIAS] = result.alias
    return facts


def tenant_facts(st: StreamState) -> dict[str, Any]:
    """Who sent it, how long it waited, and what it reserved: the observer settles the reservation with the
    engine's usage."""
    if st.tenant is None:
        return {}
    facts: dict[str, Any] = {observation.TENANT: st.tenant.id}
    if st.queued_s is not None:
        facts[observation.QUEUED_MS] = round(st.queued_s * 1000, 1)
    if st.ticket is not None and st.ticket.reserved:
        facts[observation.RESERVED] = st.ticket.reserved
        facts[observation.QUOTA_PERIOD] = st.tenant.limits.quota_period_s
    return facts


_CLAIM_KEYS = {H.ASSIGNED_WORKER: observation.WORKER, H.MATCH_MODE: observation.MODE,
               H.ROUTE_REASON: observation.REASON}


def claim_facts(headers: list[HeaderValueOption]) -> dict[str, Any]:
    """What the x-cortex-* headers of an answer claim, as the observation compares it with the engine's usage."""
    facts: dict[str, Any] = {}
    for h in headers:
        key = h.header.key
        if key in _CLAIM_KEYS:
            facts[_CLAIM_KEYS[key]] = h.header.raw_value.decode("latin-1")
        elif key == H.CACHE_HIT_TOKENS:
            facts[observation.CLAIMED] = int(h.header.raw_value)
    return facts


def observe_claim(response: pb.ProcessingResponse, headers: list[HeaderValueOption]) -> None:
    observe_facts(response, claim_facts(headers))


def status_of(req: Any) -> bytes:
    """The :status of a response-headers message."""
    return next((h.raw_value or h.value.encode() for h in req.response_headers.headers.headers
                 if h.key == ":status"), b"200")


def headers_answer(st: StreamState, req: Any, headers: list[HeaderValueOption],
                   enabled: bool = True) -> pb.ProcessingResponse:
    """The response-headers answer: Cortex's routing headers for a tenant that may see them (while extproc.
    routing_headers is on); for any other, none, and none of the x-cortex-* headers the worker sent (the
    observation still gets the facts from the caller)."""
    if enabled and isolation.sees_routing(st.tenant):
        mutation = pb.HeaderMutation(set_headers=headers)
    else:
        mutation = pb.HeaderMutation(remove_headers=isolation.upstream_cortex_headers(
            h.key for h in req.response_headers.headers.headers))
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=mutation)))
