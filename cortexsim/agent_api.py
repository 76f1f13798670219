"""The simulated engines' agent and pooling APIs: /v1/responses, /v1/messages, /v1/embeddings, /v1/rerank, /v1/score.

The prompt is what the real engine renders (cortex/conversation/ holds vLLM 0.32's rules, proven against a real
vLLM by tests/real_engine/test_render_parity.py); the answers have vLLM 0.32's shapes, as captured from the real
engine: a Responses object (streamed as `event: response.*` server-sent events ending in `response.completed`
with the usage), an Anthropic message (streamed as message_start ... message_stop, the usage in message_delta,
cache reads apart from input_tokens as vLLM's _build_anthropic_usage counts them), and the pooling APIs' lists
with `usage.prompt_tokens`. Responses are stored (as vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1): a request
naming a `previous_response_id` this worker does not hold gets vLLM's 404, one it holds continues that
conversation. A response's id is the request's `request_id` when it sets one, as in vLLM.

Pooling requests do not run on the simulated engine (a generation model): they answer at once with a
deterministic vector per input and the real prompt token count.
"""

from __future__ import annotations

import collections
import math
import uuid
from collections.abc import Mapping
from typing import Any

import orjson
import xxhash
from aiohttp import web

from cortex.conversation import Conversation, ConversationError
from cortex.conversation.anthropic_api import anthropic_messages, anthropic_tools
from cortex.conversation.chat import chat_messages
from cortex.conversation.responses_api import responses_continues, responses_messages, responses_tools
from cortex.conversation.template_args import for_template, reasoning_kwargs
from cortex.model_bundle import TemplateError
from cortexsim.engine import EngineCore, EngineDeadError, SimRequest
from cortexsim.openai_api import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    OpenAIServing,
    Prepared,
    int_field,
    json_response,
    read_json,
)

STORED_RESPONSES = 10_000
"""The most responses one simulated worker keeps (oldest dropped first)."""
EMBEDDING_DIM = 8


