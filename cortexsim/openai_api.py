"""HTTP plumbing both simulated engines share: request parsing, DP-rank choice, HTTP faults and streaming.

``OpenAIServing`` turns an OpenAI chat/completions body into token ids (real chat template, real tokenizer),
picks a DP rank, applies the HTTP faults, runs the flavour's PD preparation, submits a ``SimRequest`` to that
rank's engine and hands the outputs to the flavour's response formatting. Everything engine-specific (route
names, JSON shapes, error bodies, metrics, PD protocol) lives in ``vllm_api`` and ``sglang_api`` (with its
``sglang_*`` siblings).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from aiohttp import web

from cortex import media
from cortex.conversation import ConversationError
from cortex.conversation.chat import chat_messages, part_text
from cortex.conversation.content_parts import media_refs, template_messages
from cortex.conversation.template_args import for_template, reasoning_kwargs
from cortex.engine_hashes import LoraRef
from cortex.media import MediaSpan
from cortex.model_bundle import ModelBundle, TemplateError
from cortexsim.engine import Delta, EngineCore, EngineDeadError, SimRequest
from cortexsim.faults import Faults

log = logging.getLogger("cortex.sim.openai_api")  # its name in log lines, kept across the move

DEFAULT_MAX_TOKENS = 16
# A plain sentence: each of its tokens decodes to the same text on its own, so streamed deltas concatenate
# to exactly the non-streamed text.
OUTPUT_TEXT = " The quick brown fox jumps over the lazy dog."


class ApiError(Exception):
    """An error answered with the engine's JSON error body (vLLM nests it under "error", SGLang does not)."""

    _TYPES: ClassVar[dict[int, str]] = {400: "BadRequestError", 404: "NotFoundError",
                                        500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self, flavour: str) -> dict[str, Any]:
        kind = self._TYPES.get(self.status, "Error")
        if flavour == "sglang":
            return {"object": "error", "message": self.message, "type": kind, "param": None, "code": self.status}
        return {"error": {"message": self.message, "type": kind, "param": None, "code": self.status}}

    def response(self, flavour: str = "vllm") -> web.Response:
        return json_response(self.body(flavour), status=self.status)


# The DP rank a handler chose, read back when the response headers are written.
DP_RANK_KEY = web.RequestKey("sim_dp_rank", int)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


class ResetRequest(Exception):
    """The reset_requests fault: the middleware cuts the connection instead of answering."""


def error_middleware(flavour: str) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response(flavour)
        except ResetRequest:
            # The reset_requests fault: the connection is cut before any answer, as by a worker that crashes on
            # requests while its /health still answers.
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)  # never reaches the client: its connection is gone
        except EngineDeadError as exc:
            return ApiError(500, f"EngineCore encountered an issue: {exc}").response(flavour)
    return middleware


async def read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    return body


