"""The last steps before a chat template renders, in the engine's style: the developer role, the tools' dump,
reasoning kwargs, and whether the template takes inline system messages.

vLLM: vllm/renderers/hf.py (safe_apply_chat_template), ChatCompletionToolsParam's dump, build_chat_params and
_detect_merge_inline_system. SGLang 0.5.23 dumps tools its own way (sglang/srt/entrypoints/openai/protocol.py:
Function keeps the client's key order, Tool keeps defer_loading), hence `ToolStyle` (cortex/engines:
EngineAdapter.tool_style).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.sandbox

ToolStyle = Literal["vllm", "sglang"]


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
