"""The decision exchange over HTTP (extproc/http_exchange.py): the caller's call becomes the ext_proc messages Envoy
would send, and the machine's answers become the one answer the Lua caller acts on, with nothing lost either way."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from cortex import observation
from cortex.errors import ClientError
from extproc import http_exchange as X
from extproc.answers import EMPTY_HEADERS, error, header, immediate, observe_facts, set_body


def test_the_call_becomes_the_two_messages_envoy_would_send() -> None:
    head, body = X.messages([(X.METHOD, "POST"), (X.PATH, "/v1/chat/completions?x=1"), (X.AUTHORITY, "gw:8080"),
                             ("Host", "cortex-decide"), ("content-length", "9"), ("Authorization", "Bearer k"),
                             ("x-request-id", "r1"), ("x-extra", "a"), ("x-extra", "b")], b'{"a": 1}')
    pairs = [(h.key, h.raw_value.decode()) for h in head.request_headers.headers.headers]
    assert pairs[:4] == [(":method", "POST"), (":path", "/v1/chat/completions?x=1"), (":authority", "gw:8080"),
                         (":scheme", "http")]
    # The call's own host and length are not the request's; repeated headers stay repeated, names lowercase.
    assert ("host", "cortex-decide") not in pairs and ("content-length", "8") in pairs
    assert ("authorization", "Bearer k") in pairs and pairs.count(("x-extra", "a")) == 1 and ("x-extra", "b") in pairs
    assert not head.request_headers.end_of_stream
    assert body.request_body.body == b'{"a": 1}' and body.request_body.end_of_stream


def test_a_routed_answer_carries_headers_removals_body_claims_and_facts() -> None:
    routed = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[header("x-cortex-pool", "pool_a"),
                                                       header("x-gateway-destination-endpoint", "1.2.3.4:80")],
                                          remove_headers=["x-cortex-tenant"]),
        clear_route_cache=True)))
    set_body(routed, b'{"stream_options": {"include_usage": true}}')
    observe_facts(routed, {observation.MODEL: "m", observation.STREAM: True, observation.PROMPT_TOKENS: 7})
    out = X.answer([EMPTY_HEADERS, routed], [("x-cortex-cache-hit-tokens", "96")], "1.2.3.4:80",
                   {observation.CLAIMED: 96, observation.MODE: "exact_kv_events"},
                   retried=[("x-cortex-cache-hit-tokens", "0"), ("x-cortex-route-reason", "retried:longest")])
    assert out.status == 200
    got = X.read_answer(out.headers, out.body)
    assert got["act"] == "continue"
    assert got["set"] == {"x-cortex-pool": "pool_a", "x-gateway-destination-endpoint": "1.2.3.4:80",
                          "content-length": "43"}
    assert got["remove"] == ["x-cortex-tenant"]
    assert got["body"] == b'{"stream_options": {"include_usage": true}}'
    assert got["client"] == {"x-cortex-cache-hit-tokens": "96"}
    assert got["facts"] == {observation.MODEL: "m", observation.STREAM: True, observation.PROMPT_TOKENS: 7.0,
                            observation.CLAIMED: 96.0, observation.MODE: "exact_kv_events"}
    assert (X.CHOSEN, "1.2.3.4:80") in out.headers
    assert got["retried"] == {"x-cortex-cache-hit-tokens": "0", "x-cortex-route-reason": "retried:longest"}
    assert not got["hide"]


def test_a_client_that_may_not_see_routing_gets_no_claims_only_the_word_to_hide_them() -> None:
    plain = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[header("x-cortex-pool", "p")]))))
    got = X.read_answer(*(lambda a: (a.headers, a.body))(X.answer([EMPTY_HEADERS, plain], hide=True,
                                                                  facts={observation.CLAIMED: 0})))
    assert got["hide"] and got["client"] == {} and got["facts"] == {observation.CLAIMED: 0.0}


def test_an_answer_without_a_body_change_keeps_the_requests_body() -> None:
    plain = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[header("x-cortex-pool", "p")]))))
    out = X.answer([EMPTY_HEADERS, plain])
    got = X.read_answer(out.headers, out.body)
    assert got["body"] is None and got["set"] == {"x-cortex-pool": "p"} and got["remove"] == []


def test_a_refusal_is_answered_whole_with_its_status_headers_body_and_facts() -> None:
    refused = error(ClientError(429, "slow down", reason="rate_limited", headers={"retry-after": "3"}))
    observe_facts(refused, {observation.TENANT: "t1", observation.DROPPED: "rate_limited"})
    out = X.answer([EMPTY_HEADERS, refused], [("x-cortex-cache-hit-tokens", "0")])
    got = X.read_answer(out.headers, out.body)
    assert got["act"] == "respond" and got["status"] == 429
    assert got["set"]["retry-after"] == "3" and got["set"]["content-type"] == "application/json"
    assert got["body"] == refused.immediate_response.body
    assert got["facts"] == {observation.TENANT: "t1", observation.DROPPED: "rate_limited"}
    assert got["client"] == {}  # a refusal claims nothing


def test_a_refusal_at_the_headers_phase_is_the_answer() -> None:
    out = X.answer([immediate(401, b'{"error": {}}')])
    got = X.read_answer(out.headers, out.body)
    assert got["act"] == "respond" and got["status"] == 401 and got["body"] == b'{"error": {}}'


def test_a_deadline_extension_among_the_answers_changes_nothing() -> None:
    from google.protobuf.duration_pb2 import Duration

    extend = pb.ProcessingResponse(override_message_timeout=Duration(seconds=30))
    routed = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[header("x-cortex-pool", "p")]))))
    got = X.read_answer(*(lambda a: (a.headers, a.body))(X.answer([EMPTY_HEADERS, extend, routed])))
    assert got["act"] == "continue" and got["set"] == {"x-cortex-pool": "p"}
