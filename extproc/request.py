"""Parse and check an OpenAI request body: just the fields routing reads, with the engines' own rules.

Anything Cortex would have to guess about is refused here with a 4xx (never forwarded); fields routing
does not read are left for the engine to judge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from cortex.errors import ClientError

Kind = Literal["chat", "completion"]

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"
ROUTED_PATHS: dict[str, Kind] = {CHAT_PATH: "chat", COMPLETION_PATH: "completion"}


@dataclass(slots=True)
class ParsedRequest:
    kind: Kind
    model: str
    stream: bool
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    cache_salt: str | None = None
    unroutable: str | None = None
    """Why exact-KV routing cannot apply to an otherwise valid request (e.g. image content)."""
    body: dict[str, Any] | None = None
    """The parsed JSON body, kept for the rare case Cortex must rewrite it (SGLang data-parallel pinning)."""


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ClientError(400, f"'{name}' must be a boolean", name)
    return value


def _cache_salt(value: Any) -> str | None:
    """vLLM's validate_cache_salt: a non-empty string of at most 128 characters without @ / \\ or NUL."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ClientError(400, "'cache_salt' must be a non-empty string", "cache_salt")
    if len(value) > 128:
        raise ClientError(400, "'cache_salt' must be at most 128 characters", "cache_salt")
    if any(c in value for c in "@/\\\x00"):
        raise ClientError(400, "'cache_salt' must not contain '@', '/', '\\' or NUL", "cache_salt")
    return value


def _message(i: int, raw: Any) -> tuple[dict[str, Any], bool]:
    """A message as the template sees it; returns (message, has_non_text_content)."""
    if not isinstance(raw, dict):
        raise ClientError(400, f"messages[{i}] must be an object", "messages")
    role = raw.get("role")
    if not isinstance(role, str) or not role:
        raise ClientError(400, f"messages[{i}].role must be a non-empty string", "messages")
    content = raw.get("content")
    non_text = False
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ClientError(400, f"messages[{i}].content[{j}] must be an object with a 'type'", "messages")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise ClientError(400, f"messages[{i}].content[{j}].text must be a string", "messages")
                texts.append(part["text"])
            else:
                non_text = True
        # Engines flatten text parts of a string-content template with newlines (vLLM's "string" format).
        raw = {**raw, "content": "\n".join(texts)}
    elif content is not None and not isinstance(content, str):
        raise ClientError(400, f"messages[{i}].content must be a string, a list of parts, or null", "messages")
    elif content is None and role != "assistant":
        raise ClientError(400, f"messages[{i}].content is required for role {role!r}", "messages")
    return raw, non_text


def parse_body(kind: Kind, raw: bytes) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ClientError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ClientError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ClientError(400, "'model' is required and must be a string", "model")
    req = ParsedRequest(kind=kind, model=model, stream=_bool(body, "stream", False),
                        cache_salt=_cache_salt(body.get("cache_salt")), body=body)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ClientError(400, "'messages' is required and must be a non-empty list", "messages")
        parsed = [_message(i, m) for i, m in enumerate(messages)]
        req.messages = [m for m, _ in parsed]
        if any(non_text for _, non_text in parsed):
            req.unroutable = "non_text_content"
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ClientError(400, "'tools' must be a list", "tools")
        req.tools = tools or None
        req.add_generation_prompt = _bool(body, "add_generation_prompt", True)
        req.continue_final_message = _bool(body, "continue_final_message", False)
        if req.add_generation_prompt and req.continue_final_message:
            raise ClientError(400, "'add_generation_prompt' and 'continue_final_message' cannot both be true")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ClientError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
        req.chat_template_kwargs = kwargs
    else:
        _completion_prompt(req, body.get("prompt"))
    return req


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                           for t in value)


def _completion_prompt(req: ParsedRequest, prompt: Any) -> None:
    # A batch of prompts is routed by its first one: one request goes to one worker.
    if isinstance(prompt, str):
        req.prompt_text = prompt
    elif _is_ids(prompt) and prompt:
        req.prompt_ids = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        req.prompt_text = prompt[0]
    elif isinstance(prompt, list) and prompt and all(_is_ids(p) and p for p in prompt):
        req.prompt_ids = prompt[0]
    elif prompt is None:
        raise ClientError(400, "'prompt' is required", "prompt")
    else:
        raise ClientError(400, "'prompt' must be a string, a list of strings, a list of token ids, "
                               "or a list of token-id lists, and not empty", "prompt")