def event(kind: str, doc: Mapping[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + orjson.dumps(doc) + b"\n\n"


class AgentApis:
    """The agent and pooling APIs of one simulated worker, over its flavour's OpenAIServing (engines, tokenizer,
    faults, streaming)."""

    def __init__(self, api: OpenAIServing) -> None:
        self.api = api
        self.stored: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()
        """Response id -> the conversation it ended (without system messages, its answer last)."""
        self.objects: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        """Response id -> the Responses object answered, for GET /v1/responses/{id}."""

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/responses", self.responses), web.get("/v1/responses/{id}", self.retrieve),
                web.post("/v1/responses/{id}/cancel", self.cancel), web.post("/v1/messages", self.messages),
                web.post("/v1/messages/count_tokens", self.count_tokens), web.post("/v1/embeddings", self.embeddings),
                web.post("/v1/rerank", self.rerank), web.post("/v1/score", self.score)]

    # --- shared --------------------------------------------------------------------------------------

    def _encode(self, conv: Conversation) -> list[int]:
        api = self.api
        messages, _ = chat_messages(conv.messages)
        template = api.bundle.chat_template or ""
        messages, tools = for_template(messages, conv.tools, conv.tool_choice, template,
                                       "sglang" if api.flavour == "sglang" else "vllm")
        try:
            text = api.bundle.render_chat(messages, tools=tools, add_generation_prompt=conv.add_generation_prompt,
                                          continue_final_message=conv.continue_final_message,
                                          chat_template_kwargs=conv.chat_template_kwargs)
        except TemplateError as exc:
            raise ApiError(400, str(exc)) from None
        return api.bundle.encode(text, add_special_tokens=False)

    async def _run(self, request: web.Request, body: Mapping[str, Any], rid: str, prompt: list[int],
                   max_tokens: int) -> tuple[SimRequest, EngineCore]:
        api = self.api
        api.check_http_faults()
        api.validate_lengths(prompt, max_tokens)
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ApiError(400, "cache_salt must be a string")
        engine = api.pick_engine(request, body)
        req = api.new_request(rid, prompt, max_tokens, engine, Prepared(), cache_salt=salt or None,
                              lora=api.resolve_lora(body))
        engine.submit(req)
        return req, engine

    def _text(self, req: SimRequest) -> str:
        return "".join(self.api.text(t) for t in req.output_token_ids)

    # --- the Responses API ---------------------------------------------------------------------------

    def _responses_conversation(self, body: Mapping[str, Any]) -> tuple[Conversation, list[Any]]:
        items = body.get("input")
        if not isinstance(items, str | list):
            raise ApiError(400, "input must be a string or a list of items")
        try:
            new = responses_messages(None, items)
        except ConversationError as exc:
            raise ApiError(400, str(exc)) from None
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if previous not in self.stored:
                raise ApiError(404, f"Response with id '{previous}' not found.")
            history = list(self.stored[previous])
        instructions = body.get("instructions")
        head = [{"role": "system", "content": instructions}] if instructions else []
        continues = responses_continues(items)
        effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
        conv = Conversation(
            [*head, *history, *new], tools=responses_tools(body.get("tools")),
            tool_choice=body.get("tool_choice"), add_generation_prompt=not continues, continue_final_message=continues,
            chat_template_kwargs=reasoning_kwargs(effort, body.get("chat_template_kwargs")))
        return conv, [*history, *new]

    async def responses(self, request: web.Request) -> web.StreamResponse:
        api = self.api
        body = await read_json(request)
        api.check_model(body)
        conv, kept = self._responses_conversation(body)
        prompt = self._encode(conv)
        max_tokens = int_field(body, "max_output_tokens", None, 1) or DEFAULT_MAX_TOKENS
        given = body.get("request_id")
        rid = given if isinstance(given, str) and given else f"resp_{uuid.uuid4().hex[:16]}"
        req, engine = await self._run(request, body, rid, prompt, max_tokens)
        msg_id = f"msg_{uuid.uuid4().hex[:16]}"
        try:
            if body.get("stream"):
                return await self._stream_response(request, body, req, engine, msg_id, kept)
            finish = await api.collect(req, engine, Prepared())
            doc = self._response(body, req, msg_id, finish, "completed", self._text(req))
            self._store(body, rid, kept, self._text(req), doc)
            return json_response(doc)
        finally:
            engine.abort(req)

    def _store(self, body: Mapping[str, Any], rid: str, kept: list[dict[str, Any]], text: str,
               doc: dict[str, Any]) -> None:
        if body.get("store") is False:
            return
        self.stored[rid] = [m for m in kept if m.get("role") != "system"] + [{"role": "assistant", "content": text}]
        self.objects[rid] = doc
        while len(self.stored) > STORED_RESPONSES:
            self.stored.popitem(last=False)
            self.objects.popitem(last=False)

    def _stored_object(self, request: web.Request) -> dict[str, Any]:
        rid = request.match_info["id"]
        doc = self.objects.get(rid)
        if doc is None:  # vLLM's _make_not_found_error
            raise ApiError(404, f"Response with id '{rid}' not found.")
        return doc

    async def retrieve(self, request: web.Request) -> web.Response:
        """vLLM's GET /v1/responses/{id}: a stored response, from this API server's memory only."""
        return json_response(self._stored_object(request))

    async def cancel(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/responses/{id}/cancel: the simulator answers synchronously only, so a stored response is
        finished and vLLM refuses it so."""
        self._stored_object(request)
        raise ApiError(400, "Cannot cancel a synchronous response.")

    @staticmethod
    def _usage(req: SimRequest) -> dict[str, Any]:
        n_in, n_out = len(req.prompt_token_ids), len(req.output_token_ids)
        return {"input_tokens": n_in,
                "input_tokens_details": {"cached_tokens": req.num_cached_tokens, "cache_write_tokens": 0,
                                         "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                          "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                "total_tokens": n_in + n_out}

    def _response(self, body: Mapping[str, Any], req: SimRequest, msg_id: str, finish: str | None, status: str,
                  text: str | None) -> dict[str, Any]:
        done = status != "in_progress"
        incomplete = done and finish == "length"
        output: list[dict[str, Any]] = [] if text is None else [{
            "id": msg_id, "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
            "role": "assistant", "status": "completed", "type": "message", "phase": None}]
        return {"id": req.request_id, "created_at": self.api.now(),
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": body.get("instructions"), "metadata": body.get("metadata"),
                "model": body.get("model") or self.api.model, "object": "response", "output": output,
                "parallel_tool_calls": True, "temperature": 1.0, "tool_choice": "auto" if body.get("tools") else "none",
                "tools": body.get("tools") or [], "top_p": 1.0, "background": False,
                "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": None,
                "previous_response_id": body.get("previous_response_id"), "prompt": None, "reasoning": None,
                "service_tier": "auto", "status": ("incomplete" if incomplete else "completed") if done else status,
                "text": None, "top_logprobs": None, "truncation": "disabled",
                "usage": self._usage(req) if done else None, "user": None}

    async def _stream_response(self, request: web.Request, body: Mapping[str, Any], req: SimRequest,
                               engine: EngineCore, msg_id: str, kept: list[dict[str, Any]]) -> web.StreamResponse:
        api = self.api
        resp = api.stream_response()
        await resp.prepare(request)
        seq = 0

        async def send(kind: str, doc: dict[str, Any]) -> None:
            nonlocal seq
            await resp.write(event(kind, {**doc, "sequence_number": seq, "type": kind}))
            seq += 1

        try:
            head = self._response(body, req, msg_id, None, "in_progress", None)
            await send("response.created", {"response": head})
            await send("response.in_progress", {"response": head})
            text, finish, first = "", None, True
            async for group in api.batches(req):
                for delta in group:
                    if first:
                        await send("response.output_item.added", {"item": {
                            "id": msg_id, "content": [], "role": "assistant", "status": "in_progress",
                            "type": "message", "phase": None}, "output_index": 0})
                        await send("response.content_part.added", {
                            "content_index": 0, "item_id": msg_id, "output_index": 0,
                            "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}})
                    piece = api.text(delta.token_id) if delta.token_id is not None else ""
                    text += piece
                    finish = delta.finish_reason or finish
                    await send("response.output_text.delta", {"content_index": 0, "delta": piece, "item_id": msg_id,
                                                              "logprobs": [], "output_index": 0})
                    if first:
                        first = False
                        if not await api.after_first_token(request):
                            return resp
            part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
            await send("response.output_text.done", {"content_index": 0, "item_id": msg_id, "logprobs": [],
                                                     "output_index": 0, "text": text})
            await send("response.content_part.done", {"content_index": 0, "item_id": msg_id, "output_index": 0,
                                                      "part": part})
            await send("response.output_item.done", {"item": {
                "id": msg_id, "content": [part], "role": "assistant", "status": "completed", "type": "message",
                "phase": None}, "output_index": 0})
            done = self._response(body, req, msg_id, finish, "completed", text)
            self._store(body, req.request_id, kept, text, done)
            await send("response.completed", {"response": done})
            await resp.write_eof()
        except EngineDeadError as exc:
            await resp.write(event("error", {"type": "error", "message": str(exc)}))
        except ConnectionError:
            pass
        return resp

    # --- the Anthropic Messages API ------------------------------------------------------------------

    def _anthropic_prompt(self, body: Mapping[str, Any]) -> list[int]:
        """The prompt vLLM renders from a Messages body (to_chat_completion_request, then the chat template)."""
        try:
            msgs = anthropic_messages(body.get("system"), body.get("messages"),
                                      merge_inline_system=self.api.bundle.rejects_inline_system)
            tools = anthropic_tools(body.get("tools"))
        except ConversationError as exc:
            raise ApiError(400, str(exc)) from None
        effort = (body.get("output_config") or {}).get("effort") if isinstance(body.get("output_config"),
                                                                               dict) else None
        return self._encode(Conversation(
            msgs, tools=tools, chat_template_kwargs=reasoning_kwargs(effort, body.get("chat_template_kwargs"))))

    async def count_tokens(self, request: web.Request) -> web.Response:
        """POST /v1/messages/count_tokens: the same render as /v1/messages, counted, nothing run. vLLM 0.32 answers
        with context_management too (anthropic/serving.py: count_tokens), SGLang 0.5.23 with input_tokens alone
        (anthropic/serving.py: handle_count_tokens)."""
        api = self.api
        body = await read_json(request)
        api.check_model(body)
        api.check_http_faults()
        if body.get("messages") is None:
            raise ApiError(400, "messages: Field required")
        n = len(self._anthropic_prompt(body))
        if api.flavour == "sglang":
            return json_response({"input_tokens": n})
        return json_response({"input_tokens": n, "context_management": {"original_input_tokens": n}})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        api = self.api
        body = await read_json(request)
        api.check_model(body)
        max_tokens = int_field(body, "max_tokens", None, 1)
        if max_tokens is None:
            raise ApiError(400, "max_tokens: Field required")
        prompt = self._anthropic_prompt(body)
        req, engine = await self._run(request, body, f"chatcmpl-{uuid.uuid4().hex[:16]}", prompt, max_tokens)
        try:
            if body.get("stream"):
                return await self._stream_message(request, body, req, engine)
            finish = await api.collect(req, engine, Prepared())
            return json_response({"id": req.request_id, "type": "message", "role": "assistant",
                                  "content": [{"type": "text", "text": self._text(req)}],
                                  "model": body.get("model") or api.model, "stop_reason": _stop_reason(finish),
                                  "usage": _anthropic_usage(req)})
        finally:
            engine.abort(req)

    async def _stream_message(self, request: web.Request, body: Mapping[str, Any], req: SimRequest,
                              engine: EngineCore) -> web.StreamResponse:
        api = self.api
        resp = api.stream_response()
        await resp.prepare(request)

        async def send(kind: str, doc: dict[str, Any]) -> None:
            await resp.write(event(kind, {"type": kind, **doc}))

        try:
            finish, first = None, True
            async for group in api.batches(req):
                for delta in group:
                    if first:
                        await send("message_start", {"message": {
                            "id": req.request_id, "type": "message", "role": "assistant", "content": [],
                            "model": body.get("model") or api.model, "stop_reason": None, "stop_sequence": None,
                            # vLLM's first chunk carries the whole prompt and no cache figures yet.
                            "usage": {"input_tokens": len(req.prompt_token_ids), "output_tokens": 0}}})
                        await send("content_block_start", {"content_block": {"type": "text", "text": ""},
                                                           "index": 0})
                    piece = api.text(delta.token_id) if delta.token_id is not None else ""
                    finish = delta.finish_reason or finish
                    await send("content_block_delta", {"delta": {"type": "text_delta", "text": piece}, "index": 0})
                    if first:
                        first = False
                        if not await api.after_first_token(request):
                            return resp
            await send("content_block_stop", {"index": 0})
            await send("message_delta", {"delta": {"stop_reason": _stop_reason(finish), "stop_sequence": None},
                                         "usage": _anthropic_usage(req)})
            await send("message_stop", {})
            await resp.write_eof()
        except EngineDeadError as exc:
            await resp.write(event("error", {"type": "error", "error": {"type": "api_error", "message": str(exc)}}))
        except ConnectionError:
            pass
        return resp

    # --- pooling -------------------------------------------------------------------------------------

    def _count(self, value: Any) -> int:
        """Prompt tokens of a pooling input: texts encoded (with special tokens), token ids counted."""
        if isinstance(value, str):
            return len(self.api.bundle.encode(value, add_special_tokens=True))
        if isinstance(value, list):
            if value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                return len(value)
            return sum(self._count(v) for v in value)
        if isinstance(value, dict):
            return self._count(value.get("text") or value.get("content") or "")
        return 0

    @staticmethod
    def _vector(seed: str) -> list[float]:
        h = xxhash.xxh3_64_intdigest(seed.encode("utf-8", "surrogatepass"))
        raw = [((h >> (8 * i)) & 0xFF) / 255.0 - 0.5 for i in range(EMBEDDING_DIM)]
        norm = math.sqrt(sum(x * x for x in raw)) or 1.0
        return [x / norm for x in raw]

    def _pooling_body(self, body: Mapping[str, Any], *fields: str) -> int:
        self.api.check_model(body)
        self.api.check_http_faults()
        if any(body.get(f) is None for f in fields):
            raise ApiError(400, f"{' and '.join(fields)} required")
        return sum(self._count(body[f]) for f in fields)

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        tokens = self._pooling_body(body, "input")
        inputs = body["input"] if isinstance(body["input"], list) and body["input"] and \
            not isinstance(body["input"][0], int) else [body["input"]]
        data = [{"index": i, "object": "embedding", "embedding": self._vector(repr(x))} for i, x in enumerate(inputs)]
        return json_response({"id": f"embd-{uuid.uuid4().hex[:16]}", "object": "list", "created": self.api.now(),
                              "model": body.get("model") or self.api.model, "data": data,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                        "prompt_tokens_details": None}})

    async def rerank(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        tokens = self._pooling_body(body, "query", "documents")
        docs = body["documents"] if isinstance(body["documents"], list) else [body["documents"]]
        scored = sorted(((self._vector(repr((body["query"], d)))[0], i) for i, d in enumerate(docs)), reverse=True)
        top = int(body.get("top_n") or 0) or len(scored)
        results = [{"index": i, "document": {"text": docs[i] if isinstance(docs[i], str) else None,
                                             "multi_modal": None}, "relevance_score": score}
                   for score, i in scored[:top]]
        return json_response({"id": f"rerank-{uuid.uuid4().hex[:16]}", "model": body.get("model") or self.api.model,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results})

    async def score(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        pair = next((p for p in (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                                 ("query", "items")) if all(body.get(k) is not None for k in p)), ("text_1", "text_2"))
        tokens = self._pooling_body(body, *pair)
        right = body[pair[1]] if isinstance(body[pair[1]], list) else [body[pair[1]]]
        data = [{"index": i, "object": "score", "score": self._vector(repr((body[pair[0]], r)))[0]}
                for i, r in enumerate(right)]
        return json_response({"id": f"score-{uuid.uuid4().hex[:16]}", "object": "list", "created": self.api.now(),
                              "model": body.get("model") or self.api.model, "data": data,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                        "prompt_tokens_details": None}})


def _stop_reason(finish: str | None) -> str:
    return "max_tokens" if finish == "length" else "end_turn"


def _anthropic_usage(req: SimRequest) -> dict[str, Any]:
    """vLLM's _build_anthropic_usage: input_tokens excludes the cache reads (and writes, 0 here)."""
    cached = req.num_cached_tokens
    return {"input_tokens": max(0, len(req.prompt_token_ids) - cached), "output_tokens": len(req.output_token_ids),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
