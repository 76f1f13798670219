"""Tokenizer parity: does the worker turn a conversation into the same token ids as Cortex does?

If Cortex's chat template or tokenizer differs from the engine's in a single token, every block key after
it differs and every hit is silently lost (peers' most reported complaint). So when a worker joins, and
every `ingest.token_parity_interval_s` after, ingest renders and tokenizes a fixed set of probe
conversations with the model's bundle and asks the worker's own tokenize endpoint for the same (the engine
adapter's `tokenize_request`: vLLM `POST /tokenize` chat form with `add_generation_prompt: true`; SGLang
`POST /v1/tokenize` with `add_generation_prompt` omitted, which renders exactly as a chat completion does), plus
one completions prompt. A worker is eligible for exact-KV routing only while this holds (engines.md §5.3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from cortex import engines
from cortex.conversation.content_parts import template_messages
from cortex.conversation.template_args import ToolStyle, for_template
from cortex.model_bundle import ModelBundle, TemplateError

UNKNOWN, OK, FAILED = "unknown", "ok", "failed"

_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

PROBES: list[dict[str, Any]] = [
    {"messages": [{"role": "system", "content": "You are a careful assistant."},
                  {"role": "user", "content": "Summarise the plot of Hamlet in two sentences."}]},
    {"messages": [{"role": "user", "content": "Hi! 你好, ¿qué tal? 🙂"},
                  {"role": "assistant", "content": "Hello. How can I help?"},
                  {"role": "user", "content": "  Leading spaces,\ttabs and\n\nblank lines.  "}]},
    {"messages": [{"role": "system", "content": "Use tools when they help."},
                  {"role": "user", "content": "Weather in Paris?"}], "tools": _TOOLS},
]
COMPLETION_PROBE = "The quick brown fox jumps over the lazy dog. 1234567890 <tag> &amp; ünïcödé"


@dataclass
class TokenParity:
    status: str = UNKNOWN
    reason: str = "not checked yet"
    checks: int = 0
    failures: int = 0
    checked_at: float = 0.0


def expected(bundle: ModelBundle, style: ToolStyle = "vllm") -> list[tuple[dict[str, Any], list[int]]]:
    """The probes this bundle can render, with Cortex's own ids for each (tools handed to the template the way the
    worker's engine hands them: `style`, cortex/conversation/template_args.py)."""
    out: list[tuple[dict[str, Any], list[int]]] = []
    if bundle.has_chat_template:
        for probe in PROBES:
            # In the content format the engine gives this template (parts for one that loops over them).
            view = template_messages(probe["messages"], bundle.content_format)
            messages, tools = for_template(view, probe.get("tools"), None, bundle.chat_template or "", style)
            try:
                ids = bundle.encode_chat(messages, tools=tools, add_generation_prompt=True)
            except TemplateError:
                continue  # a template without tool support: skip that probe, as a client could not use it
            out.append((probe, ids))
    out.append(({"prompt": COMPLETION_PROBE}, bundle.encode(COMPLETION_PROBE, add_special_tokens=True)))
    return out


async def check(session: aiohttp.ClientSession, url: str, engine: str, model: str,
                probes: list[tuple[dict[str, Any], list[int]]], timeout_s: float,
                tls: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """(status, reason). A proven difference in any probe is `failed`, whatever else happened; a probe the
    worker could not answer leaves it `unknown`; all identical is `ok`. `tls`: an https worker's request
    arguments (cortex/upstream_tls.py WorkerTls.kwargs)."""
    unanswered: str | None = None
    for probe, ids in probes:
        path, body = engines.adapter(engine).tokenize_request(model, probe)
        try:
            async with session.post(f"{url}{path}", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                    **(tls or {})) as r:
                if r.status != 200:
                    unanswered = unanswered or f"{path} answered {r.status}"
                    continue
                doc = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            unanswered = unanswered or f"{path} failed: {type(exc).__name__}"
            continue
        theirs = doc.get("tokens") if isinstance(doc, dict) else None
        if isinstance(theirs, list) and theirs and isinstance(theirs[0], list):
            theirs = theirs[0]  # SGLang answers a list per prompt when given a list
        if theirs != ids:
            what = f"chat probe {PROBES.index(probe)}" if "messages" in probe else "completions probe"
            n = len(theirs) if isinstance(theirs, list) else 0
            at = next((i for i, (a, b) in enumerate(zip(ids, theirs or [], strict=False)) if a != b), min(len(ids), n))
            return FAILED, (f"{what} differs at token {at} (Cortex {len(ids)} tokens, worker {n}): check the "
                            "model's tokenizer and chat template")
    if unanswered:
        return UNKNOWN, unanswered
    return OK, f"{len(probes)} probes tokenized identically"
