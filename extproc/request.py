"""Parse and check an OpenAI request body: the fields routing reads, and the common fields the engines type-check.

The rule: Cortex refuses a body only when no supported engine would accept it (vLLM 0.33 and SGLang 0.5.23;
the fuzz and table tests pin the cases), so the client gets the same 400 without a worker round trip, and
a request some engine serves is never refused here. Where the two engines disagree, the body is forwarded
and the engine of the chosen worker judges it. Values are coerced the way the engines' pydantic models
coerce them (lax mode: "5" and 5.0 are the integer 5, "false" is False), so Cortex renders the same prompt
the engine will. What Cortex does on top, and why, is listed in docs/configuration.md ("Decisions"):
strict JSON, `model` required, stream_options only with stream, cache_salt with vLLM's rule, token ids
below 2^32, and a nesting bound on what reaches the chat template. Error messages name the field and
what is wrong with it, never the value, so a bad body is never echoed back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cortex.conversation.chat import TEXT_PARTS, chat_messages
from cortex.conversation.template_args import reasoning_kwargs
from cortex.errors import ClientError
from extproc import json_items

Kind = Literal["chat", "completion"]
"""The prompt's form: chat messages rendered by the model's template, or a text / token-id prompt."""
Api = Literal["chat", "completion", "responses", "messages", "count_tokens", "generate", "embeddings", "rerank",
              "score"]
"""The inference API a request came in on (extproc/inference_paths.py: the path table)."""

# Values handed to the chat template (tools, chat_template_kwargs, message fields) may nest this deep. The
# template's `tojson` recurses in Python and fails near 1000 levels (as the engines' own JSON parsing does);
# 512 keeps that out of reach with room for the call stack, far above any real tool schema.
MAX_TEMPLATE_NESTING = 512
# Cortex keys token ids as uint32, and no model's vocabulary comes near it; the engines refuse ids past
# their vocabulary anyway.
MAX_TOKEN_ID = 2**32 - 1
# content: null is accepted by SGLang for these roles (its generic message; roles compared lower-cased)
# and by vLLM for assistant/function; for user and unknown roles no engine accepts it.
_NULL_CONTENT_ROLES = frozenset({"system", "assistant", "tool", "function", "developer"})
# vLLM's typeless content parts ({"image_url": "..."}) name their kind by their only key.
_TYPELESS_PART_KEYS = ("image_url", "audio_url", "video_url")

_M = TypeVar("_M", bound=BaseModel)
NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]


def _expects(what: str) -> Any:
    """An optional field that says what it takes: the 400 for a bad value reads "'<field>' must be <what>"."""
    return Field(None, description=what)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Common(BaseModel):
    """The OpenAI fields both engines type the same way; None everywhere, as vLLM allows (SGLang has defaults)."""

    model_config = ConfigDict(extra="ignore")
    stream: bool | None = _expects("a boolean")
    stream_options: _StreamOptions | None = _expects("an object with boolean include_usage / continuous_usage_stats")
    # vLLM refuses 0 and SGLang's chat treats it as unset, so only negatives are refused by both.
    max_tokens: NonNegInt | None = _expects("an integer >= 0 or null")
    n: PosInt | None = _expects("an integer >= 1 or null")
    temperature: float | None = _expects("a number")
    top_p: float | None = _expects("a number")
    presence_penalty: float | None = _expects("a number")
    frequency_penalty: float | None = _expects("a number")
    stop: str | list[str] | None = _expects("a string, a list of strings, or null")
    seed: int | None = _expects("an integer")
    user: str | None = _expects("a string")
    logit_bias: dict[str, float] | None = _expects("an object mapping token ids to numbers")


class _Chat(_Common):
    max_completion_tokens: NonNegInt | None = _expects("an integer >= 0 or null")
    logprobs: bool | None = _expects("a boolean")
    top_logprobs: int | None = _expects("an integer")
    parallel_tool_calls: bool | None = _expects("a boolean")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = _expects(
        "'none', 'auto', 'required' or an object")
    response_format: dict[str, Any] | None = _expects("an object")
    tools: list[Any] | None = _expects("a list")
    add_generation_prompt: bool | None = _expects("a boolean")
    continue_final_message: bool | None = _expects("a boolean")
    chat_template_kwargs: dict[str, Any] | None = _expects("an object")


class _Completion(_Common):
    logprobs: int | None = _expects("an integer or null")
    echo: bool | None = _expects("a boolean")
    best_of: int | None = _expects("an integer")
    suffix: str | None = _expects("a string")


def _expectations(model: type[BaseModel]) -> dict[str, str]:
    return {name: f.description for name, f in model.model_fields.items() if f.description}


# What each field takes, read off the models above (a field without one fails tests/test_request.py).
_EXPECTED_COMPLETION = _expectations(_Completion)
_EXPECTED = {**_EXPECTED_COMPLETION, **_expectations(_Chat)}


@dataclass(slots=True)
class ParsedRequest:
    """Every inference API's request in one form (extproc/inference_paths.py): what routing, admission and the
    observation read. The prompt to route on is `messages` (+ tools and template flags: a chat render), else
    `prompt_ids`, else `prompt_text`."""

    kind: Kind
    model: str
    stream: bool
    api: Api = "chat"
    messages: list[dict[str, Any]] | None = None
    """The conversation as the template sees it (cortex/conversation/chat.py: chat_messages)."""
    chat_source: list[dict[str, Any]] | None = None
    """The chat messages `messages` was made from (as sent, or converted from the Responses / Messages API): what a
    template that takes content as parts, or a prompt with media, is rendered from (cortex/conversation/
    content_parts.py: template_messages). `inline_source` likewise for `inline_system`."""
    inline_source: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    """Chat-style tools as the client sent them (or converted from the Responses / Messages API); the engine's
    own dump for the template is cortex/conversation/template_args.py: template_tools."""
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    cache_salt: str | None = None
    lora_path: str | None = None
    """SGLang's adapter selector (a vLLM worker ignores the field); see ModelRegistry.resolve."""
    unroutable: str | None = None
    """Why exact-KV routing cannot apply to an otherwise valid request (e.g. image content)."""
    body: dict[str, Any] | None = None
    """The parsed JSON body, as validated (rewrites splice the raw bytes instead of re-serialising this)."""
    session_key: str | None = None
    """The session key from the request headers (cfg.session.headers; set by the server, policies/session.key_of)."""
    max_output: int | None = None
    """The tokens its answer may generate, as reserved against token limits (None: unset, the admission default)."""
    more_prompt_tokens: int = 0
    """An estimate of the prompt tokens a batch holds beyond the routed prompt (reserved, settled by usage)."""
    cache_salts: list[str | None] | None = None
    """SGLang's per-prompt salts of a batch (`cache_salt` as a list): each is salted for an isolated tenant."""
    inline_system: list[dict[str, Any]] | None = None
    """An Anthropic conversation with inline system messages, merged into the first one: what a template that
    demands system-first renders instead of `messages` (cortex/conversation/template_args.py:
    rejects_inline_system)."""
    previous_response: str | None = None
    """The Responses API's previous_response_id: the engine keeps that conversation on one worker."""


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


