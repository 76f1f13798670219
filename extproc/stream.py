"""One ext_proc stream as a sans-IO state machine: events in, actions out (the shape of ingest/sync.py and h11).

Envoy opens one stream per HTTP request. The transport (extproc/server.py: ExtProc.process) turns each
ProcessingRequest into an event, performs the actions the machine returns (send an answer, extend Envoy's message
deadline, ask the decision core, await the waiting room, a PD pair or held headers) and feeds what came of them
back as events. No grpc, protobuf, asyncio, clock or globals here: answers are opaque values the transport built
(`A`), time comes in with the events, and the limits are pinned when the stream begins (its config generation).

    HEADERS --RequestHeaders--> BODY (answered, or held in full duplex until the body is whole)
    BODY --RequestBody (the last chunk; trailers end a full-duplex body)--> DECIDING [Decide(body)]
    BODY --full-duplex body past max_body_bytes--> REFUSED [Refuse(413)]; later chunks are dropped
    DECIDING --Decided(Answer)--> ROUTED [Send | SendSplit]
    DECIDING --Decided(Wait)--> WAITING [Extend(max_hold) unless already released, AwaitRoom]
    WAITING --Released(outcome) / Expired(503)--> as Decided, never back into the room
    DECIDING/WAITING --Pair--> PAIRING [Extend when the start may outlast the message deadline, StartPair]
    PAIRING --PairStarted(answer)--> ROUTED (the decode leg, a single worker, or the pair's error)
    ROUTED --ResponseHeaders(Answer)--> RESPONDED [Stamp]
    ROUTED --ResponseHeaders(Hold)--> HOLDING [Extend?, HoldHeaders(wait)] --Settled(outcome)--> as ResponseHeaders
    ROUTED/HOLDING --Fallback--> FALLBACK [Extend?, StartFallback] --FallbackDone(answer)--> RESPONDED [Stamp]
    RESPONDED --ResponseBody--> [Echo (full duplex) | AckResponseBody]; --ResponseTrailers--> [AckTrailers]
    any --Closed (clean end, client gone, cancelled)--> DONE [Release]

Envoy's own messages are taken in any phase, as Envoy may send them (a trailers message, a body after an
immediate answer): the machine then does what the protocol asks and no more. The events the transport makes
(Decided, Released, PairStarted, Settled, FallbackDone) are valid only in the phase that asked for them: another
is a bug in the transport, raised as ProtocolError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

A = TypeVar("A")


class Phase(Enum):
    HEADERS = "HEADERS"
    BODY = "BODY"
    REFUSED = "REFUSED"
    DECIDING = "DECIDING"
    WAITING = "WAITING"
    PAIRING = "PAIRING"
    ROUTED = "ROUTED"
    HOLDING = "HOLDING"
    FALLBACK = "FALLBACK"
    RESPONDED = "RESPONDED"
    DONE = "DONE"


class ProtocolError(RuntimeError):
    """The transport fed an event the machine did not ask for."""


@dataclass(frozen=True, slots=True)
class Limits:
    """The stream's figures, read once from the generation in force when it began."""

    max_body_bytes: int
    message_timeout_s: float
    """Envoy's deadline for one message (extproc.message_timeout_ms)."""
    max_hold_s: int
    """Envoy's max_message_timeout, fixed when Envoy started: the longest one extension may be."""


# -- outcomes: what the decision core made of a phase (the transport asks it and reports) -----------------------

@dataclass(frozen=True, slots=True)
class Answer(Generic[A]):
    """An answer built for Envoy: a route, a pass-through, or an immediate response (an error or a reply)."""

    answer: A
    immediate: bool = False


@dataclass(frozen=True, slots=True)
class Wait:
    """The request took a seat in the waiting room."""

    ready: bool = False
    """It was released (or dropped) already while entering: no deadline extension is needed."""


@dataclass(frozen=True, slots=True)
class Pair:
    """The request goes to a PD pair, which must be started before Envoy is answered."""

    wait_s: float
    """How long starting it may take."""


@dataclass(frozen=True, slots=True)
class Hold:
    """An SGLang decode answered its headers before its prefill leg settled: they wait until `until`."""

    until: float


