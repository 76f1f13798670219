"""cortex/conversation/ against hand-written vectors of vLLM 0.32's rules (and SGLang 0.5.23's tool dump): what
the chat template is given for chat, Responses and Anthropic Messages requests. The real engine's own token ids
are compared in tests/real_engine/test_render_parity.py; these pin each rule on its own."""

from __future__ import annotations

from typing import Any

import pytest

from cortex.conversation import ConversationError
from cortex.conversation.anthropic_api import anthropic_messages, anthropic_tools
from cortex.conversation.chat import chat_messages, tool_arguments
from cortex.conversation.responses_api import responses_continues, responses_messages, responses_tools
from cortex.conversation.template_args import (
    developer_as_system,
    for_template,
    reasoning_kwargs,
    rejects_inline_system,
    template_tools,
)

QWEN_LIKE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
SYSTEM_FIRST = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                "{{ raise_exception('system first') }}{% endif %}{{ m.content }}{% endfor %}")


def test_chat_messages_keep_what_vllm_hands_the_template() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "a"}, "b"], "extra": 1},
        {"role": "user", "content": [{"type": "input_text", "text": "q"}, {"type": "refusal", "refusal": "r"},
                                     {"type": "image_url", "image_url": {"url": "u"}}], "name": "ann"},
        {"role": "assistant", "content": None, "reasoning_content": "think", "refusal": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}}]},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "ok"}]},
        {"role": "assistant", "content": "done", "tool_calls": []},
        {"role": "developer", "content": "d"},
    ]
    out, media = chat_messages(messages)
    assert media  # the image part: no exact routing
    assert out == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "q\nr", "name": "ann"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": [1]}}}],
         "reasoning": "think", "reasoning_content": "think"},
        {"role": "tool", "content": "ok", "tool_call_id": "1"},
        {"role": "assistant", "content": "done"},
        {"role": "developer", "content": "d", "tools": None},
    ]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == '{"x": [1]}'  # the input is not changed


@pytest.mark.parametrize(("given", "seen"), [
    ('{"a": 1}', {"a": 1}), ({"a": 1}, {"a": 1}), ("", {}), (None, {}), ("{bad", {}), ("[1]", {}), ("3", {}),
])
def test_tool_call_arguments_reach_the_template_as_an_object(given: Any, seen: dict[str, Any]) -> None:
    assert tool_arguments(given) == seen


def test_the_billing_header_line_is_dropped_from_system_text() -> None:
    out, _ = chat_messages([
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=9\nkept"},
                                       {"type": "text", "text": "x-anthropic-billing-header: only"}]},
        {"role": "user", "content": "x-anthropic-billing-header: users keep it"}])
    assert [m["content"] for m in out] == ["kept", "x-anthropic-billing-header: users keep it"]


def test_developer_becomes_system_for_a_template_that_does_not_know_it() -> None:
    dev: list[dict[str, Any]] = [{"role": "developer", "content": "D", "tools": None}, {"role": "user", "content": "u"}]
    assert developer_as_system(dev, QWEN_LIKE) == [{"role": "system", "content": "D"},
                                                   {"role": "user", "content": "u"}]
    both: list[dict[str, Any]] = [{"role": "system", "content": "S"}, *dev]
    assert developer_as_system(both, QWEN_LIKE) == [{"role": "system", "content": "S\n\nD"},
                                                    {"role": "user", "content": "u"}]
    assert developer_as_system(both, QWEN_LIKE + "{# 'developer' #}") == both  # the template knows the role


TOOL = {"type": "function", "function": {"parameters": {"type": "object"}, "name": "f"}}


def test_vllm_dumps_tools_in_its_models_order_with_null_description() -> None:
    assert template_tools([TOOL], "none", "vllm") == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}}]
    deferred = {"type": "function", "defer_loading": True, "function": {"name": "g", "strict": False, "x": 1}}
    assert template_tools([deferred], None, "vllm") == [
        {"type": "function", "function": {"name": "g", "description": None, "parameters": None, "strict": False,
                                          "defer_loading": True}, "defer_loading": True}]
    assert template_tools([{"type": "custom", "custom": {}}], None, "vllm") is None


def test_sglang_dumps_tools_in_the_clients_order() -> None:
    assert template_tools([TOOL], "auto", "sglang") == [
        {"type": "function", "function": {"parameters": {"type": "object"}, "name": "f", "description": None},
         "defer_loading": None}]
    assert template_tools([TOOL], "none", "sglang") is None
    named = {"type": "function", "function": {"name": "f"}}
    other = {"type": "function", "function": {"name": "g"}}
    assert [t["function"]["name"] for t in template_tools([named, other], named, "sglang") or []] == ["f"]


