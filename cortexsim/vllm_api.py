"""The vLLM 0.33 OpenAI server's HTTP surface over simulated engines (``vllm serve`` with
``--enable-prompt-tokens-details``, ``VLLM_SERVER_DEV_MODE=1`` and, for PD, a NIXL ``kv_both`` connector).

Routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /ping, /version, /tokenize, /detokenize,
/metrics, /reset_prefix_cache. Data parallel: the ``X-data-parallel-rank`` header picks a rank, else round
robin; /metrics labels every sample with ``engine="<rank>"``.

PD (NIXL pull, engines.md §2.2): a request whose ``kv_transfer_params.do_remote_decode`` is true (role prefill
or both) finishes normally but keeps its blocks pinned for ``kv_lease_seconds`` and answers the
``kv_transfer_params`` a decoder needs, including ``remote_prefill_cached_tokens``. A request carrying
``do_remote_prefill`` with complete coordinates (role decode or both) pulls from the named prefill worker
(``remote_host:remote_port``, here that worker's HTTP port and a simulator route standing in for the NIXL
side channel), skips prefill of the transferred prompt tokens and reports the prefill's cached tokens.
Incomplete params are ignored ("Got invalid KVTransferParams", full local prefill); a failed pull (unknown,
expired or unreachable) follows ``kv_load_failure_policy``: "recompute" does a full local prefill, "fail"
answers 500 like vLLM's default.
"""

from __future__ import annotations

import logging
import ssl
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cortex.engine_hashes import LoraRef
from cortex.media import MediaSpan
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

log = logging.getLogger("cortex.sim.vllm_api")  # its name in log lines, kept across the move

VLLM_VERSION = "0.33.0"
NIXL_CONNECTOR_VERSION = 15
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUIRED_REMOTE = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def report_mode(body: Mapping[str, Any]) -> Any:
    """`vllm_xargs.kv_cache_report_mode` (vLLM: sampling_params.extra_args, read by v1/request.py)."""
    xargs = body.get("vllm_xargs")
    if xargs is None:
        return "incremental"
    if not isinstance(xargs, dict):
        raise ApiError(400, "vllm_xargs must be an object")
    return xargs.get("kv_cache_report_mode", "incremental")


def validate_cache_salt(salt: Any) -> str | None:
    # vLLM's validate_cache_salt (entrypoints/generate/base/protocol.py).
    if salt is None:
        return None
    if (not isinstance(salt, str) or not salt or len(salt) > 128
            or any(ch in salt for ch in ("@", "/", "\\", "\x00"))):
        raise ApiError(400, "cache_salt must be a non-empty string of at most 128 characters "
                            "without '@', '/', '\\' or NUL")
    return salt


class _EngineCollector(Collector):
    """vLLM's load metrics, read from every rank at scrape time (labels model_name, engine=<rank>)."""

    def __init__(self, engines: list[EngineCore], model: str) -> None:
        self.engines = engines
        self.model = model

    def collect(self) -> Iterable[Any]:
        labels = ["model_name", "engine"]

        def family(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str,
                   value: Any) -> Any:
            fam = kind(name, doc, labels=labels)
            for e in self.engines:
                fam.add_metric([self.model, str(e.rank)], value(e))
            return fam

        G, C = GaugeMetricFamily, CounterMetricFamily
        yield family(G, "vllm:num_requests_running", "Number of requests in model execution batches.",
                     lambda e: len(e.running))
        yield family(G, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                     lambda e: len(e.waiting))
        yield family(G, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                     lambda e: e.cache.usage)
        yield family(C, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                     lambda e: e.cache.query_tokens)
        yield family(C, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                     lambda e: e.cache.hit_tokens)
        yield family(C, "vllm:prompt_tokens", "Number of prefill tokens processed.", lambda e: e.prompt_tokens)
        yield family(C, "vllm:generation_tokens", "Number of generation tokens processed.",
                     lambda e: e.generation_tokens)
        yield family(C, "vllm:nixl_num_kv_expired_reqs", "Requests whose KV the decoder never read in time.",
                     lambda e: e.stats.kv_expired)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*labels, "finished_reason"])
        for e in self.engines:
            for reason, n in sorted(e.finished.items()):
                success.add_metric([self.model, str(e.rank), reason], n)
        yield success