@dataclass(frozen=True, slots=True)
class Fallback:
    """A pair failed before the client got a byte: one worker serves the request, from extproc."""

    timeout_s: float


BodyOutcome = Answer[A] | Wait | Pair
ResponseOutcome = Answer[A] | Hold | Fallback


# -- events -------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RequestHeaders(Generic[A]):
    answer: Answer[A]
    end_of_stream: bool = False
    duplex: bool = False
    """Full-duplex streamed request body (cortex epp behind a gateway that streams): Envoy keeps no chunk and
    routes on the headers answer, so that answer waits for the body."""
    duplex_out: bool = False
    """The response body is streamed too: every chunk is echoed."""


@dataclass(frozen=True, slots=True)
class RequestBody:
    data: bytes
    end_of_stream: bool = True


@dataclass(frozen=True, slots=True)
class RequestTrailers:
    pass


@dataclass(frozen=True, slots=True)
class Decided(Generic[A]):
    outcome: Answer[A] | Wait | Pair


@dataclass(frozen=True, slots=True)
class Released(Generic[A]):
    """The waiting room let the request go: it was routed anew (never into the room again)."""

    outcome: Answer[A] | Pair


@dataclass(frozen=True, slots=True)
class Expired(Generic[A]):
    """The waiting room gave up on the request (its time-to-live, or made way for another): the 503 to send."""

    answer: A


@dataclass(frozen=True, slots=True)
class PairStarted(Generic[A]):
    """Starting the pair is over: the decode leg's route, a single worker's (the pair could not start), or an
    error when none serves the model alone."""

    answer: Answer[A]


@dataclass(frozen=True, slots=True)
class ResponseHeaders(Generic[A]):
    outcome: Answer[A] | Hold | Fallback
    now: float


@dataclass(frozen=True, slots=True)
class Settled(Generic[A]):
    """The held decode headers' wait is over (the prefill leg settled, or the wait ran out)."""

    outcome: Answer[A] | Fallback


@dataclass(frozen=True, slots=True)
class FallbackDone(Generic[A]):
    answer: Answer[A]


@dataclass(frozen=True, slots=True)
class ResponseBody:
    data: bytes
    end_of_stream: bool = True


@dataclass(frozen=True, slots=True)
class ResponseTrailers:
    pass


@dataclass(frozen=True, slots=True)
class Closed:
    """The stream ended: cleanly, the client went away, or it was cancelled."""


Event = (RequestHeaders[A] | RequestBody | RequestTrailers | Decided[A] | Released[A] | Expired[A] | PairStarted[A]
         | ResponseHeaders[A] | Settled[A] | FallbackDone[A] | ResponseBody | ResponseTrailers | Closed)


# -- actions ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Send(Generic[A]):
    """Send this answer as it is (continue, route, or an immediate reply)."""

    answer: A


@dataclass(frozen=True, slots=True)
class SendSplit(Generic[A]):
    """Full duplex: the held headers answer (None: an empty one) merged with the body answer, then the body in
    chunks; `end_of_stream` is False when trailers end the request (then AckTrailers follows)."""

    headers: A | None
    answer: A
    body: bytes
    end_of_stream: bool


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer with an OpenAI-style error (an immediate response)."""

    status: int
    message: str


@dataclass(frozen=True, slots=True)
class Extend:
    """Extend Envoy's deadline for the message being answered (once per message, Envoy takes one)."""

    seconds: int


@dataclass(frozen=True, slots=True)
class Decide:
    """Ask the decision core for the body phase's outcome; feed it back as Decided."""

    body: bytes


@dataclass(frozen=True, slots=True)
class AwaitRoom:
    """Wait for the waiting room's verdict; feed Released or Expired."""


@dataclass(frozen=True, slots=True)
class StartPair:
    """Start the PD pair; feed PairStarted."""


@dataclass(frozen=True, slots=True)
class HoldHeaders:
    """Wait at most `wait_s` for the pair's prefill leg to settle; feed Settled."""

    wait_s: float


@dataclass(frozen=True, slots=True)
class StartFallback:
    """Serve the failed pair's request on one worker; feed FallbackDone."""


