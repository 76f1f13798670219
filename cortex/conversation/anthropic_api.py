"""The Anthropic Messages API's request as chat messages and tools (vllm/entrypoints/anthropic/serving.py:
to_chat_completion_request)."""

from __future__ import annotations

import json
from typing import Any

from cortex.conversation import ConversationError
from cortex.conversation.chat import BILLING_HEADER

ANTHROPIC_BLOCKS = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                              "redacted_thinking", "tool_addition", "tool_removal"})


def _image_url(source: Any) -> str:
    if not isinstance(source, dict):
        return ""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _system_text(content: Any) -> str | None:
    """_extract_system_text: a system message's text without the billing header blocks (None: nothing left)."""
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [b["text"] for b in content if b.get("type") == "text" and b.get("text")
             and not b["text"].startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _tool_result(block: dict[str, Any], out: list[dict[str, Any]]) -> None:
    """_convert_user_tool_result: a tool message (text parts joined by newlines), images as a user message after it,
    tool references as one more tool message."""
    content = block.get("content")
    text = ""
    images: list[str] = []
    refs: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "text":
                texts.append(item.get("text", ""))
            elif item.get("type") == "image" and (url := _image_url(item.get("source", {}))):
                images.append(url)
            elif item.get("type") == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})


def _anthropic_message(msg: dict[str, Any], out: list[dict[str, Any]]) -> None:
    role = msg["role"]
    new: dict[str, Any] = {"role": role}
    content = msg["content"]
    if isinstance(content, str):
        new["content"] = content
    else:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content:
            kind = block["type"]
            if kind == "text" and block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and block.get("source"):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
            elif kind == "thinking" and block.get("thinking") is not None:
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                calls.append({"id": block.get("id") or "call_0", "type": "function",
                              "function": {"name": block.get("name") or "",
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result":
                if role == "user":
                    _tool_result(block, out)
                else:
                    result = block.get("content")
                    parts.append({"type": "text", "text": f"Tool result: {str(result) if result else ''}"})
        if reasoning:
            new["reasoning"] = "".join(reasoning)
        if calls:
            new["tool_calls"] = calls
        if parts:
            new["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if not (role == "user" and "content" not in new):
        out.append(new)


def _check_anthropic(messages: Any, system: Any) -> None:
    """AnthropicMessagesRequest's structure, as far as the conversion reads it."""
    if not isinstance(messages, list):
        raise ConversationError("'messages' is required and must be a list", "messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
            raise ConversationError(f"messages[{i}] must be an object with role 'user', 'assistant' or 'system'",
                                    "messages")
        content = msg.get("content")
        if not isinstance(content, str | list):
            raise ConversationError(f"messages[{i}].content must be a string or a list of blocks", "messages")
        _check_blocks(content, f"messages[{i}].content", "messages")
    if system is not None:
        if not isinstance(system, str | list):
            raise ConversationError("'system' must be a string or a list of blocks", "system")
        _check_blocks(system, "system", "system")


def _check_blocks(content: Any, where: str, param: str) -> None:
    if isinstance(content, str):
        return
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") not in ANTHROPIC_BLOCKS:
            raise ConversationError(f"{where}[{j}] must be a content block of a known type", param)
        for key in ("text", "thinking", "id", "name", "tool_use_id"):
            if block.get(key) is not None and not isinstance(block[key], str):
                raise ConversationError(f"{where}[{j}].{key} must be a string", param)
        if block.get("input") is not None and not isinstance(block["input"], dict):
            raise ConversationError(f"{where}[{j}].input must be an object", param)


def anthropic_messages(system: Any, messages: Any, *, merge_inline_system: bool) -> list[dict[str, Any]]:
    """to_chat_completion_request's messages: the system prompt first (top-level text blocks joined without a
    separator; inline system messages merged into it when the template demands system-first), then each message
    (a user's tool results become tool messages ahead of it; tool uses become tool calls with JSON arguments)."""
    _check_anthropic(messages, system)
    parts: list[str] = []
    if system:
        if isinstance(system, str):
            parts.append(system)
        else:
            parts += [b["text"] for b in system if b.get("type") == "text" and b.get("text")
                      and not b["text"].startswith(BILLING_HEADER)]
    if merge_inline_system:
        parts += [t for m in messages if m["role"] == "system" and (t := _system_text(m["content"]))]
    out: list[dict[str, Any]] = []
    if parts:
        out.append({"role": "system", "content": "".join(parts)})
    for msg in messages:
        if msg["role"] == "system":
            if not merge_inline_system and (text := _system_text(msg["content"])):
                out.append({"role": "system", "content": text})
            continue
        _anthropic_message(msg, out)
    return out


def anthropic_tools(tools: Any) -> list[dict[str, Any]] | None:
    """_convert_tools: each tool as a chat function tool (input_schema as parameters, typed "object" when it names
    no type). Tool additions and removals inside messages are not followed: such a conversation renders as the
    engine's only when they change nothing."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ConversationError("'tools' must be a list", "tools")
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or \
                not isinstance(tool.get("input_schema"), dict):
            raise ConversationError(f"tools[{j}] must be an object with a string 'name' and an object "
                                    "'input_schema'", "tools")
        schema = tool["input_schema"]
        if "type" not in schema:
            schema = {**schema, "type": "object"}
        out.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description"), "parameters": schema,
            "strict": tool.get("strict"), "defer_loading": tool.get("defer_loading")}})
    return out
