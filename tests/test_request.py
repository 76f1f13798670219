"""Bad bodies are refused with the right status, the field as `param` and a message saying what is wrong;
bodies some engine accepts are never refused, and are read the way the engine reads them."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from cortex.errors import MAX_MESSAGE_CHARS, ClientError, error_body
from extproc.request import MAX_TEMPLATE_NESTING, MAX_TOKEN_ID, parse_body

USER = [{"role": "user", "content": "hi"}]


def dumps(doc: Any) -> bytes:
    # The standard library's encoder: orjson's stops at 255 levels, and the cases nest deeper.
    return json.dumps(doc).encode()


def chat(**kw: Any) -> bytes:
    return dumps({"model": "m", "messages": USER, **kw})


def comp(**kw: Any) -> bytes:
    return dumps({"model": "m", "prompt": "hi", **kw})


def msg(**kw: Any) -> bytes:
    """A chat whose single message is `kw`."""
    return dumps({"model": "m", "messages": [kw]})


def nested(depth: int) -> Any:
    """`depth` levels of containers: nested(1) == {}."""
    value: Any = {}
    for i in range(depth - 1):
        value = {"k": value} if i % 2 else [value]
    return value


def call(**kw: Any) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}, **kw}


def fn(**kw: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **kw}}


# (kind, body, param, fragment of the message)
REFUSED: list[tuple[str, bytes, str | None, str]] = [
    # -- not a JSON object --------------------------------------------------------------------------------
    ("chat", b"{not json", None, "not valid JSON"),
    ("chat", b"", None, "not valid JSON"),
    ("chat", b"   ", None, "not valid JSON"),
    ("chat", b'{"model": "m"', None, "not valid JSON"),
    ("chat", b'{"model": "m"} trailing', None, "not valid JSON"),
    ("chat", b"\xff\xfe{\x00}\x00", None, "not valid JSON"),
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "\xc3\x28"}]}', None, "not valid JSON"),
    ("chat", b'\xef\xbb\xbf{"model": "m"}', None, "not valid JSON"),
    ("chat", b'{"model": "m", "temperature": NaN}', None, "not valid JSON"),
    ("chat", b'{"model": "m", "temperature": Infinity}', None, "not valid JSON"),
    ("chat", b'{"model": "m", "temperature": 1e400}', None, "not valid JSON"),
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', None, "not valid JSON"),
    ("chat", b'{"model": "m", "x": ' + b"[" * 1100 + b"]" * 1100 + b"}", None, "not valid JSON"),
    ("chat", b"[1, 2]", None, "must be a JSON object"),
    ("chat", b'"a string"', None, "must be a JSON object"),
    ("chat", b"42", None, "must be a JSON object"),
    ("chat", b"null", None, "must be a JSON object"),
    ("completion", b"true", None, "must be a JSON object"),
    # -- model ----------------------------------------------------------------------------------------------
    ("chat", orjson.dumps({"messages": USER}), "model", "required"),
    ("chat", orjson.dumps({"model": "", "messages": USER}), "model", "non-empty string"),
    ("chat", orjson.dumps({"model": 5, "messages": USER}), "model", "string"),
    ("chat", orjson.dumps({"model": ["m"], "messages": USER}), "model", "string"),
    ("completion", orjson.dumps({"model": None, "prompt": "x"}), "model", "string"),
    # -- messages -------------------------------------------------------------------------------------------
    ("chat", orjson.dumps({"model": "m"}), "messages", "required"),
    ("chat", chat(messages=[]), "messages", "non-empty list"),
    ("chat", chat(messages="hi"), "messages", "non-empty list"),
    ("chat", chat(messages={"role": "user"}), "messages", "non-empty list"),
    ("chat", chat(messages=[5]), "messages", "messages[0] must be an object"),
    ("chat", chat(messages=[*USER, None]), "messages", "messages[1] must be an object"),
    ("chat", msg(content="x"), "messages", "messages[0].role must be a string"),
    ("chat", msg(role=5, content="x"), "messages", "role must be a string"),
    ("chat", msg(role=None, content="x"), "messages", "role must be a string"),
    ("chat", msg(role="user", content=5), "messages", "content must be a string, a list of parts, or null"),
    ("chat", msg(role="user", content={"type": "text"}), "messages", "content must be a string"),
    ("chat", msg(role="user", content=None), "messages", "must not be null for role 'user'"),
    ("chat", msg(role="narrator", content=None), "messages", "must not be null"),
    ("chat", msg(role="user", content=[5]), "messages", "content[0] must be an object or a string"),
    ("chat", msg(role="user", content=[None]), "messages", "content[0] must be an object or a string"),
    ("chat", msg(role="user", content=["a", {"text": "b"}]), "messages", "content[1].type must be a string"),
    ("chat", msg(role="user", content=[{"type": 5}]), "messages", "content[0].type must be a string"),
    ("chat", msg(role="user", content=[{"type": "text"}]), "messages", "content[0].text must be a string"),
    ("chat", msg(role="user", content=[{"type": "text", "text": 1}]), "messages", "text must be a string"),
    ("chat", msg(role="user", content=[{"type": "text", "text": None}]), "messages", "text must be a string"),
    ("chat", msg(role="assistant", content="", tool_calls="f()"), "messages", "tool_calls must be a list"),
    ("chat", msg(role="assistant", content="", tool_calls={}), "messages", "tool_calls must be a list"),
    ("chat", msg(role="assistant", content="", tool_calls=[5]), "messages", "tool_calls[0] must be an object"),
    ("chat", msg(role="assistant", tool_calls=[call(type="tool")]), "messages", "tool_calls[0].type must be"),
    ("chat", msg(role="assistant", tool_calls=[call(id=7)]), "messages", "tool_calls[0].id must be a string"),
    ("chat", msg(role="assistant", tool_calls=[{"id": "c"}]), "messages", "function must be an object"),
    ("chat", msg(role="assistant", tool_calls=[call(function="f()")]), "messages", "function must be an object"),
    ("chat", msg(role="assistant", tool_calls=[call(function={"name": 1})]), "messages", "name must be a string"),
    ("chat", msg(role="assistant", tool_calls=[call(function={"name": "f", "arguments": 5})]), "messages",
     "arguments must be a string or an object"),
    ("chat", msg(role="assistant", tool_calls=[call(function={"name": "f", "arguments": [1]})]), "messages",
     "arguments must be a string or an object"),
    ("chat", msg(role="user", content="x", extra=nested(MAX_TEMPLATE_NESTING + 1)), "messages",
     "messages[0].extra nests deeper than"),
    # -- tools ------------------------------------------------------------------------------------------------
    ("chat", chat(tools={}), "tools", "'tools' must be a list"),
    ("chat", chat(tools="f"), "tools", "'tools' must be a list"),
    ("chat", chat(tools=[5]), "tools", "tools[0] must be an object"),
    ("chat", chat(tools=[fn(), None]), "tools", "tools[1] must be an object"),
    ("chat", chat(tools=[{"type": 5, "function": {"name": "f"}}]), "tools", "tools[0].type must be a string"),
    ("chat", chat(tools=[{"type": "function"}]), "tools", "function must be an object with a string 'name'"),
    ("chat", chat(tools=[{"function": {"description": "no name"}}]), "tools", "string 'name'"),
    ("chat", chat(tools=[{"function": {"name": 3}}]), "tools", "string 'name'"),
    ("chat", chat(tools=[fn(description=5)]), "tools", "description must be a string"),
    ("chat", chat(tools=[fn(parameters=nested(MAX_TEMPLATE_NESTING - 2))]), "tools", "tools nests deeper than"),
    # -- chat-only fields ---------------------------------------------------------------------------------
    ("chat", chat(max_completion_tokens=-1), "max_completion_tokens", "an integer >= 0"),
    ("chat", chat(max_completion_tokens="many"), "max_completion_tokens", "an integer >= 0"),
    ("chat", chat(logprobs="sometimes"), "logprobs", "a boolean"),
    ("chat", chat(logprobs=5), "logprobs", "a boolean"),
    ("chat", chat(top_logprobs="x"), "top_logprobs", "an integer"),
    ("chat", chat(parallel_tool_calls="x"), "parallel_tool_calls", "a boolean"),
    ("chat", chat(tool_choice="sometimes"), "tool_choice", "'none', 'auto', 'required' or an object"),
    ("chat", chat(tool_choice=5), "tool_choice", "'none', 'auto', 'required' or an object"),
    ("chat", chat(response_format="json"), "response_format", "an object"),
    ("chat", chat(add_generation_prompt="perhaps"), "add_generation_prompt", "a boolean"),
    ("chat", chat(continue_final_message=[]), "continue_final_message", "a boolean"),
    ("chat", chat(chat_template_kwargs=[]), "chat_template_kwargs", "an object"),
    ("chat", chat(chat_template_kwargs="x"), "chat_template_kwargs", "an object"),
    ("chat", chat(chat_template_kwargs={"k": nested(MAX_TEMPLATE_NESTING)}), "chat_template_kwargs",
     "nests deeper than"),
    # -- completion-only fields ---------------------------------------------------------------------------
    ("completion", comp(logprobs="x"), "logprobs", "an integer or null"),
    ("completion", comp(logprobs=1.5), "logprobs", "an integer or null"),
    ("completion", comp(echo="x"), "echo", "a boolean"),
    ("completion", comp(best_of="x"), "best_of", "an integer"),
    ("completion", comp(suffix=5), "suffix", "a string"),
    ("completion", orjson.dumps({"model": "m"}), "prompt", "required"),
    ("completion", comp(prompt=None), "prompt", "required"),
    ("completion", comp(prompt=5), "prompt", "must be a string"),
    ("completion", comp(prompt={"text": "x"}), "prompt", "must be a string"),
    ("completion", comp(prompt=[]), "prompt", "not empty"),
    ("completion", comp(prompt=[[]]), "prompt", "not empty"),
    ("completion", comp(prompt=[[1], []]), "prompt", "not empty"),
    ("completion", comp(prompt=[1, "a"]), "prompt", "token ids"),
    ("completion", comp(prompt=["a", 1]), "prompt", "token ids"),
    ("completion", comp(prompt=[-1]), "prompt", "token ids"),
    ("completion", comp(prompt=[1.5]), "prompt", "token ids"),
    ("completion", comp(prompt=[True]), "prompt", "token ids"),
    ("completion", comp(prompt=[MAX_TOKEN_ID + 1]), "prompt", "token ids"),
    ("completion", comp(prompt=[[1], [2**64 - 1]]), "prompt", "token ids"),
    # -- cache_salt (vLLM's validate_cache_salt) ------------------------------------------------------------
    ("chat", chat(cache_salt=""), "cache_salt", "non-empty string"),
    ("chat", chat(cache_salt=5), "cache_salt", "non-empty string"),
    ("chat", chat(cache_salt=["a"]), "cache_salt", "non-empty string"),
    ("chat", chat(cache_salt="x" * 129), "cache_salt", "at most 128"),
    ("chat", chat(cache_salt="a/b"), "cache_salt", "must not contain"),
    ("chat", chat(cache_salt="a@b"), "cache_salt", "must not contain"),
    ("chat", chat(cache_salt="a\\b"), "cache_salt", "must not contain"),
    ("completion", comp(cache_salt="a\x00b"), "cache_salt", "must not contain"),
]

# Fields both endpoints type-check: (field, bad values)
COMMON_BAD: list[tuple[str, list[Any]]] = [
    ("stream", ["maybe", 2, [], {}]),
    ("stream_options", [5, "yes", [True]]),
    ("max_tokens", [-1, "many", 1.5, [], {}, "1.5"]),
    ("n", [0, -3, "x", 2.5]),
    ("temperature", ["hot", [], {}]),
    ("top_p", ["x", [0.5]]),
    ("presence_penalty", ["x", {}]),
    ("frequency_penalty", ["x", []]),
    ("stop", [5, [1], ["a", None], {"a": 1}, True]),
    ("seed", ["x", 1.5, [], 2.0**70]),
    ("user", [5, ["u"], {}]),
    ("logit_bias", [[], "x", {"50256": "x"}, {"1": None}]),
]
for _field, _values in COMMON_BAD:
    for _kind in ("chat", "completion"):
        for _value in _values:
            extra: dict[str, Any] = {_field: _value}
            if _field == "stream_options":
                extra["stream"] = True
            REFUSED.append((_kind, (chat if _kind == "chat" else comp)(**extra), _field, f"'{_field}' must be"))
REFUSED += [
    ("chat", chat(stream_options={"include_usage": "often"}, stream=True), "stream_options", "include_usage"),
    ("chat", chat(stream_options={"include_usage": True}), "stream_options", "only allowed when 'stream' is true"),
    ("completion", comp(stream_options={"include_usage": True}, stream=False), "stream_options",
     "only allowed when 'stream' is true"),
]


@pytest.mark.parametrize(("kind", "raw", "param", "fragment"), REFUSED)
def test_refused_with_400(kind: str, raw: bytes, param: str | None, fragment: str) -> None:
    with pytest.raises(ClientError) as info:
        parse_body(kind, raw)  # type: ignore[arg-type]
    exc = info.value
    assert exc.status == 400 and exc.param == param
    assert fragment in exc.message
    err = orjson.loads(exc.body())["error"]
    assert err == {"message": exc.message, "type": "invalid_request_error", "param": param, "code": 400}


def test_messages_never_echo_the_body() -> None:
    secret = "SECRET-PROMPT-TEXT " * 500
    bodies = [chat(messages=[{"role": "user", "content": secret}], max_tokens="lots"),
              chat(messages=[{"role": "user", "content": secret}, {"role": "user", "content": 5}]),
              comp(prompt=[secret, 5]), chat(cache_salt=secret), chat(stop={"k": secret}),
              b'{"model": "m", "prompt": "' + secret.encode() + b'"']
    for raw in bodies:
        kind = "completion" if b'"prompt"' in raw else "chat"
        with pytest.raises(ClientError) as info:
            parse_body(kind, raw)  # type: ignore[arg-type]
        assert "SECRET" not in info.value.message and len(info.value.body()) < 400


def test_long_error_messages_are_cut_in_the_middle() -> None:
    # e.g. the router's 404 quotes the model name, which a client can make 16 MiB long
    err = orjson.loads(error_body(404, "The model `" + "x" * 100_000 + "` does not exist.", "model"))["error"]
    assert len(err["message"]) == MAX_MESSAGE_CHARS
    assert err["message"].startswith("The model `x") and err["message"].endswith("` does not exist.")
    assert err["code"] == 404 and err["type"] == "not_found_error" and err["param"] == "model"
    short = orjson.loads(error_body(400, "short", None))["error"]
    assert short["message"] == "short"


FULL_CHAT = {
    "model": "m",
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": "What is the weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call()], "refusal": None},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "tomorrow?"}]},
    ],
    "frequency_penalty": 0.5, "presence_penalty": -0.5, "logit_bias": {"50256": -100}, "logprobs": True,
    "top_logprobs": 3, "max_tokens": 100, "max_completion_tokens": 100, "n": 2, "seed": -7, "stop": ["\n", "END"],
    "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7, "top_p": 0.9,
    "tools": [fn(description="d", parameters={"type": "object", "properties": {"q": {"type": "string"}}})],
    "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False,
    "user": "u-1", "response_format": {"type": "json_object"}, "metadata": {"k": "v"}, "store": False,
    "service_tier": "auto", "reasoning_effort": "low", "modalities": ["text"], "prediction": None,
    "audio": None, "web_search_options": {}, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1,
    "chat_template_kwargs": {"enable_thinking": False}, "cache_salt": "tenant-1",
}

FULL_COMPLETION = {
    "model": "m", "prompt": "Once upon", "best_of": 2, "echo": True, "frequency_penalty": 0.1, "logit_bias": {},
    "logprobs": 2, "max_tokens": 16, "n": 1, "presence_penalty": 0, "seed": 1, "stop": "\n", "stream": False,
    "stream_options": None, "suffix": " end", "temperature": 0, "top_p": 1, "user": "u",
}


def test_a_full_openai_request_is_accepted() -> None:
    r = parse_body("chat", orjson.dumps(FULL_CHAT))
    assert r.stream and r.cache_salt == "tenant-1" and r.tools == FULL_CHAT["tools"] and r.unroutable is None
    # vLLM hands the template the reasoning effort too (the client's enable_thinking stands).
    assert r.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"} and r.add_generation_prompt
    assert [m["content"] for m in r.messages or []] == ["Be brief.", "sys", "What is the weather?", "", "sunny",
                                                        "Sunny.", "and\ntomorrow?"]
    # Tool call arguments reach the template as an object, as both engines parse them.
    assert r.messages is not None and r.messages[3]["tool_calls"] == [call(function={"name": "f", "arguments": {}})]
    assert r.messages[2]["name"] == "ann" and "refusal" not in r.messages[3]
    c = parse_body("completion", orjson.dumps(FULL_COMPLETION))
    assert c.prompt_text == "Once upon" and not c.stream and c.body == FULL_COMPLETION


# (kind, body, what the parsed request must look like)
ACCEPTED: list[tuple[str, bytes, dict[str, Any]]] = [
    # The engines' pydantic models coerce in lax mode, so Cortex reads these the same way.
    ("chat", chat(max_tokens="5", n="2", temperature="0.5", seed="9", stream="true"), {"stream": True}),
    ("chat", chat(max_tokens=5.0, stream=1, logprobs="no"), {"stream": True}),
    ("chat", chat(stream="off"), {"stream": False}),
    ("chat", chat(add_generation_prompt="false", continue_final_message="yes"),
     {"add_generation_prompt": False, "continue_final_message": True}),
    ("chat", chat(add_generation_prompt=None, continue_final_message=None, stream=None),
     {"add_generation_prompt": True, "continue_final_message": False, "stream": False}),
    # Continuing the final message wins (SGLang has no add_generation_prompt; vLLM refuses both true itself).
    ("chat", chat(continue_final_message=True), {"add_generation_prompt": False, "continue_final_message": True}),
    ("chat", chat(continue_final_message=True, add_generation_prompt=True),
     {"add_generation_prompt": False, "continue_final_message": True}),
    # Values some engine serves (or judges itself) are forwarded, not refused here.
    ("chat", chat(max_tokens=0, max_completion_tokens=0), {}),
    ("chat", chat(max_tokens=None, n=None, temperature=None, top_p=None, stop=None, seed=None, user=None), {}),
    ("chat", chat(temperature=5, top_p=0, presence_penalty=-3, top_logprobs=-1, seed=2**63), {}),
    ("chat", chat(max_tokens=2**64 - 1), {}),
    ("chat", chat(stop=[], logit_bias={}, tools=[], chat_template_kwargs={}), {"tools": None}),
    ("chat", chat(tool_choice="none", response_format={"type": "text"}), {}),
    ("chat", chat(tools=[{"type": "custom", "custom": {"name": "grammar"}}]), {}),
    ("chat", chat(stream_options={}), {"stream": False}),
    ("chat", chat(stream_options=None, stream=False), {}),
    ("chat", chat(stream_options={"include_usage": True}, stream="true"), {"stream": True}),
    ("chat", chat(unknown_field={"any": [1, 2]}, extra_body=5), {}),
    # JSON details: the last duplicate key wins (as in Python's json), whitespace around is fine.
    ("chat", b' {"model": "other", "model": "m", "messages": [{"role": "user", "content": "hi"}]}\n', {"model": "m"}),
    # Messages: roles are the template's business; missing content, and null where an engine takes it, is "".
    ("chat", msg(role="narrator", content="x"), {"messages": [{"role": "narrator", "content": "x"}]}),
    ("chat", msg(role="", content="x"), {"messages": [{"role": "", "content": "x"}]}),
    ("chat", msg(role="user"), {"messages": [{"role": "user", "content": ""}]}),
    ("chat", msg(role="assistant", content=None), {"messages": [{"role": "assistant", "content": ""}]}),
    ("chat", msg(role="System", content=None), {"messages": [{"role": "System", "content": ""}]}),
    ("chat", msg(role="tool", content=None, tool_call_id="c"),
     {"messages": [{"role": "tool", "content": "", "tool_call_id": "c"}]}),
    ("chat", msg(role="user", content=""), {"messages": [{"role": "user", "content": ""}]}),
    ("chat", msg(role="user", content=[]), {"messages": [{"role": "user", "content": ""}]}),
    ("chat", msg(role="user", content=["a", {"type": "text", "text": "b"}]),
     {"messages": [{"role": "user", "content": "a\nb"}]}),
    ("chat", msg(role="user", content=[{"type": "text", "text": "a"},
                                       {"type": "image_url", "image_url": {"url": "u"}}]),
     {"unroutable": "non_text_content", "messages": [{"role": "user", "content": "a"}]}),
    ("chat", msg(role="user", content=[{"image_url": "http://x/y.png"}]), {"unroutable": "non_text_content"}),
    ("chat", msg(role="user", content=[{"type": "input_audio", "input_audio": {}}]),
     {"unroutable": "non_text_content"}),
    ("chat", msg(role="user", content="x", tool_calls="ignored on user messages"), {}),
    ("chat", msg(role="assistant", tool_calls=None), {}),
    ("chat", msg(role="assistant", tool_calls=[]), {}),
    # SGLang's tool calls: no id or type, object arguments, no name.
    ("chat", msg(role="assistant", tool_calls=[{"function": {"name": "f", "arguments": {"q": 1}}}]), {}),
    ("chat", msg(role="assistant", tool_calls=[{"id": None, "function": {}}]), {}),
    ("chat", msg(role="user", content="x", extra=nested(MAX_TEMPLATE_NESTING)), {}),
    ("chat", chat(tools=[fn(parameters=nested(MAX_TEMPLATE_NESTING - 3))]), {}),  # tools > tool > function > …
    ("chat", chat(chat_template_kwargs={"k": nested(MAX_TEMPLATE_NESTING - 1)}), {}),
    # Nesting that never reaches the template (dropped image parts, unread fields) is the engine's concern.
    ("chat", chat(metadata=nested(800)), {}),
    # Completions
    ("completion", comp(prompt=""), {"prompt_text": ""}),
    ("completion", comp(prompt=[0, MAX_TOKEN_ID]), {"prompt_ids": [0, MAX_TOKEN_ID]}),
    ("completion", comp(prompt=[[1, 2], [3]]), {"prompt_ids": [1, 2]}),
    ("completion", comp(prompt=["a", "b"]), {"prompt_text": "a"}),
    ("completion", comp(logprobs=True, echo="true", max_tokens=0), {}),
    ("completion", orjson.dumps({"model": "m", "prompt_embeds": "AAAA"}),
     {"prompt_text": "", "unroutable": "prompt_embeds"}),
]


@pytest.mark.parametrize(("kind", "raw", "expected"), ACCEPTED)
def test_accepted(kind: str, raw: bytes, expected: dict[str, Any]) -> None:
    r = parse_body(kind, raw)  # type: ignore[arg-type]
    assert r.kind == kind and r.model == "m" and r.body == orjson.loads(raw)
    for name, value in expected.items():
        assert getattr(r, name) == value, name


def test_every_common_field_is_checked_on_both_endpoints() -> None:
    # Guards the table: a field added to the pydantic models without a bad case here goes untested.
    from extproc.request import _EXPECTED, _Chat, _Completion

    listed = {f for f, _ in COMMON_BAD} | {p for _, _, p, _ in REFUSED if p}
    assert set(_Chat.model_fields) | set(_Completion.model_fields) <= listed
    assert set(_Chat.model_fields) | set(_Completion.model_fields) <= set(_EXPECTED)
