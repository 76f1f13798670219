"""The Gateway API Inference Extension's endpoint-picker protocol (GIE proposal 004), as a gateway Cortex did not
configure speaks it: what differs from Cortex's own Envoy.

- The pick: `x-gateway-destination-endpoint: ip:port[,fallback...]` as a request header AND as dynamic metadata
  `envoy.lb` / the same key. GIE's reference Envoy routes with an ORIGINAL_DST cluster that reads one ip:port from
  the header (a list fails to parse: 503), so fallbacks are listed only when the gateway balances with
  override_host (cfg.epp.fallback_endpoints).
- Body mode FULL_DUPLEX_STREAMED (GIE's reference): Envoy streams the body in chunks and keeps none of them. The
  picker holds its headers answer until the body's last chunk, then answers the headers (the pick, clear the
  route cache) and streams the body back, mutated or not, in chunks. BUFFERED (Cortex's own Envoy) answers the
  body message with both. The mode comes in the stream's first message (`protocol_config`).
- What the gateway may tell the picker, in metadata it forwards: the endpoints a request may go to
  (`envoy.lb.subset_hint`), and the endpoint that served (`envoy.lb` / x-gateway-destination-endpoint-served,
  written by override_host's selected_host_key).
- The conformance suite's test header `test-epp-endpoint-selection` (comma-separated `ip` or `ip:port`),
  followed only in its test mode.

llm-d's request headers (priority objective, fairness id, model rewrite) and their deprecated x-gateway-* names
are read the same way in either mode: LLMD_HEADERS.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from cortex import headers as H
from extproc.policies.base import LOAD_AWARE, Decision

LB_NAMESPACE = "envoy.lb"
DESTINATION = H.ENDPOINTS
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
TEST_SELECTION = "test-epp-endpoint-selection"
TEST_SERVED = "x-conformance-test-served-endpoint"
CHUNK_BYTES = 62000
"""Largest body chunk streamed back (GIE's EPP uses the same; Envoy's default buffer is far above it)."""

OBJECTIVE = "objective"
FAIRNESS = "fairness"
REWRITE = "rewrite"
LLMD_HEADERS = {
    "x-llm-d-inference-objective": OBJECTIVE, "x-gateway-inference-objective": OBJECTIVE,
    "x-llm-d-inference-fairness-id": FAIRNESS, "x-gateway-inference-fairness-id": FAIRNESS,
    "x-llm-d-model-name-rewrite": REWRITE, "x-gateway-model-name-rewrite": REWRITE,
}
"""llm-d's request headers (pkg/epp/metadata/consts.go) -> what they say. The current name wins over the deprecated
one when both are sent (`llmd_value`)."""
_CURRENT = frozenset(k for k in LLMD_HEADERS if k.startswith("x-llm-d-"))
FAIRNESS_HEADERS = frozenset(k for k, v in LLMD_HEADERS.items() if v == FAIRNESS)

_DUPLEX = ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED


def llmd_value(found: dict[str, str], name: str, value: str) -> None:
    """Record header `name` (one of LLMD_HEADERS) into `found` by meaning; the current name beats the deprecated."""
    meaning = LLMD_HEADERS[name]
    if meaning not in found or name in _CURRENT:
        found[meaning] = value


def priority_of(found: Mapping[str, str], objectives: dict[str, int]) -> int | None:
    """The band an llm-d objective names (admission.objectives), or None: the tenant's band (no objective, or one
    that is not configured, as llm-d's own picker falls back to the default priority)."""
    objective = found.get(OBJECTIVE)
    return None if objective is None else objectives.get(objective)


def fairness_tenant(found: Mapping[str, str], tenant_header: str | None) -> str | None:
    """The tenant named by llm-d's fairness id under its deprecated name, when the trusted tenant header is the
    fairness header (auth.tenant_header) and the current name was not sent."""
    return found.get(FAIRNESS) if tenant_header in FAIRNESS_HEADERS else None


def duplex_modes(first: Any) -> tuple[bool, bool]:
    """(request body, response body) streamed full duplex, from the stream's first message (Envoy sends its
    processing mode there; an Envoy too old to send it is taken as BUFFERED, Cortex's own)."""
    if not first.HasField("protocol_config"):
        return False, False
    pc = first.protocol_config
    return pc.request_body_mode == _DUPLEX, pc.response_body_mode == _DUPLEX


def _host(endpoint: str) -> str:
    if endpoint.startswith("["):  # [v6]:port or [v6]
        return endpoint[1:].split("]", 1)[0]
    host, sep, port = endpoint.rpartition(":")
    return host if sep and port.isdigit() and ":" not in host else endpoint


def _has_port(endpoint: str) -> bool:
    return _host(endpoint) != endpoint.strip("[]")


