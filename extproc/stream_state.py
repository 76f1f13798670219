"""What one ext_proc stream keeps between its messages (StreamState), and the values its phases hand the
transport (extproc/server.py) to act on: a pair to start, a seat in the waiting room, held decode headers, a
fallback to serve."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import structured_output
from extproc.admission import Ticket
from extproc.breaker import Trial
from extproc.inference_paths import InferencePath
from extproc.pd import PdPlan
from extproc.pd_dispatch import PairResult
from extproc.plan import RoutePlan
from extproc.policies.base import Decision
from extproc.request import ParsedRequest
from extproc.request_head import NO_HEAD, RequestHead
from extproc.snapshot import Generation
from extproc.tenants import Tenant
from extproc.waiting_room import Entry


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request body parsed, rewritten (llm-d's model rewrite), salted and checked, once: what routing it needs,
    now or when the waiting room releases it (routed anew then, never parsed again)."""

    spec: InferencePath
    parsed: ParsedRequest
    body: bytes
    """The body as it goes on (after a model rewrite)."""
    salted: dict[str, object]
    """The isolation salt's changes to the body (extproc/isolation.py)."""
    rewritten: bool
    """Its body names another model than the client's (llm-d's model rewrite): the new body goes upstream."""
    schema: structured_output.Expected | None
    """The schema a whole (non-streamed) answer is checked against (structured_output.validate_responses)."""
    parse_s: float
    """How long parsing and checking took (part of the decision time observed)."""


@dataclass(slots=True)
class PendingPair:
    """A routed request whose PD pair still has to be started (the only await on the request path)."""

    result: RoutePlan
    plan: PdPlan
    doc: dict[str, Any]
    body: bytes
    changes: dict[str, object]
    wait_s: float
    """How long starting the pair may take (Envoy's message deadline is extended when it is longer)."""


@dataclass(slots=True)
class Seat:
    """A request in the waiting room: its stream's state (routed once released from what it admitted,
    `st.admitted`) and where its answer goes."""

    st: StreamState
    answer: asyncio.Future[pb.ProcessingResponse | PendingPair]


@dataclass(slots=True)
class Waiting:
    """A request that waits for a worker with room (extproc/waiting_room.py): `process` extends Envoy's deadline for
    the message, then awaits its answer: routed anew once released, a 503 once expired."""

    entry: Entry[Seat]


@dataclass(frozen=True, slots=True)
class PoolFacts:
    """What the waiting room knows about one pool's workers, from the last request it routed: a pool has room again
    once one of them (or a worker that joined the model since) is no longer full."""

    model: str
    slots: frozenset[int]
    """The decision's candidates."""
    known: frozenset[int]
    """Every target of the model then (one not among them joined since)."""


@dataclass(slots=True)
class HoldHeaders:
    """An SGLang decode answered its headers before its prefill leg finished: they wait for it (bounded)."""

    until: float
    """time.monotonic() past which the headers go out anyway."""


@dataclass(slots=True)
class DecodeFallback:
    """A pair that failed before the client got a byte, to be served by one worker from a cold start."""

    why: str
    decision: Decision
    """The plan's fallback decision, without the pair's workers that failed (while others exist)."""


@dataclass(slots=True)
class StreamState:
    """What one stream keeps between its messages, grouped by the phase that writes it: the stream's start and
    its request headers (once), its body (once), the waiting room, the commitment to a worker (extproc/acting.py),
    a PD pair (extproc/pd_act.py), its end."""

    # -- the stream's start and its request headers: written once
    gen: Generation | None = None
    """The config generation in force when its stream began: its request phases read this one, so a reload
    between its headers and its body cannot identify it under one generation and route it under the next."""
    head: RequestHead = NO_HEAD
    """What its headers said (extproc/request_head.py)."""
    tenant: Tenant | None = None
    """Who sent it (extproc/tenants.py), known from the request headers on."""
    priority: int | None = None
    """Its band when an llm-d objective named one (admission.objectives); None: its tenant's."""
    ticket: Ticket | None = None
    """What it holds of its tenant's limits until it ends (extproc/admission.py)."""

    # -- its body: written once, when it is admitted
    admitted: Admitted | None = None

    # -- the waiting room
    waiting: Entry[Seat] | None = None
    """Its place in the waiting room, once it had to wait."""
    queued_s: float | None = None
    """How long it waited there before it was released (None: it never waited)."""

    # -- its commitment to a worker
    decision: Decision | None = None
    counted_slot: int | None = None
    queued: tuple[tuple[int, int], ...] = ()
    """The prefill its committed plan queued, (slot, receipt): settled when the request ends."""
    trial: Trial | None = None
    """The slot it took of its first choice's half-open breaker (extproc/breaker.py), given back when it ends."""
    sent: int = 0
    """Endpoints named in x-gateway-destination-endpoint: with one, the one that served is known without Envoy
    saying it (no retry can go elsewhere)."""
    fallback_reason: str = ""

    # -- a PD pair
    pd: PairResult | None = None
    """The PD pair serving this request (its prefill leg is extproc's own)."""
    pd_note: str = ""
    """x-cortex-pd: pair, pair:repicked, skipped:<why>, fallback:<why> ('' for a model without a PD pool)."""
    pd_prefill_decision: Decision | None = None
    pd_pending: PendingPair | None = None
    """The request as the client sent it, kept while a pair serves it: a pair that fails before the first byte
    is served again by one worker."""

    # -- its end
    released: bool = False
    """What it held was let go (once)."""

    @property
    def answer_schema(self) -> structured_output.Expected | None:
        """The schema its whole answer is checked against, if any."""
        return self.admitted.schema if self.admitted is not None else None


@dataclass(slots=True)
class StreamIO:
    """What the transport keeps between an action and the event it feeds back (protobuf and futures: never the
    machine's)."""

    seat: Seat | None = None
    pending: PendingPair | None = None
    fallback: DecodeFallback | None = None
    response: Any = None
    """The response-headers message being answered."""