@dataclass(frozen=True, slots=True)
class Stamp(Generic[A]):
    """Send the response-headers answer (the claims the transport stamped). A PD pair's held decode abort is let
    go after `abort_delay_s` (an immediate answer: Envoy resets the decode itself once it took the answer)."""

    answer: A
    abort_delay_s: float


@dataclass(frozen=True, slots=True)
class Echo:
    """Full-duplex response: send this chunk back unchanged."""

    data: bytes
    end_of_stream: bool


@dataclass(frozen=True, slots=True)
class AckResponseBody:
    """A buffered response body (sent only when a schema check asked for it): check it, then continue."""

    data: bytes


@dataclass(frozen=True, slots=True)
class AckTrailers:
    which: str
    """"request" or "response"."""


@dataclass(frozen=True, slots=True)
class Release:
    """The request is over: release what it holds (in-flight count, waiting seat, ticket, breaker trial, PD
    legs) and wake the waiting room."""


Action = (Send[A] | SendSplit[A] | Refuse | Extend | Decide | AwaitRoom | StartPair | HoldHeaders | StartFallback
          | Stamp[A] | Echo | AckResponseBody | AckTrailers | Release)


@dataclass
class Stream(Generic[A]):
    """One ext_proc stream. `feed` takes one event and returns the actions to perform, in order."""

    limits: Limits
    phase: Phase = Phase.HEADERS
    duplex: bool = False
    duplex_out: bool = False
    held: A | None = None
    """Full duplex: the headers answer, held until the body is whole (its pick or its body may change)."""
    held_body: list[bytes] = field(default_factory=list)
    held_size: int = 0
    body: bytes = b""
    """The whole request body once it is whole (a full-duplex answer re-chunks it)."""
    trailers_end: bool = False
    """Trailers, not the last body chunk, ended the request body."""
    extended: bool = False
    """The body message's deadline was extended already (for the wait: it covers a released pair's start)."""

    def feed(self, event: Event[A]) -> list[Action[A]]:
        if self.phase is Phase.DONE and not isinstance(event, Closed):
            raise ProtocolError(f"{type(event).__name__} after the stream ended")
        match event:
            case RequestHeaders():
                return self._headers(event)
            case RequestBody():
                return self._body(event.data, event.end_of_stream, trailers=False)
            case RequestTrailers():
                if self.held is not None:  # full duplex: trailers end the held body
                    return self._body(b"", True, trailers=True)
                return [AckTrailers("request")]
            case Decided():
                self._expect(Phase.DECIDING, event)
                return self._decided(event.outcome)
            case Released():
                self._expect(Phase.WAITING, event)
                return self._decided(event.outcome)
            case Expired():
                self._expect(Phase.WAITING, event)
                return self._route(Answer(event.answer, True))
            case PairStarted():
                self._expect(Phase.PAIRING, event)
                return self._route(event.answer)
            case ResponseHeaders():
                return self._response(event.outcome, event.now)
            case Settled():
                self._expect(Phase.HOLDING, event)
                return self._response(event.outcome, 0.0)
            case FallbackDone():
                self._expect(Phase.FALLBACK, event)
                return self._stamp(event.answer)
            case ResponseBody():
                if self.duplex_out:  # Envoy forwards only what comes back
                    return [Echo(event.data, event.end_of_stream)]
                return [AckResponseBody(event.data)]
            case ResponseTrailers():
                return [AckTrailers("response")]
            case Closed():
                if self.phase is Phase.DONE:
                    return []
                self.phase = Phase.DONE
                return [Release()]
        raise ProtocolError(f"unknown event {event!r}")

    def _expect(self, phase: Phase, event: object) -> None:
        if self.phase is not phase:
            raise ProtocolError(f"{type(event).__name__} in phase {self.phase.value}, expected {phase.value}")

    # -- request ---------------------------------------------------------------------------------------------

    def _headers(self, event: RequestHeaders[A]) -> list[Action[A]]:
        self.duplex, self.duplex_out = event.duplex, event.duplex_out
        answer = event.answer
        if answer.immediate:
            self.phase = Phase.ROUTED
        elif event.end_of_stream:
            self.phase = Phase.ROUTED  # no body follows (a GET): the headers answer routed it
        else:
            self.phase = Phase.BODY
        if self.duplex and not event.end_of_stream and not answer.immediate:
            self.held = answer.answer
            return []
        return [Send(answer.answer)]

    def _body(self, data: bytes, end: bool, trailers: bool) -> list[Action[A]]:
        if not self.duplex:
            # Buffered: Envoy sends the whole body in one message.
            self.body, self.trailers_end = data, False
            self.phase, self.extended = Phase.DECIDING, False
            return [Decide(data)]
        if self.held_size < 0:
            return []  # refused as too large: Envoy ends the request
        self.held_body.append(data)
        self.held_size += len(data)
        if self.held_size > self.limits.max_body_bytes:
            # Envoy's buffer limit does not bound a streamed body: this does.
            self.held_body.clear()
            self.held_size = -1
            self.phase = Phase.REFUSED
            return [Refuse(413, f"The request body is larger than {self.limits.max_body_bytes} bytes.")]
        if not end:
            return []
        self.body = b"".join(self.held_body)
        self.held_body.clear()
        self.trailers_end = trailers
        self.phase, self.extended = Phase.DECIDING, False
        return [Decide(self.body)]

    def _decided(self, outcome: Answer[A] | Wait | Pair) -> list[Action[A]]:
        match outcome:
            case Wait():
                if self.phase is Phase.WAITING:
                    raise ProtocolError("a released request is never sent back into the waiting room")
                self.phase = Phase.WAITING
                if outcome.ready:
                    return [AwaitRoom()]
                # Envoy takes one deadline extension per message: this one covers the wait and whatever the
                # released request then takes (a PD pair's start).
                self.extended = True
                return [Extend(self.limits.max_hold_s), AwaitRoom()]
            case Pair():
                self.phase = Phase.PAIRING
                if not self.extended and outcome.wait_s > self.limits.message_timeout_s:
                    # A vLLM prefill leg can outlast Envoy's per-message deadline: extend it first.
                    return [Extend(int(outcome.wait_s) + 5), StartPair()]
                return [StartPair()]
            case Answer():
                return self._route(outcome)
        raise ProtocolError(f"unknown outcome {outcome!r}")

    def _route(self, answer: Answer[A]) -> list[Action[A]]:
        self.phase = Phase.ROUTED
        if not self.duplex or answer.immediate:
            return [Send(answer.answer)]
        held, self.held = self.held, None
        actions: list[Action[A]] = [SendSplit(held, answer.answer, self.body, not self.trailers_end)]
        if self.trailers_end:
            # Trailers ended the body: its last chunk does not end the stream, the trailers answer does.
            actions.append(AckTrailers("request"))
        return actions

    # -- response --------------------------------------------------------------------------------------------

    def _response(self, outcome: Answer[A] | Hold | Fallback, now: float) -> list[Action[A]]:
        match outcome:
            case Hold():
                # SGLang streams answer 200 before the KV arrives; holding the headers until the prefill leg is
                # over costs nothing (the first token needs that KV) and keeps a failure before the first byte.
                if self.phase is Phase.HOLDING:
                    raise ProtocolError("held headers are held once")
                self.phase = Phase.HOLDING
                wait = max(0.0, outcome.until - now)
                actions: list[Action[A]] = []
                if wait > self.limits.message_timeout_s:
                    actions.append(Extend(int(wait) + 5))
                return [*actions, HoldHeaders(wait)]
            case Fallback():
                # The pair failed and nothing reached the client yet: extproc serves it on one worker.
                self.phase = Phase.FALLBACK
                if outcome.timeout_s > self.limits.message_timeout_s:
                    return [Extend(int(outcome.timeout_s) + 5), StartFallback()]
                return [StartFallback()]
            case Answer():
                return self._stamp(outcome)
        raise ProtocolError(f"unknown outcome {outcome!r}")

    def _stamp(self, answer: Answer[A]) -> list[Action[A]]:
        self.phase = Phase.RESPONDED
        return [Stamp(answer.answer, 1.0 if answer.immediate else 0.0)]
