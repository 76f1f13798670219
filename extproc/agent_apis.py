"""The agent APIs' requests as Cortex's one parsed form: OpenAI's Responses API and Anthropic's Messages API.

vLLM 0.32 serves both by turning them into a chat-template render (cortex/conversation/ has its rules), so a
Responses or Messages request is parsed into the same `ParsedRequest` a chat completion is: its conversation,
tools and template flags, routed by the blocks of the very prompt the engine will compute. What Cortex cannot
render it routes without a claim: a Responses request continuing a stored response (`previous_response_id`: the
engine prepends a conversation only it holds, so the request goes to the worker that holds it,
extproc/response_ids.py) and media content.

Fields are checked the way the engines type them (lax coercion, a 400 naming the field); fields Cortex does not
read are the engine's to judge.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from cortex.conversation import ConversationError
from cortex.conversation.anthropic_api import anthropic_messages, anthropic_tools
from cortex.conversation.chat import chat_messages
from cortex.conversation.responses_api import responses_continues, responses_messages, responses_tools
from cortex.conversation.template_args import reasoning_kwargs
from cortex.errors import ClientError
from extproc.request import (
    NonNegInt,
    ParsedRequest,
    _cache_salt,
    _check_nesting,
    _expectations,
    _expects,
    _message,
    _tools,
    load_object,
    model_of,
    validated,
)


class _Responses(BaseModel):
    model_config = ConfigDict(extra="ignore")
    stream: bool | None = _expects("a boolean")
    max_output_tokens: NonNegInt | None = _expects("an integer >= 0 or null")
    instructions: str | None = _expects("a string or null")
    previous_response_id: str | None = _expects("a string or null")
    tools: list[Any] | None = _expects("a list")
    reasoning: dict[str, Any] | None = _expects("an object")
    chat_template_kwargs: dict[str, Any] | None = _expects("an object")
    temperature: float | None = _expects("a number")
    top_p: float | None = _expects("a number")
    store: bool | None = _expects("a boolean")
    request_id: str | None = _expects("a string")


class _Messages(BaseModel):
    model_config = ConfigDict(extra="ignore")
    max_tokens: NonNegInt = _expects("an integer >= 0")
    stream: bool | None = _expects("a boolean")
    temperature: float | None = _expects("a number")
    top_p: float | None = _expects("a number")
    top_k: int | None = _expects("an integer")
    stop_sequences: list[str] | None = _expects("a list of strings")
    chat_template_kwargs: dict[str, Any] | None = _expects("an object")
    output_config: dict[str, Any] | None = _expects("an object")


class _CountTokens(BaseModel):
    """vLLM's AnthropicCountTokensRequest: a Messages request without the sampling fields."""

    model_config = ConfigDict(extra="ignore")
    chat_template_kwargs: dict[str, Any] | None = _expects("an object")
    output_config: dict[str, Any] | None = _expects("an object")
    thinking: dict[str, Any] | None = _expects("an object")


_EXPECTED_RESPONSES = _expectations(_Responses)
_EXPECTED_MESSAGES = _expectations(_Messages)
_EXPECTED_COUNT_TOKENS = _expectations(_CountTokens)
TOKEN_COUNT = "token_count"
"""The unroutable reason of a count_tokens request: routed by load, never claimed (it computes no KV)."""


