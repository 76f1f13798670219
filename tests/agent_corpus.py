"""A corpus of agent conversations with tools, in the three APIs agents speak: chat completions, OpenAI's Responses
API and Anthropic's Messages API. Built from a seed (nothing is stored), so the same conversations come back on
every run; each one exercises what a coding agent sends: a system prompt (Claude Code's billing header among its
blocks), tool definitions (with and without descriptions, strict, keys in unusual orders), tool calls with JSON
arguments (unicode, nesting, parallel calls, an empty and a malformed one), tool results as text and as parts,
reasoning, developer and inline system messages, and multi-turn follow-ups.

`chat(seed)`, `responses(seed)` and `messages(seed)` return request bodies (without `model`); CASES lists them
all as (api, path, body). tests/real_engine/test_render_parity.py sends them to a real vLLM's /render endpoints;
the unit and e2e tests reuse them.
"""

from __future__ import annotations

import json
import random
from typing import Any

from cortex.api_paths import CHAT, MESSAGES, RESPONSES

WORDS = ("alpha", "build", "cache", "delta", "error", "file", "grep", "head", "index", "json", "kernel", "lint",
         "merge", "node", "open", "patch", "query", "route", "stack", "test", "unit", "value", "write", "yaml",
         "zone", "naïve", "café", "日本語", "✓")


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _schema(rng: random.Random) -> dict[str, Any]:
    props = {f"arg_{i}": {"type": rng.choice(["string", "integer", "boolean"]), "description": _text(rng, 4)}
             for i in range(rng.randint(1, 4))}
    schema: dict[str, Any] = {"type": "object", "properties": props, "required": sorted(props)[:1]}
    if rng.random() < 0.3:
        schema["additionalProperties"] = False
    return schema


def _result(rng: random.Random, longest: int, parts: float) -> Any:
    """A tool's result: text, or (with probability `parts`) text parts, as agents send both."""
    text = _text(rng, rng.randint(4, longest))
    return [{"type": "text", "text": text}, {"type": "text", "text": _text(rng, 3)}] if rng.random() < parts else text


TOOL_NAMES = ("read_file", "run_tests", "grep", "edit_file", "list_dir", "web_search")


def _args(rng: random.Random) -> dict[str, Any]:
    choice = rng.randrange(4)
    if choice == 0:
        return {"path": f"src/{rng.choice(WORDS)}.py", "line": rng.randint(1, 900)}
    if choice == 1:
        return {"pattern": _text(rng, 2), "flags": ["-n", "-i"], "nested": {"depth": 2, "ok": True}}
    if choice == 2:
        return {"query": _text(rng, 3), "unicode": "naïve café 日本語"}
    return {}


def _chat_tools(rng: random.Random) -> list[dict[str, Any]]:
    tools = []
    for name in rng.sample(TOOL_NAMES, rng.randint(2, 4)):
        fn: dict[str, Any] = {"name": name, "parameters": _schema(rng)}
        if rng.random() < 0.7:
            fn["description"] = _text(rng, 6)
        if rng.random() < 0.2:
            fn["strict"] = True
        if rng.random() < 0.3:  # keys in another order than the OpenAI docs show
            fn = dict(reversed(list(fn.items())))
        tools.append({"type": "function", "function": fn})
    return tools


def chat(seed: int) -> dict[str, Any]:
    """A chat-completions agent conversation with tools."""
    rng = random.Random(seed)
    tools = _chat_tools(rng)
    names = [t["function"]["name"] for t in tools]
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"You are a coding agent. {_text(rng, 30)}"}]
    if rng.random() < 0.3:
        messages.append({"role": "developer", "content": _text(rng, 8)})
    messages.append({"role": "user", "content": _text(rng, 12)})
    for turn in range(rng.randint(1, 4)):
        calls = []
        for k in range(rng.randint(1, 2)):
            args: Any = json.dumps(_args(rng), ensure_ascii=rng.random() < 0.5)
            if turn == 0 and k == 0 and seed % 5 == 3:
                args = ""  # an empty arguments string: the template gets {}
            calls.append({"id": f"call_{seed}_{turn}_{k}", "type": "function",
                          "function": {"name": rng.choice(names), "arguments": args}})
        assistant: dict[str, Any] = {"role": "assistant", "content": None if rng.random() < 0.6 else _text(rng, 5),
                                     "tool_calls": calls}
        if rng.random() < 0.3:
            assistant["reasoning_content"] = _text(rng, 10)
        messages.append(assistant)
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": _result(rng, 40, 0.3)})
        if rng.random() < 0.5:
            messages.append({"role": "assistant", "content": _text(rng, 15)})
            messages.append({"role": "user", "content": [{"type": "text", "text": _text(rng, 6)}]})
    body: dict[str, Any] = {"messages": messages, "tools": tools, "max_tokens": 4}
    if rng.random() < 0.3:
        body["tool_choice"] = rng.choice(["auto", "none", {"type": "function", "function": {"name": names[0]}}])
    return body


