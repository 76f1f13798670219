"""The ext_proc stream machine (extproc/stream.py) driven in process by scripted event sequences.

Answers are plain strings here: the machine never looks inside them, it only says which goes out when, which
deadline is extended, and what must be asked or awaited next.
"""

from __future__ import annotations

import pytest

from extproc import stream as s
from extproc.stream import (
    AckResponseBody,
    AckTrailers,
    Answer,
    AwaitRoom,
    Closed,
    Decide,
    Decided,
    Echo,
    Expired,
    Extend,
    Fallback,
    FallbackDone,
    Hold,
    HoldHeaders,
    Pair,
    PairStarted,
    Phase,
    ProtocolError,
    Refuse,
    Release,
    Released,
    RequestBody,
    RequestHeaders,
    RequestTrailers,
    ResponseBody,
    ResponseHeaders,
    ResponseTrailers,
    Send,
    SendSplit,
    Settled,
    Stamp,
    StartFallback,
    StartPair,
    Wait,
)

LIMITS = s.Limits(max_body_bytes=100, message_timeout_s=5.0, max_hold_s=70)


def machine() -> s.Stream[str]:
    return s.Stream(LIMITS)


def test_buffered_request_goes_headers_body_route_response_end() -> None:
    m = machine()
    assert m.feed(RequestHeaders(Answer("continue"))) == [Send("continue")]
    assert m.phase is Phase.BODY
    assert m.feed(RequestBody(b'{"model": "m"}')) == [Decide(b'{"model": "m"}')]
    assert m.phase is Phase.DECIDING
    assert m.feed(Decided(Answer("route"))) == [Send("route")]
    assert m.feed(ResponseHeaders(Answer("stamped"), now=1.0)) == [Stamp("stamped", 0.0)]
    assert m.feed(ResponseBody(b"{}")) == [AckResponseBody(b"{}")]
    assert m.feed(ResponseTrailers()) == [AckTrailers("response")]
    assert m.feed(Closed()) == [Release()]
    assert m.phase is Phase.DONE


def test_bad_json_is_answered_with_the_error_and_the_stream_still_releases() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    assert m.feed(RequestBody(b"{not json")) == [Decide(b"{not json")]
    assert m.feed(Decided(Answer("400", immediate=True))) == [Send("400")]
    assert m.feed(Closed()) == [Release()]
    assert m.feed(Closed()) == []  # released once


def test_immediate_headers_answer_needs_no_body() -> None:
    m = machine()
    assert m.feed(RequestHeaders(Answer("401", immediate=True))) == [Send("401")]
    assert m.phase is Phase.ROUTED
    assert m.feed(Closed()) == [Release()]


def test_waiting_then_released_extends_the_deadline_once_and_then_routes() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    assert m.feed(Decided(Wait())) == [Extend(70), AwaitRoom()]
    assert m.phase is Phase.WAITING
    assert m.feed(Released(Answer("route"))) == [Send("route")]
    assert m.phase is Phase.ROUTED


def test_released_into_a_pair_takes_no_second_extension() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    m.feed(Decided(Wait()))
    # The wait's extension covers the pair's start: Envoy takes one per message.
    assert m.feed(Released(Pair(wait_s=30.0))) == [StartPair()]
    assert m.feed(PairStarted(Answer("decode"))) == [Send("decode")]


def test_released_while_entering_needs_no_extension() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    assert m.feed(Decided(Wait(ready=True))) == [AwaitRoom()]
    assert m.feed(Released(Answer("route"))) == [Send("route")]


def test_room_expired_answers_the_503() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    m.feed(Decided(Wait()))
    assert m.feed(Expired("503")) == [Send("503")]
    assert m.feed(Closed()) == [Release()]


def test_client_gone_while_waiting_releases_the_seat() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    m.feed(Decided(Wait()))
    assert m.feed(Closed()) == [Release()]
    with pytest.raises(ProtocolError):
        m.feed(Released(Answer("route")))  # too late: the stream is over


def test_a_released_request_never_waits_again() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    m.feed(Decided(Wait()))
    with pytest.raises(ProtocolError):
        m.feed(Released(Wait()))  # type: ignore[arg-type]


def test_pair_start_extends_only_past_the_message_deadline() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    assert m.feed(Decided(Pair(wait_s=12.5))) == [Extend(17), StartPair()]
    assert m.phase is Phase.PAIRING
    short = machine()
    short.feed(RequestHeaders(Answer("continue")))
    short.feed(RequestBody(b"{}"))
    assert short.feed(Decided(Pair(wait_s=2.0))) == [StartPair()]


def test_pair_that_cannot_start_answers_with_what_the_transport_built() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    m.feed(Decided(Pair(wait_s=1.0)))
    assert m.feed(PairStarted(Answer("502", immediate=True))) == [Send("502")]


