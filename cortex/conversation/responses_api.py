"""The Responses API's request as chat messages and tools (vllm/entrypoints/openai/responses/utils.py:
construct_input_messages, construct_tool_dicts, should_continue_final_message)."""

from __future__ import annotations

import json
from typing import Any

from cortex.conversation import ConversationError


def _output_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _merge_or_new(messages: list[dict[str, Any]], key: str, value: Any, new: dict[str, Any]) -> None:
    """An item that continues the previous assistant message when that message lacks `key`, else a new one."""
    prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if prev is not None and prev.get(key) is None:
        prev[key] = value
    else:
        messages.append(new)


def responses_messages(instructions: Any, items: Any) -> list[dict[str, Any]]:
    """construct_input_messages (no previous response): instructions as a system message, then the input items as
    chat messages (a function call joins the assistant message before it, reasoning and output text fill in what
    that message lacks)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ConversationError(f"{where} must be an object", "input")
        kind = item.get("type")
        if kind in ("function_call", "custom_tool_call"):
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise ConversationError(f"{where} ({kind}) needs string 'name' and 'call_id'", "input")
            if kind == "function_call":
                arguments = item.get("arguments")
                if not isinstance(arguments, str):
                    raise ConversationError(f"{where}.arguments must be a string", "input")
                namespace = item.get("namespace")
                if isinstance(namespace, str) and namespace:
                    name = f"{namespace}__{name}"
            else:
                arguments = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
            call = {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}
            prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
            if prev is not None and isinstance(prev.get("tool_calls"), list):
                prev["tool_calls"].append(call)
            elif prev is not None and prev.get("tool_calls") is None:
                prev["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise ConversationError("Encrypted content is not supported.", "input")
            text = ""
            for key in ("content", "summary"):
                parts = item.get(key)
                if isinstance(parts, list) and parts and isinstance(parts[0], dict):
                    text = parts[0].get("text") or ""
                    break
            _merge_or_new(messages, "reasoning", text, {"role": "assistant", "reasoning": text})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
        elif item.get("role") == "assistant":
            output = _output_text(item.get("content"))
            if output is not None:
                _merge_or_new(messages, "content", output, {"role": "assistant", "content": output})
            elif kind in (None, "message"):
                messages.append(item)
            else:
                raise ConversationError(f"Unsupported input item type: {kind}", "input")
        elif "role" in item:
            messages.append(item)
        else:
            raise ConversationError(f"Unsupported input item type: {kind}", "input")
    return messages


def responses_continues(items: Any) -> bool:
    """should_continue_final_message: the last input item is an unfinished assistant message or reasoning item."""
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    if last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in ("in_progress", "incomplete")


def responses_tools(tools: Any) -> list[dict[str, Any]] | None:
    """construct_tool_dicts: the Responses API's flat function tools as chat tools (namespaced ones flattened to
    `<namespace>__<name>`); other tool kinds are not rendered."""
    if not isinstance(tools, list) or not tools:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "function":
            out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        elif tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            for inner in tool["tools"]:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    fn = {k: v for k, v in inner.items() if k != "type"}
                    fn["name"] = f"{tool.get('name')}__{inner.get('name')}"
                    out.append({"type": "function", "function": fn})
    return out or None