def int_field(body: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer")
    if value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {value}")
    return value


def normalize_messages(messages: Any, media: bool = False) -> list[dict[str, Any]]:
    """Chat messages as the model takes them: media parts refused unless `media` (a vLLM model with a processor
    rule, cortex/media.py); their text for the template is cortex/conversation/'s, as the engines build it."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ApiError(400, "each message must be an object with a role")
        content = msg.get("content")
        if not media and isinstance(content, list) and any(part_text(p)[1] for p in content):
            raise ApiError(400, "only text content parts are supported by this model")
    return messages


def requested_schema(body: Mapping[str, Any]) -> Any:
    """The JSON schema a request constrains its answer with (where vLLM or SGLang read one), `True` for
    `json_object`, None for free text."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return True
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        return spec.get("schema") if isinstance(spec, dict) else fmt.get("schema")
    outputs = body.get("structured_outputs")
    found = outputs.get("json") if isinstance(outputs, dict) else body.get("json_schema")
    if isinstance(found, str):
        try:
            return orjson.loads(found)
        except orjson.JSONDecodeError:
            return None
    return found


def schema_instance(schema: Any, depth: int = 0) -> Any:
    """A small value of the schema's shape: what a grammar-constrained engine would write, minus `pattern`,
    `format` and cross-keyword rules (so a check of the answer can still find it invalid)."""
    if not isinstance(schema, dict) or depth > 32:
        return {}
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return schema_instance(schema[key][0], depth + 1)
    kind = schema.get("type", "object" if "properties" in schema else None)
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props: Any = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        required: Any = schema.get("required")
        required = required if isinstance(required, list) else []
        return {k: schema_instance(props.get(k, {"type": "string"}), depth + 1) for k in required if isinstance(k, str)}
    if kind == "array":
        items: Any = schema.get("minItems")
        n = items if isinstance(items, int) else 0
        return [schema_instance(schema.get("items", {}), depth + 1) for _ in range(min(max(n, 0), 8))]
    if kind in ("integer", "number"):
        low = schema.get("minimum", 0)
        return low if isinstance(low, int | float) and not isinstance(low, bool) else 0
    if kind == "string":
        least: Any = schema.get("minLength")
        return "a" * min(max(least if isinstance(least, int) else 1, 1), 64)
    if kind == "boolean":
        return True
    return None if kind == "null" else {}


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


@dataclass
class Prepared:
    """What a flavour's PD preparation decided for one request."""

    num_external_tokens: int = 0
    reported_cached_tokens: int | None = None
    hold_blocks: bool = False
    max_tokens: int | None = None
    extra: dict[str, Any] | None = None


class OpenAIServing(ABC):
    """Shared request handling; subclasses supply routes, formats and the PD protocol."""

    flavour = "vllm"

    def __init__(self, *, model: str, bundle: ModelBundle, engines: list[EngineCore], max_model_len: int,
                 created: int, faults: Faults, max_queued_requests: int | None = None) -> None:
        self.model = model
        self.bundle = bundle
        self.engines = engines
        self.max_model_len = max_model_len
        self.created = created
        self.faults = faults
        self.max_queued_requests = max_queued_requests
        self._token_text: dict[int, str] = {}
        self._round_robin = itertools.cycle(range(len(engines)))

    # --- hooks ---------------------------------------------------------------------------------

    def requested_rank(self, request: web.Request, body: Mapping[str, Any]) -> int | None:
        return None

    def check_model(self, body: Mapping[str, Any]) -> None:
        """Refuse a body naming a model this worker does not serve (vLLM checks; SGLang serves any name)."""
        return None

    def resolve_lora(self, body: Mapping[str, Any]) -> LoraRef | None:
        return None

    async def prepare(self, request: web.Request, body: Mapping[str, Any], prompt: list[int],
                      engine: EngineCore) -> Prepared:
        return Prepared()

    async def finished(self, req: SimRequest, prepared: Prepared, engine: EngineCore) -> None:
        """Called once the engine finished `req` successfully (PD bookkeeping); nothing to do without PD."""
        return None

    def overload_response(self) -> ApiError:
        return ApiError(503, "The server is overloaded; the request was rejected.")

    # --- shared helpers ------------------------------------------------------------------------

    def pick_engine(self, request: web.Request, body: Mapping[str, Any]) -> EngineCore:
        rank = self.requested_rank(request, body)
        if rank is None:
            rank = next(self._round_robin)
        if not 0 <= rank < len(self.engines):
            raise ApiError(400, f"data parallel rank {rank} is out of range (dp size {len(self.engines)})")
        request[DP_RANK_KEY] = rank
        return self.engines[rank]

    def answer_text(self, body: Mapping[str, Any], req: SimRequest) -> str:
        """A whole answer's text: a small instance of the request's JSON schema when it asks for one (whatever
        max_tokens says; the token counts stay the simulated ones), else the simulated tokens' text."""
        schema = requested_schema(body)
        if schema is not None:
            return orjson.dumps(schema_instance(schema)).decode()
        return "".join(self.text(t) for t in req.output_token_ids)

    def text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.bundle.decode([token_id])
        return text

    def encode_chat(self, body: Mapping[str, Any], *, default_add_generation_prompt: bool = True,
                    default_add_special_tokens: bool = False) -> list[int]:
        return self.encode_chat_media(body, default_add_generation_prompt=default_add_generation_prompt,
                                      default_add_special_tokens=default_add_special_tokens)[0]

    def encode_chat_media(self, body: Mapping[str, Any], *, default_add_generation_prompt: bool = True,
                          default_add_special_tokens: bool = False) -> tuple[list[int], tuple[MediaSpan, ...]]:
        """The chat's prompt ids and its media items' placeholder runs. A vLLM model with a processor rule takes
        images as base64 data URLs, rendered, expanded and identified as vLLM 0.32 does (cortex/media.py; its
        `--model` is the served name); anything else with media is refused (this simulator fetches nothing)."""
        rule = self.bundle.media_rule if self.flavour == "vllm" else None
        source = normalize_messages(body.get("messages"), media=rule is not None)
        refs = media_refs(source) if rule is not None else []
        fmt = self.bundle.content_format
        if fmt == "openai" or refs:
            placeholders = rule.placeholders if rule is not None and refs and fmt == "string" else None
            try:
                messages = template_messages(source, fmt, placeholders)
            except ConversationError as exc:
                raise ApiError(400, str(exc)) from None
        else:
            messages = chat_messages(source)[0]
        add_generation_prompt = bool(body.get("add_generation_prompt", default_add_generation_prompt))
        continue_final = bool(body.get("continue_final_message", False))
        if add_generation_prompt and continue_final:
            raise ApiError(400, "Cannot set both `continue_final_message` and "
                                "`add_generation_prompt` to True.")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ApiError(400, "chat_template_kwargs must be an object")
        messages, tools = for_template(messages, body.get("tools"), body.get("tool_choice"),
                                       self.bundle.chat_template or "",
                                       "sglang" if self.flavour == "sglang" else "vllm")
        kwargs = reasoning_kwargs(body.get("reasoning_effort"), kwargs) or None
        try:
            text = self.bundle.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final, chat_template_kwargs=kwargs)
        except TemplateError as exc:
            raise ApiError(400, str(exc)) from None
        ids = self.bundle.encode(text, add_special_tokens=bool(body.get("add_special_tokens",
                                                                        default_add_special_tokens)))
        if rule is None or not refs:
            return ids, ()
        found = media.expand(ids, refs, rule, self.model, "blake3",
                             kwargs=bool(body.get("mm_processor_kwargs") or body.get("media_io_kwargs")))
        if found.why_not:
            raise ApiError(400, f"the simulator cannot take this media item: {found.why_not}")
        return found.ids, tuple(found.spans)

    def completion_prompt(self, body: Mapping[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one is the same request
        if isinstance(prompt, str):
            return self.bundle.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)")

    def check_http_faults(self) -> None:
        if self.faults.get("reset_requests"):
            raise ResetRequest()
        if self.faults.get("overload_503"):
            raise self.overload_response()
        if self.faults.roll("http_5xx_rate"):
            raise ApiError(500, "simulated internal server error (fault injection)")

    async def health_delay(self) -> None:
        delay = self.faults.get("slow_health_ms")
        if delay > 0:
            await asyncio.sleep(delay / 1000.0)

    def validate_lengths(self, prompt: list[int], max_tokens: int) -> None:
        if not prompt:
            raise ApiError(400, "The prompt cannot be empty.")
        if len(prompt) + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                f"However, you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in "
                                f"the input, {max_tokens} in the output). Please reduce the length of the "
                                "input or output.")

    def new_request(self, rid: str, prompt: list[int], max_tokens: int, engine: EngineCore, prepared: Prepared,
                    *, cache_salt: str | None, lora: LoraRef | None, extra_key: str | None = None,
                    media: tuple[MediaSpan, ...] = ()) -> SimRequest:
        if engine.dead is not None:
            raise ApiError(503, f"The engine is not running: {engine.dead}")
        if self.max_queued_requests is not None and len(engine.waiting) >= self.max_queued_requests:
            raise self.overload_response()
        req = SimRequest(rid, prompt, prepared.max_tokens or max_tokens, cache_salt=cache_salt, lora=lora,
                         extra_key=extra_key, media=media,
                         block_hashes=engine.cache.prompt_hashes(prompt, cache_salt=cache_salt, lora=lora,
                                                                 media=media),
                         num_external_tokens=prepared.num_external_tokens, hold_blocks=prepared.hold_blocks)
        return req

    async def run(self, request: web.Request, body: Mapping[str, Any], req: SimRequest, engine: EngineCore,
                  prepared: Prepared, *, stream: bool, chat: bool) -> web.StreamResponse:
        delay = self.faults.get("slow_first_token_ms")
        if delay > 0:  # held before the engine sees it: no token, streamed or not, leaves earlier
            await asyncio.sleep(delay / 1000.0)
        engine.submit(req)
        try:
            if stream:
                return await self.stream(request, body, req, engine, prepared, chat=chat)
            return await self.complete(body, req, engine, prepared, chat=chat)
        finally:
            engine.abort(req)  # no-op once finished; frees the blocks if the client went away

    async def collect(self, req: SimRequest, engine: EngineCore, prepared: Prepared) -> str | None:
        finish: str | None = None
        async for delta in req.deltas():
            finish = delta.finish_reason
        await self.finished(req, prepared, engine)
        return finish

    async def batches(self, req: SimRequest) -> AsyncIterator[list[Delta]]:
        """Outputs in groups: whatever queued up while the previous write was in flight goes out at once."""
        while True:
            first = await req.outputs.get()
            group = [first, *req.drain()]
            for delta in group:
                if delta.error is not None:
                    raise EngineDeadError(delta.error)
            yield group
            if group[-1].finish_reason is not None:
                return

    async def after_first_token(self, request: web.Request) -> bool:
        """Stream faults, applied once the first token is on the wire; False = the connection was cut."""
        if self.faults.get("crash_mid_stream"):
            transport = request.transport
            if transport is not None:
                transport.abort()
            return False
        stall = self.faults.get("stall_stream_ms")
        if stall > 0:
            await asyncio.sleep(stall / 1000.0)
        return True

    def stream_response(self) -> web.StreamResponse:
        return web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})

    @staticmethod
    def request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def now() -> int:
        return int(time.time())

    # --- provided by a flavour ------------------------------------------------------------------

    @abstractmethod
    def routes(self) -> list[web.RouteDef]: ...

    @abstractmethod
    async def stream(self, request: web.Request, body: Mapping[str, Any], req: SimRequest, engine: EngineCore,
                     prepared: Prepared, *, chat: bool) -> web.StreamResponse: ...

    @abstractmethod
    async def complete(self, body: Mapping[str, Any], req: SimRequest, engine: EngineCore, prepared: Prepared,
                       *, chat: bool) -> web.Response: ...