def subset_of(metadata_context: Any) -> tuple[str, ...] | None:
    """The endpoints the gateway allows for this request (`envoy.lb.subset_hint`), or None when it sent no hint.
    A string (GIE's lightweight picker takes a comma-separated one) or a list of strings."""
    ns = metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET not in ns.fields:
        return None
    value = ns.fields[SUBSET]
    which = value.WhichOneof("kind")
    if which == "string_value":
        items: Iterable[str] = value.string_value.split(",")
    elif which == "list_value":
        items = (v.string_value for v in value.list_value.values)
    else:
        return ()
    return tuple(e.strip() for e in items if e.strip())


def allows(allowed: Sequence[str], address: str) -> bool:
    """Does the list admit `address` (ip:port)? An entry with a port must match exactly (data-parallel ranks
    share an IP); a bare IP admits every port of it."""
    host = _host(address)
    return any(e == address if _has_port(e) else _host(e) == host for e in allowed)


def pick_listed(listed: str, addresses: Sequence[str]) -> list[str]:
    """The conformance suite's selection: its entries in order, each `ip:port` as given when it is a known
    endpoint, each bare `ip` as the first known endpoint on that IP; unknown entries and repeats dropped."""
    picked: list[str] = []
    for entry in (e.strip() for e in listed.split(",")):
        if not entry:
            continue
        match = entry if _has_port(entry) and entry in addresses else next(
            (a for a in addresses if not _has_port(entry) and _host(a) == _host(entry)), None)
        if match is not None and match not in picked:
            picked.append(match)
    return picked


def within(decision: Decision, allowed: Sequence[str]) -> Decision | None:
    """The decision kept to the endpoints the gateway allows, in the policy's order (None: it allows none of the
    candidates). When its first choice is left out, the next allowed one is taken with no hit claimed."""
    order = tuple(c for c in decision.order if allows(allowed, c.address))
    if not order:
        return None
    if order == decision.order:
        return decision
    if order[0] is decision.order[0]:
        return Decision(order, decision.mode, decision.reason, decision.hit_tokens, decision.matched_tokens)
    return Decision(order, LOAD_AWARE, f"subset:{decision.reason}", 0, decision.matched_tokens)


def served(req: Any) -> str:
    """The endpoint that answered: Envoy's `upstream.address` attribute when the gateway sends it, else override_host's
    `envoy.lb` / x-gateway-destination-endpoint-served metadata when the gateway forwards it; '' when neither."""
    attrs = req.attributes.get("envoy.filters.http.ext_proc")
    if attrs is not None and "upstream.address" in attrs.fields:
        return str(attrs.fields["upstream.address"].string_value)
    lb = req.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if lb is not None and SERVED in lb.fields:
        return str(lb.fields[SERVED].string_value)
    return ""


def chunks(body: bytes, end_of_stream: bool = True) -> list[pb.ProcessingResponse]:
    """`body` streamed back as request-body answers of at most CHUNK_BYTES, the last one ending the stream when
    `end_of_stream` (an empty body is one empty chunk)."""
    parts = [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=part, end_of_stream=end_of_stream and i == len(parts) - 1)))))
        for i, part in enumerate(parts)]


def echo_response_chunk(body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """One response-body chunk handed back unchanged (full duplex: Envoy forwards only what the picker returns)."""
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=body, end_of_stream=end_of_stream)))))


def split_body_answer(held: pb.ProcessingResponse, answer: pb.ProcessingResponse, body: bytes,
                      end_of_stream: bool = True) -> list[pb.ProcessingResponse]:
    """The held headers answer and a request-body answer as Cortex builds them for BUFFERED mode (the pick in
    either's header mutation, maybe a new body) -> what full duplex takes: one headers answer with both header
    mutations, the route-cache clear and the dynamic metadata, then the body in chunks. Content-Length is removed:
    Envoy sends a body that is streamed back chunked."""
    first, common = held.request_headers.response, answer.request_body.response
    sets = [h for h in (*first.header_mutation.set_headers, *common.header_mutation.set_headers)
            if h.header.key != "content-length"]
    removes = [*first.header_mutation.remove_headers, *common.header_mutation.remove_headers, "content-length"]
    headers = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=sets, remove_headers=removes),
        clear_route_cache=first.clear_route_cache or common.clear_route_cache)))
    for source in (held, answer):
        if source.HasField("dynamic_metadata"):
            headers.dynamic_metadata.MergeFrom(source.dynamic_metadata)
    new_body = common.body_mutation.body if common.body_mutation.WhichOneof("mutation") == "body" else body
    return [headers, *chunks(new_body, end_of_stream)]


def destination(addresses: Sequence[str], fallbacks: int | None) -> str:
    """The header's value: the pick, then up to `fallbacks` distinct endpoints after it (None: all of them)."""
    unique = list(dict.fromkeys(addresses))
    return ",".join(unique if fallbacks is None else unique[:1 + fallbacks])


def reserved_removals(set_headers: Sequence[HeaderValueOption]) -> list[str]:
    """The request headers only Cortex may set that this answer does not set: removed, since a gateway Cortex did
    not configure forwards a client's own copies (a client's x-gateway-destination-endpoint would choose its own
    upstream)."""
    ours = {h.header.key for h in set_headers}
    return [name for name in H.RESERVED_REQUEST if name not in ours]