def test_pair_failed_before_the_first_byte_falls_back_to_one_worker() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    m.feed(Decided(Pair(wait_s=1.0)))
    m.feed(PairStarted(Answer("decode")))
    assert m.feed(ResponseHeaders(Fallback(timeout_s=60.0), now=0.0)) == [Extend(65), StartFallback()]
    assert m.phase is Phase.FALLBACK
    # The single worker's whole answer is an immediate response: the decode's abort waits for Envoy to take it.
    assert m.feed(FallbackDone(Answer("single", immediate=True))) == [Stamp("single", 1.0)]
    assert m.phase is Phase.RESPONDED


def test_held_sglang_headers_wait_for_the_prefill_then_stream() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    m.feed(Decided(Pair(wait_s=1.0)))
    m.feed(PairStarted(Answer("decode")))
    assert m.feed(ResponseHeaders(Hold(until=103.0), now=100.0)) == [HoldHeaders(3.0)]
    assert m.phase is Phase.HOLDING
    assert m.feed(Settled(Answer("pair"))) == [Stamp("pair", 0.0)]


def test_held_headers_past_the_deadline_extend_it_and_a_failed_prefill_falls_back() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    m.feed(Decided(Pair(wait_s=1.0)))
    m.feed(PairStarted(Answer("decode")))
    assert m.feed(ResponseHeaders(Hold(until=130.0), now=100.0)) == [Extend(35), HoldHeaders(30.0)]
    assert m.feed(Settled(Fallback(timeout_s=2.0))) == [StartFallback()]
    assert m.feed(FallbackDone(Answer("pair error"))) == [Stamp("pair error", 0.0)]


def test_held_headers_already_past_their_time_wait_zero() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    m.feed(RequestBody(b"{}"))
    m.feed(Decided(Pair(wait_s=1.0)))
    m.feed(PairStarted(Answer("decode")))
    assert m.feed(ResponseHeaders(Hold(until=90.0), now=100.0)) == [HoldHeaders(0.0)]


def test_transport_events_out_of_phase_are_bugs() -> None:
    m = machine()
    with pytest.raises(ProtocolError):
        m.feed(Decided(Answer("route")))
    m.feed(RequestHeaders(Answer("continue")))
    with pytest.raises(ProtocolError):
        m.feed(PairStarted(Answer("decode")))
    with pytest.raises(ProtocolError):
        m.feed(Settled(Answer("x")))


def test_request_trailers_in_buffered_mode_are_acknowledged() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("continue")))
    assert m.feed(RequestTrailers()) == [AckTrailers("request")]


# -- full duplex (cortex epp behind a gateway that streams the body) ----------------------------------------

def test_duplex_holds_the_headers_answer_until_the_body_is_whole() -> None:
    m = machine()
    assert m.feed(RequestHeaders(Answer("pick-later"), duplex=True, duplex_out=True)) == []
    assert m.feed(RequestBody(b'{"a":', end_of_stream=False)) == []
    assert m.feed(RequestBody(b"1}", end_of_stream=True)) == [Decide(b'{"a":1}')]
    assert m.feed(Decided(Answer("route"))) == [SendSplit("pick-later", "route", b'{"a":1}', True)]
    assert m.held is None
    assert m.feed(ResponseHeaders(Answer("stamped"), now=0.0)) == [Stamp("stamped", 0.0)]
    assert m.feed(ResponseBody(b"data: x", end_of_stream=False)) == [Echo(b"data: x", False)]


def test_duplex_body_ended_by_trailers_acknowledges_them_after_the_body() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("h"), duplex=True))
    assert m.feed(RequestBody(b"{}", end_of_stream=False)) == []
    assert m.feed(RequestTrailers()) == [Decide(b"{}")]
    assert m.feed(Decided(Answer("route"))) == [SendSplit("h", "route", b"{}", False), AckTrailers("request")]


def test_duplex_body_past_the_limit_is_refused_once_and_the_rest_dropped() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("h"), duplex=True))
    assert m.feed(RequestBody(b"x" * 60, end_of_stream=False)) == []
    assert m.feed(RequestBody(b"x" * 60, end_of_stream=False)) == [
        Refuse(413, "The request body is larger than 100 bytes.")]
    assert m.feed(RequestBody(b"x", end_of_stream=True)) == []
    assert m.feed(RequestTrailers()) == []
    assert m.feed(Closed()) == [Release()]


def test_duplex_immediate_answer_is_sent_alone() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("h"), duplex=True))
    m.feed(RequestBody(b"{}", end_of_stream=True))
    assert m.feed(Decided(Answer("400", immediate=True))) == [Send("400")]


def test_duplex_waiting_then_released_splits_the_released_answer() -> None:
    m = machine()
    m.feed(RequestHeaders(Answer("h"), duplex=True))
    m.feed(RequestBody(b"{}", end_of_stream=True))
    assert m.feed(Decided(Wait())) == [Extend(70), AwaitRoom()]
    assert m.feed(Released(Answer("route"))) == [SendSplit("h", "route", b"{}", True)]


def test_duplex_headers_with_end_of_stream_are_answered_at_once() -> None:
    m = machine()
    assert m.feed(RequestHeaders(Answer("route-any"), end_of_stream=True, duplex=True)) == [Send("route-any")]
    assert m.phase is Phase.ROUTED


def test_the_machine_imports_no_io() -> None:
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(s))
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "dataclasses", "enum", "typing"}