GPU_MEMORY_UTILIZATION = 0.92
"""vLLM's CacheConfig default (vllm/config/cache.py), reported as the simulated engines' setting."""


def cache_config_info(config: SimConfig, max_model_len: int) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` as vLLM writes them: ``CacheConfig.metrics_info()`` is
    ``{field: str(value)}`` over the CacheConfig (vllm/config/cache.py), in its field order; these are the fields
    the simulator has a value for (the Mamba, offloading and layout ones are left out). The logger adds
    ``engine`` per DP rank (vllm/v1/metrics/loggers.py, ``log_metrics_info``); there is no ``model_name``.

    ``num_gpu_blocks`` is the pool of one rank times the DP size: with DP the front end sums every engine's
    blocks into the one CacheConfig (v1/engine/core_client.py) that labels each rank's sample, whereas
    ``kv_cache_size_tokens`` and ``kv_cache_max_concurrency`` stay per engine (vllm/v1/core/kv_cache_utils.py
    ``get_kv_cache_capacity``: blocks / blocks of one max_model_len request, times max_model_len)."""
    blocks, block_size = config.effective_num_blocks, config.page_size
    concurrency = blocks / -(-max_model_len // block_size)
    return {
        "block_size": str(block_size),
        "gpu_memory_utilization": str(GPU_MEMORY_UTILIZATION),
        "cache_dtype": "auto",
        "is_attention_free": "False",
        # The simulator's pool is configured, not profiled: an explicit --num-blocks is vLLM's override.
        "num_gpu_blocks_override": str(config.num_blocks),
        "sliding_window": "None",
        "enable_prefix_caching": "True",
        "prefix_caching_hash_algo": config.hash_algo,
        "num_gpu_blocks": str(blocks * config.dp_size),
        "num_cpu_blocks": "0",  # the V1 engine core's fixed value: no CPU swap space
        "kv_cache_size_tokens": str(int(concurrency * max_model_len)),
        "kv_cache_max_concurrency": str(concurrency),
        "kv_cache_memory_bytes": "None",
    }


class _CacheConfigCollector(Collector):
    """``vllm:cache_config_info``: an info-style gauge of value 1 per DP rank, labelled with the cache config."""

    def __init__(self, labels: dict[str, str], ranks: int) -> None:
        self.labels = labels
        self.ranks = ranks

    def collect(self) -> Iterable[Any]:
        fam = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                labels=[*self.labels, "engine"])
        for rank in range(self.ranks):
            fam.add_metric([*self.labels.values(), str(rank)], 1)
        yield fam


class VllmApi(OpenAIServing):
    """The vLLM OpenAI server's routes, over one EngineCore per DP rank."""

    flavour = "vllm"

    def __init__(self, *, config: SimConfig, http_port: int, worker_id: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = config
        self.http_port = http_port
        self.worker_id = worker_id
        self.loras: dict[str, LoraRef] = {lora.name: lora for lora in config.lora_modules}
        self.agent_apis = AgentApis(self)
        # A fresh id per server start, suffixed per DP rank as vLLM does, so a decoder can name the rank.
        engine_uuid = str(uuid.uuid4())
        self._engine_ids = [engine_uuid + (f"_dp{r}" if len(self.engines) > 1 else "")
                            for r in range(len(self.engines))]
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(self.engines, self.model))
        self.registry.register(_CacheConfigCollector(cache_config_info(config, self.max_model_len),
                                                     len(self.engines)))
        ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         ["model_name", "engine"], buckets=TTFT_BUCKETS, registry=self.registry)
        for e in self.engines:
            e.on_first_token = ttft.labels(self.model, str(e.rank)).observe

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
            web.post("/sim/kv_transfer/read", self.kv_transfer_read),
            *self.agent_apis.routes(),
        ]

    # --- hooks ---------------------------------------------------------------------------------

    def requested_rank(self, request: web.Request, body: Mapping[str, Any]) -> int | None:
        raw = request.headers.get("X-data-parallel-rank")
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ApiError(400, f"X-data-parallel-rank must be an integer, got {raw!r}") from None

    def resolve_lora(self, body: Mapping[str, Any]) -> LoraRef | None:
        model = body.get("model")
        return self.loras.get(model) if isinstance(model, str) else None

    def check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "model: Input should be a valid string")  # vLLM's pydantic validation
        if model is not None and model != self.model and model not in self.loras:
            raise ApiError(404, f"The model `{model}` does not exist.")

    async def prepare(self, request: web.Request, body: Mapping[str, Any], prompt: list[int],
                      engine: EngineCore) -> Prepared:
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            return Prepared()
        role = self.config.role
        if params.get("do_remote_decode") and role in ("prefill", "both"):
            return Prepared(hold_blocks=True, extra={})
        if params.get("do_remote_prefill") and role in ("decode", "both"):
            if any(params.get(k) is None for k in _REQUIRED_REMOTE):
                log.warning("Got invalid KVTransferParams: %s; doing a full local prefill", params)
                return Prepared()
            transferred = await self._pull(params)
            if transferred is None:
                if self.config.kv_load_failure_policy == "fail":
                    raise ApiError(500, "Internal server error: failed to load KV from the remote prefill worker")
                return Prepared()
            cached = params.get("remote_prefill_cached_tokens")
            # At least one prompt token is computed locally to produce logits, as in vLLM.
            return Prepared(num_external_tokens=min(transferred, len(prompt) - 1),
                            reported_cached_tokens=cached if isinstance(cached, int) else None)
        return Prepared()

    async def _pull(self, params: Mapping[str, Any]) -> int | None:
        """Read the remote blocks: tell the prefill worker we took them, learn how many tokens they hold."""
        cfg = self.config
        # A worker serving TLS reaches its peer (the stand-in for NIXL runs on the HTTP port) over TLS too, with its
        # own certificate, trusting the CA its clients are checked against: one fleet, one CA.
        tls: ssl.SSLContext | None = None
        if cfg.ssl_certfile and cfg.ssl_keyfile:
            tls = ssl.create_default_context(cafile=cfg.ssl_ca_certs)
            tls.load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
        scheme = "https" if tls is not None else "http"
        url = f"{scheme}://{params['remote_host']}:{params['remote_port']}/sim/kv_transfer/read"
        payload = {k: params[k] for k in ("remote_request_id", "remote_engine_id", "remote_block_ids")}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http, \
                    http.post(url, json=payload, ssl=tls if tls is not None else True) as resp:
                if resp.status != 200:
                    log.warning("KV pull from %s refused (%s): %s", url, resp.status, await resp.text())
                    return None
                return int((await resp.json())["num_tokens"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            log.warning("KV pull from %s failed: %s", url, exc)
            return None

    async def finished(self, req: SimRequest, prepared: Prepared, engine: EngineCore) -> None:
        if not prepared.hold_blocks or req.request_id not in engine.held or prepared.extra is None:
            return
        prepared.extra["kv_transfer_params"] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [engine.cache.block_ids(req.request_id)],
            "remote_engine_id": self._engine_ids[engine.rank], "remote_request_id": req.request_id,
            "remote_host": self.config.host, "remote_port": self.http_port,
            "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": len(req.prompt_token_ids),
            "remote_blocks_expiry_time": None, "remote_registration_generation": 0, "transfer_mode": "pull",
            "remote_prefill_cached_tokens": req.num_cached_tokens,
        }

    async def kv_transfer_read(self, request: web.Request) -> web.Response:
        """Stand-in for the NIXL side channel: a decoder read the blocks, so they can be freed."""
        body = await read_json(request)
        if self.faults.get("pd_transfer_fail"):
            raise ApiError(500, "simulated KV transfer failure (fault injection)")
        try:
            rank = self._engine_ids.index(str(body.get("remote_engine_id")))
        except ValueError:
            raise ApiError(404, f"unknown remote_engine_id {body.get('remote_engine_id')!r}") from None
        engine = self.engines[rank]
        rid = body.get("remote_request_id")
        entry = engine.held.get(rid) if isinstance(rid, str) else None
        if entry is None or not isinstance(rid, str):
            raise ApiError(404, f"no KV held for request {rid!r} (never prefilled here, already read or expired)")
        if body.get("remote_block_ids") != [engine.cache.block_ids(rid)]:
            raise ApiError(400, "remote_block_ids do not match the blocks held for this request")
        req = engine.release_held(rid)
        assert req is not None
        return json_response({"num_tokens": len(req.prompt_token_ids)})

    # --- plain endpoints -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        await self.health_delay()
        dead = any(e.dead is not None for e in self.engines)
        return web.Response(status=503 if dead else 200)

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": VLLM_VERSION})

    def _card(self, model_id: str, root: str, parent: str | None) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": root, "parent": parent, "max_model_len": self.max_model_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}

    async def models(self, request: web.Request) -> web.Response:
        cards = [self._card(self.model, self.model, None)]
        cards += [self._card(lora.name, lora.path, self.model) for lora in self.loras.values()]
        return json_response({"object": "list", "data": cards})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.faults.get("load_endpoint_down"):
            return web.Response(status=503, text="metrics unavailable (injected fault)")
        resp = web.Response(body=generate_latest(self.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        # reset_running_requests / reset_external are not modelled: there is no preemption and no connector.
        results = [e.reset_prefix_cache() for e in self.engines]
        return json_response({"success": all(results)})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self.check_model(body)
        if "messages" in body:
            tokens = self.encode_chat(body)
        elif "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt must be a string")
            tokens = self.bundle.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        else:
            raise ApiError(400, "either prompt or messages is required")
        strs = ([self.bundle.tokenizer.id_to_token(t) for t in tokens]
                if body.get("return_token_strs") else None)
        return json_response({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                              "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        self.check_model(body)
        tokens = body.get("tokens")
        vocab = self.bundle.tokenizer.get_vocab_size(with_added_tokens=True)
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
            raise ApiError(400, "tokens must be a list of token ids in the vocabulary")
        return json_response({"prompt": self.bundle.tokenizer.decode(tokens, skip_special_tokens=False)})

    # --- generation ----------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        self.check_model(body)
        self.check_http_faults()
        prompt, items = self.encode_chat_media(body)
        return await self._generate(request, body, prompt, chat=True, media=items)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        self.check_model(body)
        self.check_http_faults()
        return await self._generate(request, body, self.completion_prompt(body), chat=False)

    async def _generate(self, request: web.Request, body: Mapping[str, Any], prompt: list[int], *,
                        chat: bool, media: tuple[MediaSpan, ...] = ()) -> web.StreamResponse:
        stream = bool(body.get("stream", False))
        stream_options = body.get("stream_options")
        if stream_options is not None and not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.")
        if stream_options is not None and not isinstance(stream_options, dict):
            raise ApiError(400, "stream_options must be an object")
        if int_field(body, "n", 1, 1) != 1:
            raise ApiError(400, "n > 1 is not supported by the simulator")
        max_tokens = int_field(body, "max_completion_tokens", None, 1) if chat else None
        if max_tokens is None:
            max_tokens = int_field(body, "max_tokens", None, 1) or DEFAULT_MAX_TOKENS
        cache_salt = validate_cache_salt(body.get("cache_salt"))
        report_hits = report_mode(body) == "full"
        self.validate_lengths(prompt, max_tokens)
        engine = self.pick_engine(request, body)
        prepared = await self.prepare(request, body, prompt, engine)
        req = self.new_request(self.request_id("chatcmpl" if chat else "cmpl"), prompt, max_tokens, engine,
                               prepared, cache_salt=cache_salt, lora=self.resolve_lora(body), media=media)
        req.report_hits = report_hits
        return await self.run(request, body, req, engine, prepared, stream=stream, chat=chat)

    def overload_response(self) -> ApiError:
        # vLLM's admission rejection (v1/engine/async_llm.py: check_admission).
        return ApiError(503, "The engine's waiting queue is full (max_num_queued_reqs); request rejected.")

    def _usage(self, req: SimRequest, prepared: Prepared) -> dict[str, Any]:
        n_out = len(req.output_token_ids)
        cached = req.num_cached_tokens if prepared.reported_cached_tokens is None else prepared.reported_cached_tokens
        return {"prompt_tokens": len(req.prompt_token_ids), "total_tokens": len(req.prompt_token_ids) + n_out,
                "completion_tokens": n_out, "prompt_tokens_details": {"cached_tokens": cached}}

    def _kv_params(self, prepared: Prepared) -> Any:
        return (prepared.extra or {}).get("kv_transfer_params")

    async def complete(self, body: Mapping[str, Any], req: SimRequest, engine: EngineCore, prepared: Prepared,
                       *, chat: bool) -> web.Response:
        finish = await self.collect(req, engine, prepared)
        text = self.answer_text(body, req)
        want_ids = bool(body.get("return_token_ids"))
        created = self.now()
        model = body.get("model") or self.model
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "tool_calls": [],
                            "reasoning_content": None},
                "logprobs": None, "finish_reason": finish, "stop_reason": None,
            }
            out: dict[str, Any] = {"id": req.request_id, "object": "chat.completion", "created": created,
                                   "model": model, "choices": [choice], "service_tier": None,
                                   "system_fingerprint": None, "usage": self._usage(req, prepared),
                                   "prompt_logprobs": None,
                                   "prompt_token_ids": req.prompt_token_ids if want_ids else None,
                                   "kv_transfer_params": self._kv_params(prepared)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None, "prompt_logprobs": None,
                      "prompt_token_ids": req.prompt_token_ids if want_ids else None}
            out = {"id": req.request_id, "object": "text_completion", "created": created, "model": model,
                   "choices": [choice], "service_tier": None, "system_fingerprint": None,
                   "usage": self._usage(req, prepared), "kv_transfer_params": self._kv_params(prepared)}
        if want_ids:
            choice["token_ids"] = req.output_token_ids
        return json_response(out)

    async def stream(self, request: web.Request, body: Mapping[str, Any], req: SimRequest, engine: EngineCore,
                     prepared: Prepared, *, chat: bool) -> web.StreamResponse:
        resp = self.stream_response()
        await resp.prepare(request)
        created = self.now()
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": req.request_id, "object": kind, "created": created, "model": body.get("model") or self.model}
        options = body.get("stream_options") or {}
        try:
            try:
                first = True
                async for group in self.batches(req):
                    out = bytearray()
                    for delta in group:
                        if chat and first:
                            # Like vLLM, the role chunk goes out with the first engine output, not before it,
                            # so time-to-first-byte still measures queueing and prefill.
                            role: dict[str, Any] = {**head, "choices": [{
                                "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]}
                            if body.get("return_token_ids"):
                                role["prompt_token_ids"] = req.prompt_token_ids
                            out += sse(role)
                        text = self.text(delta.token_id) if delta.token_id is not None else ""
                        if chat:
                            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                                      "finish_reason": delta.finish_reason}
                        else:
                            choice = {"index": 0, "text": text, "logprobs": None,
                                      "finish_reason": delta.finish_reason, "stop_reason": None}
                        chunk: dict[str, Any] = {**head, "choices": [choice]}
                        if delta.finish_reason is not None:
                            await self.finished(req, prepared, engine)
                            if self._kv_params(prepared) is not None:
                                chunk["kv_transfer_params"] = self._kv_params(prepared)
                        out += sse(chunk)
                        if first:
                            await resp.write(bytes(out))
                            out.clear()
                            first = False
                            if not await self.after_first_token(request):
                                return resp
                    if out:
                        await resp.write(bytes(out))
                if options.get("include_usage"):
                    await resp.write(sse({**head, "choices": [], "usage": self._usage(req, prepared)}))
            except EngineDeadError as exc:
                # Headers are gone already; vLLM reports a mid-stream failure as an error event.
                await resp.write(sse({"error": {"message": str(exc), "type": "InternalServerError",
                                                "param": None, "code": 500}}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            pass  # the client left; run()'s finally releases the request
        return resp