def _lora_path(value: Any) -> str | None:
    """SGLang's `lora_path`: an adapter name, or one per prompt of a batch (routed by the first, as the prompt is).
    Anything else is left to the engine to judge (vLLM ignores the field, so it is never refused here); it is
    then routed as a base-model request, which can only miss, never claim a wrong hit."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, str) and value else None


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether containers in `value` nest more than `limit` levels (level by level: the input may be hostile)."""
    level = [value]
    for _ in range(limit):
        below = []
        for item in level:
            for child in item.values() if type(item) is dict else item:
                if type(child) is dict or type(child) is list:  # exact types: JSON gives nothing else
                    below.append(child)
        if not below:
            return False
        level = below
    return True


def _check_nesting(value: Any, where: str, param: str) -> None:
    if isinstance(value, dict | list) and _nests_deeper(value, MAX_TEMPLATE_NESTING):
        raise ClientError(400, f"{where} nests deeper than {MAX_TEMPLATE_NESTING} levels", param)


def validated(model: type[_M], body: dict[str, Any], expected: dict[str, str]) -> _M:
    """The body's fields as `model` types them (lax, as the engines' pydantic models), or a 400 naming the first
    failing field and what it takes (`expected`: read off the model's field descriptions)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # The first failing field, in declaration order; pydantic's own text would list every union member.
        field = str(exc.errors(include_url=False, include_input=False)[0]["loc"][0])
        raise ClientError(400, f"'{field}' must be {expected.get(field, 'of another type')}", field) from None


def _fields(kind: Kind, body: dict[str, Any]) -> _Chat | _Completion:
    if kind == "chat":
        return validated(_Chat, body, _EXPECTED)
    return validated(_Completion, body, _EXPECTED_COMPLETION)


def load_object(raw: bytes, items: str | None = None) -> dict[str, Any]:
    """The body as a JSON object: strict RFC 8259 (UTF-8 only, no NaN/Infinity, no lone surrogates, at most 1024
    levels deep); orjson's message gives the position, never the document. `items` names the conversation's
    array, whose elements a next turn repeats: those are decoded once (extproc/json_items.py)."""
    try:
        body = orjson.loads(raw) if items is None else json_items.load(raw, items)
    except orjson.JSONDecodeError as exc:
        raise ClientError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ClientError(400, "request body must be a JSON object")
    return body


def model_of(body: dict[str, Any], required: bool = True) -> str | None:
    """The body's `model`: a non-empty string (None when absent and not required)."""
    model = body.get("model")
    if model is None and "model" not in body and not required:
        return None
    if not isinstance(model, str) or not model:
        raise ClientError(400, "'model' is required and must be a non-empty string", "model")
    return model


