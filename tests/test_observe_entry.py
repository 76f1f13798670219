"""observe/entry.py and observe/recent.py with hand-made access-log entries: every ending maps to its cause,
the claim is compared with the engine's figure, and nothing missing is invented."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as al

from cortex import observation as obs
from observe.entry import CAUSES, OUTCOMES, read
from observe.recent import Recent

START = 1_800_000_000.25


def entry(*, status: int | None = 200, details: str = "via_upstream", flags: tuple[str, ...] = (),
          facts: dict[str, Any] | None = None, seen: dict[str, Any] | None = None, upstream: str = "",
          e2e_s: float | None = 0.5) -> al.HTTPAccessLogEntry:
    e = al.HTTPAccessLogEntry()
    c = e.common_properties
    c.start_time.seconds, c.start_time.nanos = int(START), int((START % 1) * 1e9)
    if e2e_s is not None:
        c.time_to_last_downstream_tx_byte.FromNanoseconds(int(e2e_s * 1e9))
    for f in flags:
        setattr(c.response_flags, f, True)
    if facts is not None:
        c.metadata.filter_metadata[obs.NAMESPACE].update(facts)
    if seen is not None:
        c.metadata.filter_metadata[obs.OBSERVED].update(seen)
    if upstream:
        host, port = upstream.split(":")
        c.upstream_remote_address.socket_address.address = host
        c.upstream_remote_address.socket_address.port_value = int(port)
    e.request.request_id = "r1"
    e.request.path = "/v1/chat/completions?x=1"
    e.request.request_method = 3  # POST
    if status is not None:
        e.response.response_code.value = status
    e.response.response_code_details = details
    return e


ROUTED = {obs.MODEL: "m", obs.STREAM: True, obs.WORKER: "w1", obs.MODE: "exact_kv_events",
          obs.REASON: "longest_cached_prefix", obs.CLAIMED: 1024}
SEEN = {"first_us": (START + 0.120) * 1e6, "last_us": (START + 0.120 + 0.4) * 1e6, "chunks": 7,
        "prompt_tokens": 1042, "completion_tokens": 5, "cached_tokens": 1024}


def test_a_routed_stream_with_usage() -> None:
    o = read(entry(facts=ROUTED, seen=SEEN), {})
    assert (o.routed, o.model, o.worker, o.mode, o.method, o.path) == (True, "m", "w1", "exact_kv_events", "POST",
                                                                       "/v1/chat/completions")
    assert (o.prompt_tokens, o.completion_tokens, o.cached_tokens, o.claimed) == (1042, 5, 1024, 1024)
    assert o.ttft_s == pytest.approx(0.120, abs=1e-6)
    assert o.itl_s == pytest.approx(0.4 / 4, abs=1e-6)
    assert o.e2e_s == pytest.approx(0.5)
    assert (o.status, o.cause, o.outcome) == (200, "", "exact")


@pytest.mark.parametrize(("claimed", "cached", "outcome"), [
    (1040, 1024, "over"), (1024, 1024, "exact"), (0, 1024, "under"), (16, None, "unreported"), (None, 5, None)])
def test_the_claim_against_the_engine(claimed: int | None, cached: int | None, outcome: str | None) -> None:
    facts = {k: v for k, v in ROUTED.items() if k != obs.CLAIMED}
    if claimed is not None:
        facts[obs.CLAIMED] = claimed
    seen = {k: v for k, v in SEEN.items() if k != "cached_tokens"}
    if cached is not None:
        seen["cached_tokens"] = cached
    o = read(entry(facts=facts, seen=seen), {})
    assert o.outcome == outcome
    assert outcome is None or outcome in OUTCOMES


@pytest.mark.parametrize(("status", "details", "flags", "cause"), [
    (200, "via_upstream", (), ""),
    (None, "", ("downstream_remote_reset",), "client_disconnect"),
    (200, "via_upstream", ("downstream_connection_termination", "upstream_remote_reset"), "client_disconnect"),
    (200, "via_upstream", ("upstream_connection_termination",), "upstream_reset"),
    (504, "response_timeout", ("upstream_request_timeout",), "upstream_timeout"),
    (503, "upstream_reset_before_response_started{connection_failure}", ("upstream_connection_failure",),
     "upstream_connect_failure"),
    (503, "no_healthy_upstream", ("no_healthy_upstream",), "no_healthy_upstream"),
    (400, "ext_proc_immediate_response", (), "local_reply"),
    (500, "via_upstream", (), "upstream_5xx"),
    (429, "via_upstream", (), "upstream_4xx"),
])
def test_every_ending_has_its_cause(status: int | None, details: str, flags: tuple[str, ...], cause: str) -> None:
    o = read(entry(status=status, details=details, flags=flags, facts=ROUTED), {})
    assert o.cause == cause and cause in CAUSES
    assert o.status == (status or 0)


def test_the_prompt_is_identified_not_stored() -> None:
    facts = {**ROUTED, obs.PROMPT_HASH: "9f2c", obs.PROMPT_TOKENS: 1040,
             obs.FIRST_IDS: ",".join(map(str, range(70)))}
    o = read(entry(facts=facts, seen=SEEN), {})
    assert (o.prompt_hash, o.routed_prompt_tokens, o.first_ids) == ("9f2c", 1040, tuple(range(64)))
    assert read(entry(facts={**ROUTED, obs.FIRST_IDS: "1,x"}, seen=SEEN), {}).first_ids == ()
    assert obs.prompt_hash("a chat", None) == obs.prompt_hash("a chat", None) != obs.prompt_hash("a chat!", None)
    assert obs.prompt_hash(None, [1, 2, 3]) != obs.prompt_hash(None, [1, 2, 4]) and obs.prompt_hash(None, None) == ""


def test_what_is_missing_stays_missing() -> None:
    # Envoy answered itself (no extproc facts), the engine sent no usage, the client left before any byte.
    o = read(entry(status=None, details="", flags=("downstream_remote_reset",), e2e_s=None,
                   upstream="10.0.0.7:8000"), {"10.0.0.7:8000": "w7"})
    assert (o.routed, o.model, o.worker, o.claimed, o.outcome) == (False, "", "w7", None, None)
    assert (o.prompt_tokens, o.completion_tokens, o.cached_tokens, o.ttft_s, o.itl_s, o.e2e_s) == (None,) * 6
    assert o.chunks == 0


def test_a_json_answer_has_no_ttft_and_a_one_token_stream_no_itl() -> None:
    assert read(entry(facts={**ROUTED, obs.STREAM: False}, seen=SEEN), {}).ttft_s is None
    one = read(entry(facts=ROUTED, seen={**SEEN, "completion_tokens": 1}), {})
    assert one.ttft_s is not None and one.itl_s is None


def test_recent_keeps_the_last_decisions_the_minute_and_the_hour() -> None:
    r = Recent(max_decisions=3)
    for i in range(5):
        r.add(read(entry(facts={**ROUTED, obs.CLAIMED: i}, seen=SEEN), {}), now=1000.0 + i * 20)
    r.add(read(entry(), {}), now=1100.0)  # not routed: not a decision
    assert [d["claimed_hit_tokens"] for d in r.last(10)] == [4, 3, 2]
    # Samples at 1000, 1020, ..., 1080; at 1100 the last minute holds 1040..1080.
    assert r.workers(1100.0) == {"w1": {"ttft_avg_60s_ms": 120.0, "requests_60s": 3}}
    assert r.workers(1200.0) == {"w1": {"ttft_avg_60s_ms": None, "requests_60s": 0}}
    points = r.hit_ratio(1100.0, 3600)["points"]
    assert [p["t"] for p in points] == [1000, 1020, 1040, 1060, 1080]
    assert all(p["prompt_tokens"] == 1042 and p["engine_cached_tokens"] == 1024 for p in points)
    assert [p["t"] for p in r.hit_ratio(1100.0, 30)["points"]] == [1080]
    assert r.hit_ratio(1000.0 + 3700, 3600)["points"] == []


@pytest.mark.parametrize(("stream", "body", "sent"), [
    (False, {"stream_options": None}, None),  # not a stream: nothing asked
    (True, {}, {"include_usage": True, "continuous_usage_stats": False}),
    (True, {"stream_options": {"include_usage": True}}, None),  # the client asked itself
    (True, {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, None),
    # Asked not to: Cortex asks, and per-chunk usage stays off as the client would have had it.
    (True, {"stream_options": {"include_usage": False, "continuous_usage_stats": True}},
     {"include_usage": True, "continuous_usage_stats": False}),
    (True, {"stream_options": "odd"}, {"include_usage": True, "continuous_usage_stats": False}),
])
def test_what_cortex_asks_the_engine_for_a_streams_usage(stream: bool, body: dict[str, Any],
                                                          sent: dict[str, Any] | None) -> None:
    from extproc.answers import usage_options
    assert usage_options(stream, body) == sent


def test_the_alias_a_request_named_labels_its_per_target_series() -> None:
    from prometheus_client import REGISTRY

    from observe import metrics

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    plain = read(entry(facts=ROUTED, seen=SEEN), {})
    assert plain.alias == ""
    named = read(entry(facts={**ROUTED, obs.ALIAS: "chat", obs.MODEL: "m-canary"}, seen=SEEN, status=503,
                       details="upstream_reset_before_response_started"), {})
    assert (named.alias, named.model) == ("chat", "m-canary")
    labels = metrics.Labels()
    before = {k: sample(f"cortex_alias_{k}", alias="chat", model="m-canary", **extra) for k, extra in
              (("requests_total", {"code": "503"}), ("ttft_seconds_count", {}))}
    untouched = sample("cortex_alias_requests_total", alias="", model="m", code="200")
    metrics.record(named, labels)
    metrics.record(plain, labels)
    assert sample("cortex_alias_requests_total", alias="chat", model="m-canary", code="503") == \
        before["requests_total"] + 1
    assert sample("cortex_alias_ttft_seconds_count", alias="chat", model="m-canary") == \
        before["ttft_seconds_count"] + 1
    assert sample("cortex_alias_request_errors_total", alias="chat", model="m-canary", cause=named.cause) >= 1
    # A request that named a model directly has no alias series.
    assert sample("cortex_alias_requests_total", alias="", model="m", code="200") == untouched == 0.0
    # Bounded: past MAX_ALIASES distinct names, `other`.
    assert all(labels.alias(f"a{i}") == f"a{i}" for i in range(metrics.MAX_ALIASES - 1))
    assert labels.alias("one-too-many") == "other"
