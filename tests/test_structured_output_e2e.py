"""Structured output end to end through the real Envoy, extproc and ingest, in front of two simulated vLLM workers:
an invalid schema is refused by Cortex before any worker sees it, a valid one is served, and with
`validate_responses` Envoy hands extproc the whole answer (ext_proc mode override) while the client gets it
unchanged. The simulator answers a schema request with a small instance of the schema that ignores `pattern`
(cortexsim/openai_api.py schema_instance), so a pattern makes its answer `invalid`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.harness import MODEL, Gateway, cluster, wait_for

pytestmark = pytest.mark.timeout(240)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
SERIES = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with cluster(tmp_path_factory.mktemp("schema"),
                 extra_config={"structured_output": {"validate_responses": True}}) as g:
        yield g


def metric(url: str, name: str, **match: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = SERIES.match(line)
        if m and m["name"] == name and set(match.items()) <= set(re.findall(r'(\w+)="([^"]*)"', m["labels"] or "")):
            total += float(m["value"])
    return total


def served(gw: Gateway) -> float:
    """Requests the simulated engines finished, over the fleet (their own counter)."""
    return sum(metric(s.url, "vllm:request_success_total") for s in gw.sims)


def answers(gw: Gateway, outcome: str) -> float:
    return metric(gw.ingest_url, "cortex_structured_output_answers_total", model=MODEL, outcome=outcome)


def post(gw: Gateway, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Who wrote the first program?"}],
            "max_tokens": 8, **extra}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=60)


def json_schema(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}


@pytest.mark.parametrize(("extra", "param"), [
    (json_schema({"type": "object", "properties": {"name": {"type": "SECRET_TYPE"}}}), "response_format"),
    ({"structured_outputs": {"json": '{"type": "object", "required": "name"'}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "(SECRET_TYPE"}}}, "structured_outputs"),
], ids=["response_format", "structured_outputs-text", "structured_outputs-regex"])
def test_an_invalid_schema_gets_400_and_reaches_no_worker(gw: Gateway, extra: dict[str, Any], param: str) -> None:
    before = served(gw)
    r = post(gw, **extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err == {"message": err["message"], "type": "invalid_request_error", "param": param, "code": 400}
    assert "SECRET_TYPE" not in r.text and param in err["message"]
    assert "x-cortex-assigned-worker" not in r.headers
    # A request the simulator served would show within a moment; a served one below proves the counter moves.
    post(gw)
    wait_for(lambda: served(gw) >= before + 1, what="the plain request counted")
    assert served(gw) == before + 1


@pytest.mark.parametrize(("schema", "outcome", "content"), [
    (SCHEMA, "valid", {"name": "a"}),
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[0-9]+$"}}, "required": ["code"]},
     "invalid", {"code": "a"}),
])
def test_a_valid_schema_is_served_and_its_answer_counted_unchanged(gw: Gateway, schema: dict[str, Any],
                                                                   outcome: str, content: Any) -> None:
    before = answers(gw, outcome)
    r = post(gw, **json_schema(schema))
    assert r.status_code == 200, r.text
    assert r.headers["x-cortex-assigned-worker"] in {s.id for s in gw.sims}
    assert int(r.headers["content-length"]) == len(r.content)
    doc = r.json()
    assert doc["object"] == "chat.completion" and doc["usage"]["completion_tokens"] >= 1
    assert orjson.loads(doc["choices"][0]["message"]["content"]) == content  # as the worker wrote it
    # Envoy sent the body to extproc, which counted it against the schema.
    wait_for(lambda: answers(gw, outcome) == before + 1, what=f"the answer counted {outcome}")


def test_a_streamed_answer_streams_and_is_not_counted(gw: Gateway) -> None:
    counted = sum(answers(gw, o) for o in ("valid", "invalid", "not_json", "too_large", "error"))
    events = 0
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
            **json_schema(SCHEMA)}
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                orjson.loads(line[6:])
                events += 1
    assert events >= 2
    # The same schema again, not streamed: counted; the streamed one before it never was.
    assert post(gw, **json_schema(SCHEMA)).status_code == 200
    wait_for(lambda: sum(answers(gw, o) for o in ("valid", "invalid", "not_json", "too_large", "error"))
             == counted + 1, what="only the whole answer counted")
    assert metric(gw.ingest_url, "cortex_structured_output_schema_cache_total", result="hit") >= 1


def test_a_request_without_a_schema_is_not_buffered(gw: Gateway) -> None:
    counted = sum(answers(gw, o) for o in ("valid", "invalid", "not_json", "too_large", "error"))
    assert post(gw).status_code == 200
    assert post(gw, response_format={"type": "json_object"}).status_code == 200
    valid = metric(gw.ingest_url, "cortex_structured_output_schema_checks_total", field="response_format",
                   outcome="valid")
    assert post(gw, **json_schema(SCHEMA)).status_code == 200  # a marker that the two above were processed
    wait_for(lambda: metric(gw.ingest_url, "cortex_structured_output_schema_checks_total", field="response_format",
                            outcome="valid") == valid + 1, what="the marker checked")
    wait_for(lambda: sum(answers(gw, o) for o in ("valid", "invalid", "not_json", "too_large", "error"))
             == counted + 1, what="the marker's answer counted")