def responses(seed: int) -> dict[str, Any]:
    """A Responses API agent turn: instructions, input items (messages, function calls and outputs, reasoning)."""
    rng = random.Random(seed)
    tools = []
    for name in rng.sample(TOOL_NAMES, rng.randint(1, 3)):
        tool: dict[str, Any] = {"type": "function", "name": name, "parameters": _schema(rng)}
        if rng.random() < 0.7:
            tool["description"] = _text(rng, 6)
        if rng.random() < 0.5:
            tool["strict"] = rng.random() < 0.5
        tools.append(tool)
    items: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        items.append({"role": "user", "content": _text(rng, 10)})
    else:
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": _text(rng, 10)}]})
    for turn in range(rng.randint(1, 3)):
        if rng.random() < 0.3:
            items.append({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                                           "text": _text(rng, 8)}]})
        for k in range(rng.randint(1, 2)):
            call_id = f"call_{seed}_{turn}_{k}"
            items.append({"type": "function_call", "call_id": call_id, "name": rng.choice(tools)["name"],
                          "arguments": json.dumps(_args(rng))})
            items.append({"type": "function_call_output", "call_id": call_id, "output": _text(rng, 20)})
        if rng.random() < 0.5:
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": _text(rng, 12)}]})
            items.append({"role": "user", "content": _text(rng, 6)})
    body: dict[str, Any] = {"input": items, "tools": tools, "max_output_tokens": 4}
    if rng.random() < 0.7:
        body["instructions"] = f"You are a coding agent. {_text(rng, 25)}"
    if seed % 4 == 1:
        body["input"] = _text(rng, 9)  # the plain-string form
    return body


def messages(seed: int) -> dict[str, Any]:
    """An Anthropic Messages API agent turn (Claude Code's shape): system blocks, tool uses and results."""
    rng = random.Random(seed)
    tools = []
    for name in rng.sample(TOOL_NAMES, rng.randint(1, 4)):
        tool: dict[str, Any] = {"name": name, "input_schema": _schema(rng)}
        if rng.random() < 0.7:
            tool["description"] = _text(rng, 6)
        if rng.random() < 0.2:
            del tool["input_schema"]["type"]  # vLLM types it "object"
        tools.append(tool)
    system: Any = f"You are Claude Code. {_text(rng, 25)}"
    if rng.random() < 0.6:
        system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=abc123"},
                  {"type": "text", "text": f"You are Claude Code. {_text(rng, 25)}"},
                  {"type": "text", "text": _text(rng, 12), "cache_control": {"type": "ephemeral"}}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": _text(rng, 14)}]}]
    for turn in range(rng.randint(1, 3)):
        blocks: list[dict[str, Any]] = []
        if rng.random() < 0.3:
            blocks.append({"type": "thinking", "thinking": _text(rng, 9), "signature": "sig"})
        if rng.random() < 0.5:
            blocks.append({"type": "text", "text": _text(rng, 6)})
        uses = [{"type": "tool_use", "id": f"toolu_{seed}_{turn}_{k}", "name": rng.choice(tools)["name"],
                 "input": _args(rng)} for k in range(rng.randint(1, 2))]
        msgs.append({"role": "assistant", "content": blocks + uses})
        results: list[dict[str, Any]] = [{"type": "tool_result", "tool_use_id": use["id"],
                                          "content": _result(rng, 30, 0.4)} for use in uses]
        if rng.random() < 0.4:
            results.append({"type": "text", "text": _text(rng, 5)})
        msgs.append({"role": "user", "content": results})
    if rng.random() < 0.3:
        msgs.append({"role": "user", "content": _text(rng, 7)})
    body: dict[str, Any] = {"system": system, "messages": msgs, "tools": tools, "max_tokens": 4}
    if seed % 6 == 5:
        # An inline system message (Claude Code's per-turn reminders): kept in place by a template that accepts it.
        msgs.insert(1, {"role": "system", "content": f"<system-reminder>{_text(rng, 6)}</system-reminder>"})
    return body


