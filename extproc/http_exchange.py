"""The decision exchange over plain HTTP, both ways, without I/O (extproc.transport: http; docs/architecture.md,
"The decision over HTTP").

Envoy's Lua caller (cortex/decide.lua) posts a request's headers and its buffered body to an extproc process;
extproc runs the request's ext_proc machine on them exactly as it would on a gRPC stream (`messages`), and the
machine's answers become one HTTP answer the caller acts on (`answer`). The answer speaks in headers, because Lua
in Envoy has no JSON parser:

- `x-cortex-act: continue`: send the request on; `x-cortex-set-<name>` sets request header <name>, `x-cortex-remove`
  lists headers to remove, `x-cortex-body: replace` replaces the request body with the answer's body,
  `x-cortex-client-<name>` is a header for the client's response (the claims), `x-cortex-meta-<key>` a fact for the
  observation (dynamic metadata in observation.NAMESPACE, its value typed by its first character: `s` string, `n`
  number, `b` boolean);
- `x-cortex-act: respond`: answer the client at once with status `x-cortex-status`, the `x-cortex-set-*` headers and
  the answer's body (a refusal), the `x-cortex-meta-*` facts recorded as well.

With `continue` also: `x-cortex-chosen` (the address the `x-cortex-client-*` claims are for), `x-cortex-retried-<name>`
(the claims when another worker served after Envoy retried: no hit; the caller names the worker that served, from
its endpoint's metadata), `x-cortex-hide` (this client sees no routing header: every x-cortex-* header of the response
is removed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from cortex import headers as H
from cortex import observation

ACT = "x-cortex-act"
STATUS = "x-cortex-status"
SET = "x-cortex-set-"
REMOVE = "x-cortex-remove"
BODY = "x-cortex-body"
CLIENT = "x-cortex-client-"
META = "x-cortex-meta-"
HIDE = "x-cortex-hide"
"""The client may not see Cortex's routing: the caller removes every x-cortex-* header of the response."""
RETRIED = "x-cortex-retried-"
"""A claim header for the client's response when a worker other than the chosen one served (Envoy retried)."""
CHOSEN = "x-cortex-chosen"
"""The address of the worker the answer's claims are for: a response served elsewhere (Envoy retried) drops them."""

METHOD, PATH, AUTHORITY = H.CALL_METHOD, H.CALL_PATH, H.CALL_AUTHORITY

_CALL_HEADERS = frozenset({"host", "content-length", "x-envoy-expected-rq-timeout-ms", "x-envoy-internal",
                           "x-forwarded-for", METHOD, PATH, AUTHORITY})
"""Headers of the caller's own call, not of the request it carries."""


@dataclass(slots=True)
class HttpAnswer:
    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


def messages(headers: Iterable[tuple[str, str]], body: bytes) -> tuple[pb.ProcessingRequest, pb.ProcessingRequest]:
    """The request's two ext_proc messages as Envoy would send them, from the caller's call (its headers, lowercase,
    repeated names kept; the request's body)."""
    own: dict[str, str] = {}
    rest: list[HeaderValue] = []
    for k, v in headers:
        k = k.lower()
        if k in _CALL_HEADERS:
            own[k] = v
        else:
            rest.append(HeaderValue(key=k, raw_value=v.encode("latin-1")))
    pseudo = [HeaderValue(key=":method", raw_value=own.get(METHOD, "POST").encode("latin-1")),
              HeaderValue(key=":path", raw_value=own.get(PATH, "/").encode("latin-1")),
              HeaderValue(key=":authority", raw_value=own.get(AUTHORITY, "").encode("latin-1")),
              HeaderValue(key=":scheme", raw_value=b"http")]
    if body or (METHOD in own and own[METHOD] not in ("GET", "HEAD")):
        rest.append(HeaderValue(key="content-length", raw_value=str(len(body)).encode()))
    head = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=HeaderMap(headers=pseudo + rest),
                                                               end_of_stream=not body))
    return head, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


def _value(v: struct_pb2.Value) -> str:
    which = v.WhichOneof("kind")
    if which == "bool_value":
        return "b1" if v.bool_value else "b0"
    if which == "number_value":
        n = v.number_value
        return f"n{int(n)}" if n.is_integer() else f"n{n!r}"
    if which == "string_value":
        return "s" + v.string_value
    raise ValueError(f"a fact of kind {which} cannot travel in a header")