def times_n(limit: int | None, n: int | None) -> int | None:
    """The completion tokens `n` answers of at most `limit` tokens may generate (None: no limit given)."""
    return None if limit is None else limit * (n if n is not None else 1)


def _tool_calls(i: int, calls: Any) -> None:
    """An assistant message's tool_calls, as both engines type them (SGLang also takes object arguments)."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ClientError(400, f"messages[{i}].tool_calls must be a list", "messages")
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise ClientError(400, f"{where} must be an object", "messages")
        if call.get("type", "function") != "function":
            raise ClientError(400, f"{where}.type must be 'function'", "messages")
        if not isinstance(call.get("id"), str | None):
            raise ClientError(400, f"{where}.id must be a string", "messages")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ClientError(400, f"{where}.function must be an object", "messages")
        if not isinstance(function.get("name"), str | None):
            raise ClientError(400, f"{where}.function.name must be a string", "messages")
        if not isinstance(function.get("arguments"), str | dict | None):
            raise ClientError(400, f"{where}.function.arguments must be a string or an object", "messages")


def _message(i: int, raw: Any) -> None:
    """Check one chat message the way both engines type it (its text for the template: chat_messages, in
    cortex/conversation/chat.py)."""
    if not isinstance(raw, dict):
        raise ClientError(400, f"messages[{i}] must be an object", "messages")
    role = raw.get("role")
    if not isinstance(role, str):
        # Any string: vLLM takes custom roles and the model's template decides what they mean.
        raise ClientError(400, f"messages[{i}].role must be a string", "messages")
    content = raw.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if isinstance(part, str):  # vLLM reads a bare string part as text
                continue
            if not isinstance(part, dict):
                raise ClientError(400, f"messages[{i}].content[{j}] must be an object or a string", "messages")
            kind = part.get("type")
            if kind is None and any(k in part for k in _TYPELESS_PART_KEYS):
                continue
            if not isinstance(kind, str):
                raise ClientError(400, f"messages[{i}].content[{j}].type must be a string", "messages")
            key = TEXT_PARTS.get(kind)
            if key is not None and not isinstance(part.get(key), str):
                raise ClientError(400, f"messages[{i}].content[{j}].{key} must be a string", "messages")
    elif content is None:
        if "content" in raw and role.lower() not in _NULL_CONTENT_ROLES:
            raise ClientError(400, f"messages[{i}].content must not be null for role {role[:32]!r}", "messages")
    elif not isinstance(content, str):
        raise ClientError(400, f"messages[{i}].content must be a string, a list of parts, or null", "messages")
    if role == "assistant":
        _tool_calls(i, raw.get("tool_calls"))
    for key, value in raw.items():
        if (type(value) is dict or type(value) is list) and key != "content" and \
                _nests_deeper(value, MAX_TEMPLATE_NESTING):
            raise ClientError(400, f"messages[{i}].{key[:32]} nests deeper than {MAX_TEMPLATE_NESTING} levels",
                              "messages")


def _tools(tools: list[Any]) -> None:
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ClientError(400, f"tools[{j}] must be an object", "tools")
        kind = tool.get("type", "function")
        if not isinstance(kind, str):
            raise ClientError(400, f"tools[{j}].type must be a string", "tools")
        if kind != "function":
            continue  # other tool kinds are the engine's to accept or refuse
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ClientError(400, f"tools[{j}].function must be an object with a string 'name'", "tools")
        if not isinstance(function.get("description"), str | None):
            raise ClientError(400, f"tools[{j}].function.description must be a string", "tools")
    _check_nesting(tools, "tools", "tools")


def parse_body(kind: Kind, raw: bytes) -> ParsedRequest:
    """A chat completions (`kind` chat) or completions request."""
    body = load_object(raw, "messages" if kind == "chat" else None)
    model = model_of(body)
    assert model is not None
    fields = _fields(kind, body)
    # vLLM's (and OpenAI's) rule, on the raw values as vLLM checks it before coercion.
    if body.get("stream_options") and not body.get("stream"):
        raise ClientError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
    req = ParsedRequest(kind=kind, model=model, stream=bool(fields.stream), api=kind,
                        cache_salt=_cache_salt(body.get("cache_salt")), lora_path=_lora_path(body.get("lora_path")),
                        body=body)
    if isinstance(fields, _Chat):
        _chat(req, body, fields)
    else:
        _completion_prompt(req, body)
        req.max_output = times_n(fields.max_tokens, fields.n)
    return req


def _chat(req: ParsedRequest, body: dict[str, Any], fields: _Chat) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ClientError(400, "'messages' is required and must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        _message(i, m)
    req.messages, media = chat_messages(messages)
    req.chat_source = messages
    if media:
        # Routed by load unless prepare can key the media as the model's engine does (extproc/media_prompt.py).
        req.unroutable = "non_text_content"
    tools = body.get("tools")
    if tools:
        _tools(tools)
    req.tools = tools or None
    req.tool_choice = body.get("tool_choice")
    # Continuing the final message wins: SGLang continues it whatever add_generation_prompt says (it has no
    # such field), and vLLM refuses the two set together itself; the prompt is the same in both.
    req.continue_final_message = bool(fields.continue_final_message)
    req.add_generation_prompt = fields.add_generation_prompt is not False and not req.continue_final_message
    kwargs = body.get("chat_template_kwargs")
    if kwargs:
        _check_nesting(kwargs, "chat_template_kwargs", "chat_template_kwargs")
    req.chat_template_kwargs = reasoning_kwargs(body.get("reasoning_effort"), kwargs) or None
    req.max_output = times_n(fields.max_completion_tokens if fields.max_completion_tokens is not None
                              else fields.max_tokens, fields.n)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID
                                           for t in value)


CHARS_PER_TOKEN = 4
"""The rule of thumb a batch's other prompts are estimated by (their tokens are reserved, then settled by usage)."""


