"""What an engine's chat template is given: the chat, Responses and Anthropic Messages APIs as one conversation.

vLLM 0.32 renders all three APIs with the model's chat template, and a prompt's KV blocks are only shared when its
token ids are the same, so Cortex builds exactly the messages and tools the engine hands its template (the
real-engine test, tests/real_engine/test_render_parity.py, compares the token ids with vLLM's own /render
endpoints). Read in vllm/renderers/chat_utils.py (parse_chat_messages: the "string" content format and
_postprocess_messages), vllm/renderers/hf.py (safe_apply_chat_template: the developer role), vllm/entrypoints/
openai/responses/utils.py (construct_input_messages, construct_tool_dicts) and vllm/entrypoints/anthropic/
serving.py (to_chat_completion_request). SGLang 0.5.23 differs in how it dumps tools for the template
(sglang/srt/entrypoints/openai/protocol.py: Function keeps the client's key order, Tool keeps defer_loading), so
`template_tools` takes the engine's style (cortex/engines: EngineAdapter.tool_style).

Pure functions over parsed JSON; a malformed structure raises ConversationError (a client error: the engines
refuse it too). Nothing here mutates its input.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.sandbox
import orjson

ToolStyle = Literal["vllm", "sglang"]

BILLING_HEADER = "x-anthropic-billing-header"
"""Claude Code's attribution line: a per-request hash vLLM drops from system text so the prefix stays cacheable."""
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}
"""Content part types read as text, and the key holding it (vLLM's TEXT_PART_TYPES and MM_PARSER_MAP)."""
MEDIA_KEYS = ("image_url", "audio_url", "video_url", "input_audio", "input_image", "image_embeds", "audio_embeds",
              "video_embeds", "image_pil", "prompt_embeds")
"""Keys that make a content part media whatever its type: no token ids can be computed for it outside the engine."""


class ConversationError(ValueError):
    """The request cannot be turned into a conversation (the engine refuses it with a 400 too)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class Conversation:
    """A request as its chat template sees it."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    """As the client sent them (chat) or as converted to chat tools (Responses, Messages); template_tools dumps them."""
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    non_text: bool = False
    """Some content is media (or a part type Cortex cannot render): no exact-KV routing."""


# -- chat messages (vllm/renderers/chat_utils.py) --------------------------------------------------------------

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


def _content_parts(content: Any, role: str) -> list[Any]:
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
    parts = _content_parts(content, role)
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


# -- media parts and the "openai" content format (vllm/renderers/chat_utils.py, wrap_dicts) ------------------

ContentFormat = Literal["string", "openai"]
Modality = Literal["image", "video", "audio", "prompt_embeds"]

_MEDIA_TYPES: dict[str, Modality] = {
    "image_url": "image", "input_image": "image", "image_pil": "image", "image_embeds": "image",
    "audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio", "video_url": "video",
    "video_embeds": "video", "prompt_embeds": "prompt_embeds"}
"""MM_PARSER_MAP's media part types and the modality each becomes."""
_MEDIA_BY_KEY = ("image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds",
                 "audio_url", "input_audio", "video_url")
"""_parse_chat_message_content_mm_part: a part without a type (or with a uuid) is named by its first such key."""
_KNOWN_PART_FIELDS = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url", "input_audio",
    "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid", "video_embeds", "video_url"})
"""_KNOWN_CONTENT_PART_FIELDS: a part's other keys are handed to the template with it (_collect_extra_fields)."""


@dataclass(frozen=True, slots=True)
class MediaRef:
    """One media part of a conversation, in the order vLLM's tracker adds its items."""

    modality: Modality
    url: str | None
    """The image / audio / video URL when the part gives one as a string (a data URL carries the item itself)."""
    uuid: str | None
    """The client's `uuid` for the item (vLLM then identifies it by that string)."""


def _media_part(part: Mapping[str, Any]) -> tuple[str, Any] | None:
    """(part type, its content) for a media part, None for a text-like one (vLLM's mm-part parser)."""
    kind = part.get("type")
    if isinstance(kind, str) and part.get("uuid") is None:
        if kind == "image_url":
            url = part.get("image_url")
            return kind, url.get("url") if isinstance(url, dict) else None
        if kind == "input_image":
            return kind, part.get("image_url")
        if kind in ("audio_url", "video_url"):
            url = part.get(kind)
            return kind, url.get("url") if isinstance(url, dict) else None
        return (kind, part.get(kind)) if kind in _MEDIA_TYPES else None
    if kind is None or part.get("uuid") is not None:
        for key in _MEDIA_BY_KEY:
            if key in part:
                value = part.get(key)
                if key in ("image_url", "audio_url", "video_url") and isinstance(value, dict):
                    value = value.get("url")
                return key, value
    return None


