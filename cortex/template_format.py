"""Which content format vLLM hands a chat template: message content as one string, or as a list of parts.

vLLM 0.32 reads the template's Jinja AST (vllm/renderers/hf.py: `_detect_content_format`): a template that loops
over a message's content (`{% for part in message['content'] %}`, directly, through a variable assigned from it,
or through a macro parameter it is passed to) gets content in the "openai" format, a list of parts (`{"type":
"text", "text": ...}`, `{"type": "image"}`); any other template gets the "string" format, the text parts joined.
A multimodal template writes its media markers only when it sees the parts, so Cortex must know which one the
engine used. This is that detection, ported node for node (tests/fixtures/media_vectors.json holds vLLM's answers).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator
from typing import Literal

import jinja2
import jinja2.nodes
import jinja2.sandbox

ContentFormat = Literal["string", "openai"]


def _var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _var(node.node, name) and node.attr == key
    return False


def _var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _var_or_elems(node.node, name, key)
    return _attr(node, name, key) if key else _var(node, name)


def _assigned(root: jinja2.nodes.Node, name: str) -> Iterator[str]:
    """The names holding `name` or its elements: itself, then whatever is assigned from them (breadth first)."""
    yield name
    related = deque([name])
    while related:
        current = related.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _var_or_elems(assign.node, current) and isinstance(assign.target, jinja2.nodes.Name):
                yield assign.target.name
                if assign.target.name != current:
                    related.append(assign.target.name)


def _message_names(root: jinja2.nodes.Node) -> list[str]:
    """Loop variables of `{% for message in messages %}` (or over a variable assigned from messages)."""
    sources = list(_assigned(root, "messages"))
    out = []
    for loop in root.find_all(jinja2.nodes.For):
        if any(_var_or_elems(loop.iter, name) for name in sources) and isinstance(loop.target, jinja2.nodes.Name):
            out.append(loop.target.name)
    return out


def _loops_over_content(root: jinja2.nodes.Node) -> bool:
    messages = _message_names(root)
    content_params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        params = {arg.name for arg in macro.args}
        passed: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_var_or_elems(arg, m, "content") for m in messages):
                    passed.add(macro.args[i].name)
            for kw in call.kwargs:
                if isinstance(kw, jinja2.nodes.Keyword) and kw.key in params and \
                        any(_var_or_elems(kw.value, m, "content") for m in messages):
                    passed.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if passed:
                content_params[id(loop)] = passed
    for loop in root.find_all(jinja2.nodes.For):
        if not isinstance(loop.target, jinja2.nodes.Name):
            continue
        if any(_var_or_elems(loop.iter, m, "content") for m in messages):
            return True
        passed_in = content_params.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name):
            if passed_in is not None and loop.iter.name in passed_in:
                return True
            if id(loop) not in in_macros and loop.iter.name == "content":
                return True
    return False


@functools.lru_cache(maxsize=32)
def content_format(template: str | None) -> ContentFormat:
    """vLLM's detected format for `template` ("string" when there is none or it does not parse)."""
    if not template:
        return "string"
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                      extensions=["jinja2.ext.loopcontrols"])
    try:
        ast = env.parse(template)
    except jinja2.TemplateError:
        return "string"
    return "openai" if _loops_over_content(ast) else "string"