def _estimate(items: list[Any]) -> int:
    return sum(len(p) if isinstance(p, list) else -(-len(p) // CHARS_PER_TOKEN) for p in items)


def prompt_of(req: ParsedRequest, value: Any, param: str) -> bool:
    """Set the request's prompt from a text / token-id prompt or a batch of them (routed by its first one: one
    request goes to one worker; the others are estimated for the token reservation). False when `value` is
    None; a 400 when it is anything but these forms, or empty."""
    if value is None:
        return False
    if isinstance(value, str):
        req.prompt_text = value
    elif _is_ids(value) and value:
        req.prompt_ids = value
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        req.prompt_text = value[0]
        req.more_prompt_tokens = _estimate(value[1:])
    elif isinstance(value, list) and value and all(_is_ids(p) and p for p in value):
        req.prompt_ids = value[0]
        req.more_prompt_tokens = _estimate(value[1:])
    else:
        raise ClientError(400, f"'{param}' must be a string, a list of strings, a list of token ids "
                               f"(0 to {MAX_TOKEN_ID}), or a list of token-id lists, and not empty", param)
    return True


def _completion_prompt(req: ParsedRequest, body: dict[str, Any]) -> None:
    if prompt_of(req, body.get("prompt"), "prompt"):
        return
    if body.get("prompt_embeds") is not None:
        # vLLM's embeddings-only prompt: served by the engine, but there are no tokens to route by.
        req.prompt_text = ""
        req.unroutable = "prompt_embeds"
        return
    raise ClientError(400, "'prompt' is required", "prompt")