def _facts(response: pb.ProcessingResponse, out: list[tuple[str, str]]) -> None:
    if not response.HasField("dynamic_metadata"):
        return
    for ns, value in response.dynamic_metadata.fields.items():
        if ns != observation.NAMESPACE:
            raise ValueError(f"facts in namespace {ns!r}: the HTTP exchange carries {observation.NAMESPACE!r} only")
        for key, v in value.struct_value.fields.items():
            out.append((META + key, _value(v)))


def _header_value(h: HeaderValue) -> str:
    return (h.raw_value or h.value.encode()).decode("latin-1")


def answer(answers: Sequence[pb.ProcessingResponse], client: Sequence[tuple[str, str]] = (),
           chosen: str | None = None, facts: Mapping[str, str | int | float | bool] | None = None,
           hide: bool = False, retried: Sequence[tuple[str, str]] = ()) -> HttpAnswer:
    """The caller's answer from the machine's answers to the request's headers and body (`client`: the claim headers
    for the client's response, `chosen`: the worker they are for, `facts`: the claim's, for the observation, `hide`:
    the client sees no routing header, `retried`: the claim headers if another worker serves, after a retry). An
    immediate response among them is the answer; otherwise the mutations of both are applied in order."""
    out: list[tuple[str, str]] = []
    for response in answers:
        _facts(response, out)
        if response.HasField("immediate_response"):
            ir = response.immediate_response
            out += [(ACT, "respond"), (STATUS, str(ir.status.code or 200))]
            out += [(SET + o.header.key.lower(), _header_value(o.header)) for o in ir.headers.set_headers]
            return HttpAnswer(200, out, ir.body)
    sets: dict[str, str] = {}
    removed: list[str] = []
    body: bytes | None = None
    for response in answers:
        which = response.WhichOneof("response")
        if which not in ("request_headers", "request_body"):
            continue  # a deadline extension (override_message_timeout) and the like
        common = getattr(response, which).response
        for o in common.header_mutation.set_headers:
            key = o.header.key.lower()
            sets[key] = _header_value(o.header)
            if key in removed:
                removed.remove(key)
        for key in common.header_mutation.remove_headers:
            sets.pop(key.lower(), None)
            removed.append(key.lower())
        if common.HasField("body_mutation"):
            body = common.body_mutation.body
    out.append((ACT, "continue"))
    for key, value in (facts or {}).items():
        out.append((META + key, _value(struct_pb2.Value(bool_value=value) if isinstance(value, bool) else
                                       struct_pb2.Value(string_value=value) if isinstance(value, str) else
                                       struct_pb2.Value(number_value=value))))
    out += [(SET + k, v) for k, v in sets.items()]
    if removed:
        out.append((REMOVE, ",".join(removed)))
    out += [(CLIENT + k.lower(), v) for k, v in client]
    if chosen:
        out.append((CHOSEN, chosen))
    if hide:
        out.append((HIDE, "1"))
    out += [(RETRIED + k.lower(), v) for k, v in retried]
    if body is not None:
        out.append((BODY, "replace"))
    return HttpAnswer(200, out, body or b"")


def read_answer(headers: Mapping[str, str] | Iterable[tuple[str, str]], body: bytes) -> dict[str, Any]:
    """What the caller does with an answer, as a plain structure (tests, and the Lua caller's reference): `act`,
    `status`, `set`, `remove`, `body` (None: keep the request's), `client`, `facts`."""
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    out: dict[str, Any] = {"act": "", "status": 200, "set": {}, "remove": [], "body": None, "client": {},
                           "facts": {}, "hide": False, "retried": {}}
    sets, client, facts = out["set"], out["client"], out["facts"]
    for k, v in pairs:
        k = k.lower()
        if k == ACT:
            out["act"] = v
        elif k == STATUS:
            out["status"] = int(v)
        elif k == REMOVE:
            out["remove"] = [x for x in v.split(",") if x]
        elif k == BODY:
            out["body"] = body
        elif k == HIDE:
            out["hide"] = True
        elif k.startswith(RETRIED):
            out["retried"][k[len(RETRIED):]] = v
        elif k.startswith(SET):
            sets[k[len(SET):]] = v
        elif k.startswith(CLIENT):
            client[k[len(CLIENT):]] = v
        elif k.startswith(META):
            kind, text = v[:1], v[1:]
            facts[k[len(META):]] = text if kind == "s" else text == "1" if kind == "b" else float(text)
    if out["act"] == "respond":
        out["body"] = body
    return out