def cases(n: int = 12) -> list[tuple[str, str, dict[str, Any]]]:
    """(api, path, body) for n conversations of each API."""
    return ([("chat", CHAT, chat(s)) for s in range(n)] + [("responses", RESPONSES, responses(s)) for s in range(n)]
            + [("messages", MESSAGES, messages(s)) for s in range(n)])


def _fn(name: str, **kw: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **kw}}


EDGES: list[tuple[str, str, dict[str, Any]]] = [
    # Chat: a developer message first (the template knows no developer role: it becomes the system prompt).
    ("chat", CHAT, {"messages": [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]}),
    # ... and after a system message: both merged into one, joined by a blank line.
    ("chat", CHAT, {"messages": [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
                                 {"role": "user", "content": "hi"}]}),
    # Malformed, non-object and object arguments; an empty tool_calls list.
    ("chat", CHAT, {"tools": [_fn("f", parameters={"type": "object"})], "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{not json"}},
            {"id": "b", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "x"}, {"role": "tool", "tool_call_id": "b", "content": "y"},
        {"role": "assistant", "content": "done", "tool_calls": []}, {"role": "user", "content": "more"}]}),
    # Text part kinds other than "text", a system billing header line, a tool without description or parameters.
    ("chat", CHAT, {"tools": [_fn("bare")], "messages": [
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1\nReal system."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}, {"type": "refusal", "refusal": "r"}]},
        {"role": "user", "content": "d"}]}),
    # Reasoning effort (handed to the template with enable_thinking), continuing the final message.
    ("chat", CHAT, {"reasoning_effort": "high", "messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "Hello, I"}],
                    "continue_final_message": True, "add_generation_prompt": False}),
    # Tools with defer_loading and strict at both levels, keys out of order.
    ("chat", CHAT, {"tools": [{"function": {"parameters": {"type": "object"}, "name": "z", "strict": False},
                               "type": "function"},
                              {"type": "function", "defer_loading": True, "function": {"name": "y"}}],
                    "messages": [{"role": "user", "content": "go"}]}),
    # Responses: a partial assistant message continued; reasoning effort; an assistant message as a plain dict.
    ("responses", RESPONSES, {"input": [{"role": "user", "content": "write"},
                                        {"type": "message", "role": "assistant", "status": "in_progress",
                                         "content": [{"type": "output_text", "text": "Once upon"}]}]}),
    ("responses", RESPONSES, {"reasoning": {"effort": "low"}, "instructions": "I",
                              "input": [{"role": "developer", "content": "dev"}, {"role": "user", "content": "u"},
                                        {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]}),
    # A reasoning item alone, then a call merged into its assistant message.
    ("responses", RESPONSES, {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                              "input": [{"role": "user", "content": "go"},
                                        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
                                        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                        {"type": "function_call_output", "call_id": "c", "output": "ok"}]}),
    # Messages: an inline system message, a tool result with no content, a tool_result in an assistant turn.
    ("messages", MESSAGES, {"max_tokens": 4, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                            "messages": [{"role": "user", "content": "hi"},
                                         {"role": "system", "content": "reminder"},
                                         {"role": "assistant", "content": [
                                             {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": "é"}}]},
                                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}],
                            "tools": [{"name": "f", "input_schema": {"properties": {"q": {"type": "string"}}}}]}),
    ("messages", MESSAGES, {"max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                                          {"type": "redacted_thinking", "data": "zz"}]},
        {"role": "user", "content": [{"type": "text", "text": "c"}]}]}),
]