def media_refs(messages: Sequence[Mapping[str, Any]]) -> list[MediaRef]:
    """Every media part of the messages, in order (list content only: a string content has none)."""
    out: list[MediaRef] = []
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            found = _media_part(part) if isinstance(part, dict) else None
            if found is None:
                continue
            kind, value = found
            uuid = part.get("uuid")
            out.append(MediaRef(_MEDIA_TYPES[kind], value if isinstance(value, str) else None,
                                None if uuid is None else str(uuid)))
    return out


def _openai_parts(content: Any, role: str) -> list[Any]:
    """_parse_chat_message_content_parts with wrap_dicts: text parts as {"type": "text", "text": ...} and media
    parts as {"type": <modality>}, each with the part's unknown keys; empty text and refusal parts dropped."""
    out: list[Any] = []
    for part in _content_parts(content, role):
        if isinstance(part, str):
            out.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            continue
        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
        found = _media_part(part)
        if found is not None:
            modality = _MEDIA_TYPES[found[0]]
            out.append({"type": "text", "text": PROMPT_EMBEDS_TOKEN} if modality == "prompt_embeds"
                       else {"type": modality, **extra})
            continue
        kind = part.get("type")
        if kind == "tool_reference" or (kind is None and "tool_reference" in part):
            out.append({"type": "tool_reference", "name": part.get("name")})
            continue
        text, _ = part_text(part)
        if text is None and kind in ("text", "refusal"):
            continue
        out.append({"type": "text", "text": text, **extra})
    return out


PROMPT_EMBEDS_TOKEN = "<prompt_embeds>"
"""What a prompt_embeds part becomes in the template's parts (vLLM splices the embeddings there)."""


def _tool_content(parts: list[Any]) -> Any:
    """vLLM's tool message: a list of text parts becomes their text joined by newlines; other parts stay a list."""
    if any(isinstance(p, dict) and p.get("type") != "text" for p in parts):
        return parts
    texts = [p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "text"]
    return "\n".join(texts) if texts else ""


def _with_placeholders(content: Any, role: str, placeholders: Mapping[str, str]) -> str:
    """The "string" format for a multimodal model (_get_full_multimodal_text_prompt, interleave_strings off): the
    model's placeholder for each media item ahead of the message's text, joined by newlines, except where the text
    already holds it."""
    text, _ = content_text(content, role)
    wanted: dict[str, int] = {}
    for ref in media_refs([{"content": content}]):
        holder = placeholders.get(ref.modality)
        if holder is None:
            raise ConversationError(f"this model takes no {ref.modality} content", "messages")
        wanted[holder] = wanted.get(holder, 0) + 1
    missing: list[str] = []
    for holder, n in wanted.items():
        n -= text.count(holder)
        if n < 0:
            raise ConversationError(f"Found more '{holder}' placeholders in input prompt than actual multimodal "
                                    "data items.", "messages")
        missing += [holder] * n
    return "\n".join([*missing, text] if text else missing)