def _converted(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except ConversationError as exc:
        raise ClientError(400, str(exc), exc.param) from None


def _as_chat(req: ParsedRequest, messages: list[dict[str, Any]], param: str) -> None:
    """The converted messages checked as chat messages, then as the template sees them."""
    for i, m in enumerate(messages):
        try:
            _message(i, m)
        except ClientError as exc:
            raise ClientError(400, f"{param}: {exc.message}", param) from None
    req.messages, media = chat_messages(messages)
    req.chat_source = messages
    if media:
        req.unroutable = "non_text_content"  # unless prepare keys the media (extproc/media_prompt.py)


def parse_responses(raw: bytes) -> ParsedRequest:
    """POST /v1/responses: `instructions` and `input` (a string or items: messages, function calls and their
    outputs, reasoning) as chat messages, its function tools as chat tools."""
    body = load_object(raw, "input")
    model = model_of(body)
    assert model is not None
    fields = validated(_Responses, body, _EXPECTED_RESPONSES)
    items = body.get("input")
    if not isinstance(items, str | list):
        raise ClientError(400, "'input' is required and must be a string or a list of items", "input")
    req = ParsedRequest(kind="chat", model=model, stream=bool(fields.stream), api="responses", body=body,
                        cache_salt=_cache_salt(body.get("cache_salt")), max_output=fields.max_output_tokens)
    _as_chat(req, _converted(responses_messages, fields.instructions, items), "input")
    tools = responses_tools(fields.tools)
    if tools:
        _tools(tools)
    req.tools = tools
    req.tool_choice = body.get("tool_choice")
    req.continue_final_message = responses_continues(items)
    req.add_generation_prompt = not req.continue_final_message
    kwargs = fields.chat_template_kwargs
    if kwargs:
        _check_nesting(kwargs, "chat_template_kwargs", "chat_template_kwargs")
    effort = (fields.reasoning or {}).get("effort")
    req.chat_template_kwargs = reasoning_kwargs(effort, kwargs) or None
    if fields.previous_response_id:
        # The engine renders the stored conversation before this input: Cortex cannot, so nothing is claimed.
        req.previous_response = fields.previous_response_id
        req.unroutable = "previous_response"
    return req


def parse_messages(raw: bytes) -> ParsedRequest:
    """POST /v1/messages: Anthropic's `system`, `messages` (text, tool uses and results, thinking) and `tools` as
    the chat request vLLM makes of them."""
    body = load_object(raw, "messages")
    model = model_of(body)
    assert model is not None
    if body.get("max_tokens") is None:
        raise ClientError(400, "'max_tokens' is required", "max_tokens")
    fields = validated(_Messages, body, _EXPECTED_MESSAGES)
    system, messages = body.get("system"), body.get("messages")
    req = ParsedRequest(kind="chat", model=model, stream=bool(fields.stream), api="messages", body=body,
                        cache_salt=_cache_salt(body.get("cache_salt")), max_output=fields.max_tokens)
    _as_chat(req, _converted(anthropic_messages, system, messages, merge_inline_system=False), "messages")
    if any(isinstance(m, dict) and m.get("role") == "system" for m in messages or ()):
        merged = _converted(anthropic_messages, system, messages, merge_inline_system=True)
        req.inline_system = chat_messages(merged)[0]
        req.inline_source = merged
    tools = _converted(anthropic_tools, body.get("tools"))
    if tools:
        _check_nesting(tools, "tools", "tools")
    req.tools = tools or None
    kwargs = fields.chat_template_kwargs
    if kwargs:
        _check_nesting(kwargs, "chat_template_kwargs", "chat_template_kwargs")
    req.chat_template_kwargs = reasoning_kwargs((fields.output_config or {}).get("effort"), kwargs) or None
    return req


def parse_count_tokens(raw: bytes) -> ParsedRequest:
    """POST /v1/messages/count_tokens: the Messages body vLLM counts (`model`, `messages`, `system`, `tools`; no
    max_tokens), checked as /v1/messages checks it so a bad body is Cortex's 400, not a worker's.

    The engine only renders and tokenizes it: nothing is computed, nothing cached, nothing generated. So it is
    routed by load among its model's workers with no claim (no prompt is rendered here, no prediction recorded),
    and it costs no tokens under the tenant's token limits: its answer carries no usage, and the routed prompt is
    0 tokens. Its rate and concurrency limits hold as on every path."""
    body = load_object(raw, "messages")
    model = model_of(body)
    assert model is not None
    fields = validated(_CountTokens, body, _EXPECTED_COUNT_TOKENS)
    messages = body.get("messages")
    if messages is None:
        raise ClientError(400, "'messages' is required", "messages")
    probe = ParsedRequest(kind="chat", model=model, stream=False, api="count_tokens", body=body)
    _as_chat(probe, _converted(anthropic_messages, body.get("system"), messages,
                               merge_inline_system=False), "messages")
    tools = _converted(anthropic_tools, body.get("tools"))
    if tools:
        _check_nesting(tools, "tools", "tools")
    if fields.chat_template_kwargs:
        _check_nesting(fields.chat_template_kwargs, "chat_template_kwargs", "chat_template_kwargs")
    return ParsedRequest(kind="completion", model=model, stream=False, api="count_tokens", body=body,
                         prompt_text="", unroutable=TOKEN_COUNT, max_output=0)
