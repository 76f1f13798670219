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

One module per step, each importing only the names this file defines below and the modules listed above it:

    chat.py            chat messages as the template sees them, in the "string" content format (chat_messages)
    content_parts.py   media parts in order (media_refs) and the "openai" content format (template_messages)
    responses_api.py   the Responses API's instructions, input items and tools as chat messages and tools
    anthropic_api.py   the Anthropic Messages API's system, messages and tools as chat messages and tools
    template_args.py   the last steps before rendering, in the engine's style: the developer role, the tools'
                       dump (template_tools), reasoning kwargs, whether the template takes inline system messages

Pure functions over parsed JSON; a malformed structure raises ConversationError (a client error: the engines
refuse it too). Nothing here mutates its input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