def test_reasoning_effort_reaches_the_template() -> None:
    assert reasoning_kwargs("low", None) == {"reasoning_effort": "low", "enable_thinking": True}
    assert reasoning_kwargs("none", {"k": 1}) == {"k": 1, "reasoning_effort": "none", "enable_thinking": False}
    assert reasoning_kwargs("auto", {"enable_thinking": False}) == {"enable_thinking": False}
    assert reasoning_kwargs(None, None) == {}


def test_responses_items_become_chat_messages() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "namespace": "ns"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "said"}]},
        {"type": "custom_tool_call", "call_id": "c3", "name": "sh", "input": "ls"},
    ]
    assert responses_messages("Be brief.", items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {"role": "assistant", "reasoning": "plan", "tool_calls": [
            {"id": "c1", "function": {"name": "ns__f", "arguments": "{}"}, "type": "function"},
            {"id": "c2", "function": {"name": "g", "arguments": "{}"}, "type": "function"}]},
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "assistant", "content": "said", "tool_calls": [
            {"id": "c3", "function": {"name": "sh", "arguments": '{"input": "ls"}'}, "type": "function"}]},
    ]
    assert responses_messages(None, "hi") == [{"role": "user", "content": "hi"}]
    with pytest.raises(ConversationError, match="Unsupported input item type: web_search_call"):
        responses_messages(None, [{"type": "web_search_call", "id": "w"}])
    with pytest.raises(ConversationError, match="Encrypted content"):
        responses_messages(None, [{"type": "reasoning", "encrypted_content": "x", "summary": []}])


def test_responses_continue_an_unfinished_last_message_and_flatten_tools() -> None:
    partial = [{"type": "message", "role": "assistant", "status": "in_progress", "content": []}]
    assert responses_continues(partial) and not responses_continues("hi")
    assert not responses_continues([{"type": "function_call", "status": "in_progress"}])
    tools = [{"type": "function", "name": "f", "strict": True},
             {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g"}]},
             {"type": "web_search"}]
    assert responses_tools(tools) == [{"type": "function", "function": {"name": "f", "strict": True}},
                                      {"type": "function", "function": {"name": "ns__g"}}]


def test_anthropic_messages_become_the_chat_request_vllm_makes() -> None:
    system = [{"type": "text", "text": "x-anthropic-billing-header: cch=1"}, {"type": "text", "text": "A"},
              {"type": "text", "text": "B"}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "calling"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
                                     {"type": "text", "text": "next"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "only"}]},
    ]
    assert anthropic_messages(system, messages, merge_inline_system=False) == [
        {"role": "system", "content": "AB"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "reasoning": "hm", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "r1\nr2"},
        {"role": "user", "content": "next"},
        {"role": "tool", "tool_call_id": "t2", "content": "only"},
    ]


def test_anthropic_inline_system_messages_stay_or_merge() -> None:
    messages = [{"role": "user", "content": "u"}, {"role": "system", "content": "reminder"}]
    assert anthropic_messages("S", messages, merge_inline_system=False) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "u"}, {"role": "system", "content": "reminder"}]
    assert anthropic_messages("S", messages, merge_inline_system=True) == [
        {"role": "system", "content": "Sreminder"}, {"role": "user", "content": "u"}]
    assert not rejects_inline_system(QWEN_LIKE)
    assert rejects_inline_system(SYSTEM_FIRST)  # raise_exception is undefined in vLLM's probe: it fails
    assert rejects_inline_system(None)


def test_anthropic_tools_and_bad_structures() -> None:
    assert anthropic_tools([{"name": "f", "input_schema": {"properties": {}}}]) == [
        {"type": "function", "function": {"name": "f", "description": None,
                                          "parameters": {"properties": {}, "type": "object"},
                                          "strict": None, "defer_loading": None}}]
    for bad, param in [({"role": "user"}, "messages"), ({"role": "bot", "content": "x"}, "messages"),
                       ({"role": "user", "content": [{"type": "video"}]}, "messages"),
                       ({"role": "user", "content": [{"type": "tool_use", "input": [1]}]}, "messages")]:
        with pytest.raises(ConversationError) as exc:
            anthropic_messages(None, [bad], merge_inline_system=False)
        assert exc.value.param == param
    with pytest.raises(ConversationError):
        anthropic_tools([{"name": "f"}])


def test_for_template_applies_the_engines_style() -> None:
    msgs: list[dict[str, Any]] = [{"role": "developer", "content": "d", "tools": None},
                                  {"role": "user", "content": "u"}]
    vllm_msgs, vllm_tools = for_template(msgs, [TOOL], None, QWEN_LIKE, "vllm")
    sglang_msgs, sglang_tools = for_template(msgs, [TOOL], None, QWEN_LIKE, "sglang")
    assert vllm_msgs[0]["role"] == "system" and sglang_msgs is msgs
    assert vllm_tools != sglang_tools
