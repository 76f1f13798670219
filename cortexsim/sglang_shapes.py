"""The bodies a simulated SGLang server answers with (pure): generation's OpenAI-compatible completions and stream
chunks with SGLang's extra fields (``matched_stop``, ``reasoning_content``, ``metadata``), /generate's native
``text`` + ``meta_info``, and the KV-event publisher /server_info describes. The endpoints that send them are
cortexsim/sglang_api.py's.
"""

from __future__ import annotations

import json
from typing import Any

from cortexsim.config import SimConfig
from cortexsim.engine import SimRequest
from cortexsim.openai_api import Prepared, sse


def cached_tokens(req: SimRequest, prepared: Prepared) -> int:
    """What the response reports as cached: the engine's own count, or a PD decode's prefill's."""
    return req.num_cached_tokens if prepared.reported_cached_tokens is None else prepared.reported_cached_tokens


def usage(req: SimRequest, prepared: Prepared) -> dict[str, Any]:
    n_out = len(req.output_token_ids)
    return {"prompt_tokens": len(req.prompt_token_ids), "total_tokens": len(req.prompt_token_ids) + n_out,
            "completion_tokens": n_out, "prompt_tokens_details": {"cached_tokens": cached_tokens(req, prepared)},
            "reasoning_tokens": 0}


def meta_info(req: SimRequest, prepared: Prepared, finish: str | None) -> dict[str, Any]:
    return {"id": req.request_id,
            "finish_reason": {"type": finish, "length": len(req.output_token_ids)} if finish else None,
            "prompt_tokens": len(req.prompt_token_ids), "completion_tokens": len(req.output_token_ids),
            "cached_tokens": cached_tokens(req, prepared), "weight_version": "default"}


def generate_body(req: SimRequest, prepared: Prepared, text: str, finish: str | None) -> dict[str, Any]:
    """/generate's answer."""
    return {"text": text, "output_ids": req.output_token_ids, "meta_info": meta_info(req, prepared, finish)}


def completion_body(req: SimRequest, prepared: Prepared, text: str, finish: str | None, model: str, created: int,
                    *, chat: bool) -> dict[str, Any]:
    """A chat completion's or a text completion's answer."""
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text,
                                                          "reasoning_content": None},
                                  "logprobs": None, "finish_reason": finish, "matched_stop": None}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": None}
        kind = "text_completion"
    return {"id": req.request_id, "object": kind, "created": created, "model": model,
            "choices": [choice], "usage": usage(req, prepared), "metadata": {"weight_version": "default"}}


def stream_head(req: SimRequest, model: str, created: int, *, chat: bool) -> dict[str, Any]:
    """The fields every chunk of a streamed completion repeats."""
    return {"id": req.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model}


def generate_chunk(req: SimRequest, prepared: Prepared, text_so_far: str, count: int, finish: str | None) -> bytes:
    """/generate streams the whole text so far in every chunk."""
    return sse({"text": text_so_far, "output_ids": req.output_token_ids[:count],
                "meta_info": meta_info(req, prepared, finish)})


def chat_chunks(head: dict[str, Any], text: str, finish: str | None, *, first: bool) -> bytes:
    """One token of a streamed chat completion: after a role chunk for the first, and before a finish chunk for the
    last."""
    out = b""
    if first:
        out += sse({**head, "choices": [{
            "index": 0, "delta": {"role": "assistant", "content": "", "reasoning_content": None},
            "logprobs": None, "finish_reason": None, "matched_stop": None}], "usage": None})
    out += sse({**head, "choices": [{
        "index": 0, "delta": {"role": None, "content": text, "reasoning_content": None},
        "logprobs": None, "finish_reason": None, "matched_stop": None}], "usage": None})
    if finish is not None:
        out += sse({**head, "choices": [{
            "index": 0, "delta": {"role": None, "content": None, "reasoning_content": None},
            "logprobs": None, "finish_reason": finish, "matched_stop": None}], "usage": None})
    return out


def text_chunk(head: dict[str, Any], text: str, finish: str | None) -> bytes:
    """One token of a streamed text completion."""
    return sse({**head, "choices": [{
        "index": 0, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": None}], "usage": None})


def usage_chunk(head: dict[str, Any], req: SimRequest, prepared: Prepared) -> bytes:
    """The last chunk of a stream that asked for `stream_options.include_usage`."""
    return sse({**head, "choices": [], "usage": usage(req, prepared)})


def kv_events_descriptor(config: SimConfig, dp_size: int, events_port: int | None,
                         replay_port: int | None) -> dict[str, Any] | None:
    """/server_info's `kv_events`: where the publisher binds (None: no KV events)."""
    if events_port is None:
        return None
    out: dict[str, Any] = {"publisher": "zmq", "endpoint_host": config.host,
                           "endpoint_port_base": events_port, "topic": config.kv_topic,
                           "block_size": config.page_size, "dp_size": dp_size}
    if replay_port is not None:
        out["replay_endpoint_port_base"] = replay_port
    return out


def kv_events_config(config: SimConfig, events_port: int | None, replay_port: int | None) -> str | None:
    """/server_info's `kv_events_config`: the `--kv-events-config` JSON the server was started with."""
    if events_port is None:
        return None
    cfg: dict[str, Any] = {"publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
                           "topic": config.kv_topic, "format": config.kv_events_format}
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://*:{replay_port}"
    return json.dumps(cfg)
