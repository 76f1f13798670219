"""Chat messages as vLLM hands them to the chat template, in the "string" content format
(vllm/renderers/chat_utils.py: parse_chat_messages, _postprocess_messages).

Each message keeps only the fields vLLM passes on, its content as text; the other APIs' conversions
(responses_api.py, anthropic_api.py) end in chat messages that go through here too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

BILLING_HEADER = "x-anthropic-billing-header"
"""Claude Code's attribution line: a per-request hash vLLM drops from system text so the prefix stays cacheable."""
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}
"""Content part types read as text, and the key holding it (vLLM's TEXT_PART_TYPES and MM_PARSER_MAP)."""
MEDIA_KEYS = ("image_url", "audio_url", "video_url", "input_audio", "input_image", "image_embeds", "audio_embeds",
              "video_embeds", "image_pil", "prompt_embeds")
"""Keys that make a content part media whatever its type: no token ids can be computed for it outside the engine."""


def _strip_billing(parts: list[Any]) -> list[Any]:
    """_strip_claude_code_billing_header: a system text part opening with the header keeps only its later lines."""
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) and \
            part.get("type") == "text" else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def part_text(part: Any) -> tuple[str | None, bool]:
    """One content part in the "string" content format: (its text or None when it adds none, whether it is media)."""
    if isinstance(part, str):
        return part, False
    if not isinstance(part, dict):
        return None, False
    kind = part.get("type")
    if isinstance(kind, str) and kind in TEXT_PARTS and "uuid" not in part:
        value = part.get(TEXT_PARTS[kind])
        return (value if isinstance(value, str) else None), False
    if kind == "tool_reference" or (kind is None and "tool_reference" in part):
        name = part.get("name")
        return (name if isinstance(name, str) else None), False
    return None, True


def message_parts(content: Any, role: str) -> list[Any]:
    """_parse_chat_message_content: a message's content as a list of parts (none for null, one text part for a
    string), a system message's billing header dropped."""
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    else:
        parts = list(content)
    return _strip_billing(parts) if role == "system" else parts


def content_text(content: Any, role: str) -> tuple[str, bool]:
    """A message's content as the template sees it: text parts joined by newlines (media parts leave no text)."""
    parts = message_parts(content, role)
    texts: list[str] = []
    media = False
    for part in parts:
        text, is_media = part_text(part)
        media |= is_media
        if text is not None:
            texts.append(text)
    return "\n".join(texts), media


def tool_arguments(value: Any) -> dict[str, Any]:
    """An assistant tool call's arguments as templates get them (_postprocess_messages): a JSON object string is
    parsed, an object is kept; empty, malformed or non-object arguments become {} (vLLM keeps the conversation
    going rather than refusing a turn whose history holds a bad call)."""
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    parsed: Any = None
    if isinstance(value, str):
        try:
            parsed = orjson.loads(value)  # a long agent conversation has hundreds of calls: the fast parser first
        except orjson.JSONDecodeError:
            try:  # what orjson refuses and Python's json takes (NaN, integers past 64 bits): as vLLM reads it
                parsed = json.loads(value)
            except ValueError:
                parsed = None
    return parsed if isinstance(parsed, dict) else {}


def _tool_calls(calls: list[Any]) -> list[Any]:
    out = []
    for call in calls:
        function = call.get("function") if type(call) is dict else None
        if type(function) is dict:
            args = function.get("arguments")
            call = {**call, "function": {**function, "arguments": args if type(args) is dict else tool_arguments(args)}}
        out.append(call)
    return out


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """vLLM's conversation for chat messages (roles already checked to be strings), and whether any is media.

    Each message keeps only what vLLM hands the template: role and content (text), an assistant's tool_calls
    (their arguments as objects; an empty list dropped) and reasoning (also as reasoning_content, the older
    name; a client's reasoning_content is read as reasoning), a tool message's tool_call_id, name and task when
    strings, and a developer message's tools. The input is not changed (the parsed body may still be sent)."""
    out: list[dict[str, Any]] = []
    media = False
    for msg in messages:
        role = msg["role"]
        content = msg.get("content")
        if type(content) is str and role != "system":  # the common case, cheaply: a long agent history is long
            conv: dict[str, Any] = {"role": role, "content": content}
        else:
            text, is_media = content_text(content, role)
            media |= is_media
            conv = {"role": role, "content": text}
        if role == "assistant":
            calls = msg.get("tool_calls")
            if type(calls) is list and calls:
                conv["tool_calls"] = _tool_calls(calls)
            reasoning = msg.get("reasoning")
            if reasoning is None:
                reasoning = msg.get("reasoning_content")
            if reasoning is not None:
                conv["reasoning"] = conv["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in msg:
                conv["tool_call_id"] = msg["tool_call_id"]
        elif role == "developer":
            conv["tools"] = msg.get("tools")
        if "name" in msg and type(msg["name"]) is str:
            conv["name"] = msg["name"]
        if "task" in msg and type(msg["task"]) is str:
            conv["task"] = msg["task"]
        out.append(conv)
    return out, media