def template_messages(messages: Sequence[Mapping[str, Any]], content_format: ContentFormat,
                      placeholders: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """chat_messages in the content format the engine gives the model's template (cortex/template_format.py):
    "openai" gives each message's content as parts; "string" with `placeholders` (a multimodal model's text for
    each modality) puts them where vLLM does. Without either it is chat_messages' text."""
    out = chat_messages(messages)[0]
    if content_format == "string" and not placeholders:
        return out
    for conv, msg in zip(out, messages, strict=True):
        content = msg.get("content")
        if content_format == "string":
            if isinstance(content, list):
                conv["content"] = _with_placeholders(content, msg["role"], placeholders or {})
            continue
        parts = _openai_parts(content, msg["role"])
        conv["content"] = _tool_content(parts) if msg["role"] == "tool" else parts
    return out


def developer_as_system(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """safe_apply_chat_template: a template that never names the developer role gets developer messages as system
    ones, all system messages then merged into one at the front (joined by a blank line)."""
    if not any(m["role"] == "developer" for m in messages) or '"developer"' in template or "'developer'" in template:
        return messages
    systems: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(messages):
        if m["role"] in ("developer", "system"):
            if i > 0 or systems:
                merge = True
            content = m["content"]
            if isinstance(content, list):  # the "openai" format's parts (_consolidate_system_messages)
                content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                    if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
            if content:
                systems.append(content)
        else:
            rest.append(m)
    if not merge:
        return [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
                for m in messages]
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest]


# -- tools --------------------------------------------------------------------------------------------------

_VLLM_FUNCTION = ("name", "description", "parameters")


def _vllm_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """ChatCompletionToolsParam.model_dump(): the function's known fields in the model's order, description and
    parameters kept as null when absent, strict and defer_loading only when set; unknown keys dropped."""
    function = tool.get("function")
    function = function if isinstance(function, Mapping) else {}
    dumped = {k: function.get(k) for k in _VLLM_FUNCTION}
    defer = function.get("defer_loading")
    if defer is None:
        defer = tool.get("defer_loading")  # propagated from the tool into its function
    if function.get("strict") is not None:
        dumped["strict"] = function["strict"]
    if defer is not None:
        dumped["defer_loading"] = defer
    out: dict[str, Any] = {"type": "function", "function": dumped}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


_SGLANG_FUNCTION = ("description", "name", "parameters", "strict", "defer_loading")


def _sglang_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's Tool.model_dump(): Function in the client's key order (its known fields; the ones the client left
    out follow, as null, except strict and defer_loading), and the Tool's own defer_loading always present."""
    function = tool.get("function")
    function = function if isinstance(function, Mapping) else {}
    defer = tool.get("defer_loading")
    values = {k: function.get(k) for k in _SGLANG_FUNCTION}
    if values["defer_loading"] is None:
        values["defer_loading"] = defer
    for k in ("strict", "defer_loading"):
        if values[k] is None:
            del values[k]
    order = [k for k in function if k in values] + [k for k in values if k not in function]
    return {"type": tool.get("type", "function"), "function": {k: values[k] for k in order}, "defer_loading": defer}


def template_tools(tools: Sequence[Any] | None, tool_choice: Any, style: ToolStyle) -> list[dict[str, Any]] | None:
    """The tools a chat template is given. vLLM: every function tool, whatever tool_choice says (its
    exclude_tools_when_tool_choice_none is off by default). SGLang: none with tool_choice "none", only the named
    one with a named tool_choice."""
    if not tools:
        return None
    function_tools = [t for t in tools if isinstance(t, Mapping) and t.get("type", "function") == "function"]
    if style == "vllm":
        return [_vllm_tool(t) for t in function_tools] or None
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, Mapping):
        named = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"),
                                                                              Mapping) else None
        function_tools = [t for t in function_tools if isinstance(t.get("function"), Mapping)
                          and t["function"].get("name") == named]
    return [_sglang_tool(t) for t in function_tools] or None


def reasoning_kwargs(effort: Any, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """build_chat_params: the request's chat_template_kwargs with its reasoning effort (when set, and not "auto")
    and, unless the client set it, enable_thinking (off only for effort "none")."""
    out = dict(kwargs or {})
    if effort is None:
        return out
    if effort != "auto":  # merge_kwargs drops None and "auto" overrides
        out["reasoning_effort"] = effort
    if "enable_thinking" not in (kwargs or {}):
        out["enable_thinking"] = effort != "none"
    return out


# -- the Responses API (vllm/entrypoints/openai/responses/utils.py) ----------------------------------------------

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


# -- the Anthropic Messages API (vllm/entrypoints/anthropic/serving.py) -------------------------------------------

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


def rejects_inline_system(template: str | None) -> bool:
    """_detect_merge_inline_system: the template fails on [system, user, system, user] in a plain sandbox (no
    raise_exception, no special tokens), so vLLM merges inline system messages into the leading one."""
    if not template:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                      extensions=[jinja2.ext.loopcontrols])
    try:
        env.from_string(template).render(messages=[{"role": r, "content": "t"} for r in
                                                   ("system", "user", "system", "user")],
                                         add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def for_template(messages: list[dict[str, Any]], tools: Sequence[Any] | None, tool_choice: Any, template: str,
                 style: ToolStyle) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools handed to the template, in the engine's style (vLLM also turns the developer role
    into system for a template that does not know it)."""
    if style == "vllm":
        messages = developer_as_system(messages, template)
    return messages, template_tools(tools, tool_choice, style)
