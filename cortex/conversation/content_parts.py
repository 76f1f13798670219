"""Media parts in prompt order, and message content in the "openai" content format (vllm/renderers/
chat_utils.py: _parse_chat_message_content_parts with wrap_dicts, _get_full_multimodal_text_prompt).

Which format a model's template takes is cortex/template_format.py's question; `template_messages` gives the
messages in it (a multimodal model's "string" format puts its placeholders where vLLM does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cortex.conversation import ConversationError
from cortex.conversation.chat import chat_messages, content_text, message_parts, part_text

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
    for part in message_parts(content, role):
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
