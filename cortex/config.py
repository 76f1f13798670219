"""The one YAML file that configures Cortex, validated at the edge with errors that name field, value and reason."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cortex import engines
from cortex.api_paths import PUBLIC_PATHS
from cortex.engine_hashes import VllmHashAlgo
from cortex.model_bundle import shipped_tokenizer_dir

if TYPE_CHECKING:
    Engine = str
else:
    # Every adapter module in cortex/engines, so a new engine is accepted without touching this file.
    Engine = Literal[engines.ENGINE_NAMES]
Role = Literal["both", "prefill", "decode"]
Port = Annotated[int, Field(ge=1, le=65535)]


class ConfigError(ValueError):
    """Raised with a readable, multi-line explanation of what is wrong in cortex.yaml."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Listen(_Strict):
    """Where clients connect: Envoy's listener for the OpenAI API."""

    host: str = "127.0.0.1"
    """Bind address. Loopback by default; use 0.0.0.0 to serve other machines."""
    port: Port = 8080
    """Gateway port for the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, ...)."""
    paths: list[str] = Field(default_factory=lambda: list(PUBLIC_PATHS))
    """Paths forwarded to workers (exact, query strings aside); any other gets 404 from Envoy without reaching
    extproc or a worker, so the engines' admin endpoints stay out of clients' reach. /cortex/health and, when
    enabled, /cortex/v1/route are Cortex's own and always served."""

    @field_validator("paths")
    @classmethod
    def _paths(cls, value: list[str]) -> list[str]:
        for path in value:
            if not re.fullmatch(r"/[A-Za-z0-9._~/-]*", path):
                raise ValueError(f"{path!r}: an exact path such as /v1/chat/completions (letters, digits, . _ ~ / -)")
        return value


class AdminListen(_Strict):
    """Envoy's admin interface (stats, /clusters, /ready)."""

    host: str = "127.0.0.1"
    """Bind address of Envoy admin. Keep it private: admin can change Envoy's state."""
    port: Port = 9901
    """Envoy admin port."""


class IngestConfig(_Strict):
    """The ingest process: KV-event subscribers, the ledger, worker probes, and the admin/metrics port."""

    host: str = "127.0.0.1"
    """Bind address of ingest's HTTP port."""
    port: Port = 9090
    """Serves /health/live, /health/ready, /metrics, /cortex/workers and the status page /cortex/ui."""
    heartbeat_interval_s: float = Field(0.25, gt=0, le=5)
    """How often ingest stamps the shared ledger view while nothing changes (each change is published and stamped
    at once, at most every 0.1 s); extproc treats `extproc.view_stale_after_s` (1 s) of silence as ingest dead,
    so keep it well below that."""
    load_poll_interval_s: float = Field(0.1, gt=0, le=60)
    """How often an active worker's own load metrics are read (vLLM /metrics, SGLang /v1/loads): one that ran or
    queued requests at its last reading or published KV events in the last 2 x `idle_load_poll_interval_s`, while
    this replica sends it nothing (one it sends requests to is read every `routed_load_poll_interval_s`)."""
    idle_load_poll_interval_s: float = Field(1.0, gt=0, le=60)
    """How often an idle worker's load is read (docs/performance.md, "What an idle replica costs"). A KV event
    from it or a request routed to it switches it back to `load_poll_interval_s` at once; traffic that reaches
    it some other way without publishing events is seen within this interval. Extproc treats a reading as
    unknown once older than max(2 s, 2 x the interval in force). Must not be below `load_poll_interval_s`
    (when not set, a larger `load_poll_interval_s` is used for both)."""
    routed_load_poll_interval_s: float = Field(0.5, gt=0, le=60)
    """How often the load of an active worker that this replica itself sends requests to is read: one with requests
    of this replica in flight, or sent some within the last 30 s. Between two readings
    extproc adds the change in this replica's own in-flight count there to the reading, so its own traffic is seen
    at once; other replicas' and clients' traffic there is seen at most this late (docs/performance.md, "Gateway
    CPU against SMG at 4 replicas"). An active worker this replica does not send to is read every
    `load_poll_interval_s`. Between `load_poll_interval_s` and `idle_load_poll_interval_s` (when not set, clamped
    into that range)."""
    event_silence_s: float = Field(10.0, gt=0)
    """A worker busy with requests for this long without a single event batch is suspected of losing
    events: its ledger goes STALE and is re-checked through replay (idle workers publish nothing)."""
    health_interval_s: float = Field(5.0, gt=0)
    """Seconds between health probes of each worker (GET /health); Envoy's active checks use it too."""
    health_timeout_s: float = Field(3.0, gt=0)
    """A probe slower than this counts as a failure."""
    health_failures: int = Field(3, ge=1)
    """Consecutive failed probes (timeout, refused, non-200) before a worker is marked down, for ingest and Envoy's
    active checks alike (tolerant on purpose: a busy GPU answers late). Until then a worker whose latest probe
    failed stays routable but gets no first attempt while one in good standing exists (docs/architecture.md)."""
    token_parity: Literal["required", "best_effort", "off"] = "required"
    """Tokenizer parity self-test against each worker's tokenize endpoint. required: exact-KV routing only
    once the worker tokenized the probes exactly as Cortex does; best_effort: only a proven mismatch turns it
    off (for engines whose tokenize endpoint is disabled); off: not checked."""
    token_parity_interval_s: float = Field(300.0, gt=0)
    """How often a worker's tokenizer parity is checked again (a failed or unreachable check retries in 10 s)."""
    view_capacity: int = Field(1 << 16, ge=1024)
    """Initial slot count of the shared ledger table; it doubles on its own when half full."""
    max_workers: int = Field(64, ge=1, le=4096)
    """Most routing targets (workers x data-parallel ranks) the ledger view can hold (one bit each per block).
    A fleet of more targets is refused at start with this setting named: set it to the next multiple of 64 at or
    above the fleet (256 for 256 single-rank workers; each 64 adds 8 bytes per view slot and one word to every
    lookup's bitset rows; docs/performance.md, "Fleet scale"). The default stays 64 so small fleets do not pay
    for width they do not use."""
    admin_token_file: str | None = None
    """File holding the admin token (at least 16 characters): every admin route (worker changes, the status page,
    the observer's recent decisions) then needs `Authorization: Bearer <token>` (or Basic auth with the token as
    password, for a browser). Health probes and /metrics stay open. None: no token while the admin ports
    (`ingest.host`, `observe.host`) are on loopback; beyond it, one is generated at each start and required
    (shown on the starting terminal, kept in <runtime_dir>/admin-token, never logged; docs/security.md)."""

    @model_validator(mode="after")
    def _poll_intervals(self) -> IngestConfig:
        if "idle_load_poll_interval_s" not in self.model_fields_set:
            # A config that only slows the active cadence keeps idle workers at least as slow.
            object.__setattr__(self, "idle_load_poll_interval_s",
                               max(self.idle_load_poll_interval_s, self.load_poll_interval_s))
        elif self.idle_load_poll_interval_s < self.load_poll_interval_s:
            raise ValueError(f"idle_load_poll_interval_s ({self.idle_load_poll_interval_s}) must not be below "
                             f"load_poll_interval_s ({self.load_poll_interval_s})")
        fast, idle = self.load_poll_interval_s, self.idle_load_poll_interval_s
        if "routed_load_poll_interval_s" not in self.model_fields_set:
            object.__setattr__(self, "routed_load_poll_interval_s",
                               min(max(self.routed_load_poll_interval_s, fast), idle))
        elif not fast <= self.routed_load_poll_interval_s <= idle:
            raise ValueError(f"routed_load_poll_interval_s ({self.routed_load_poll_interval_s}) must lie between "
                             f"load_poll_interval_s ({fast}) and idle_load_poll_interval_s ({idle})")
        return self


class ExtprocTls(_Strict):
    """TLS on the ext_proc port. GIE's gateways connect to their endpoint picker over TLS, most without checking its
    certificate (GIE's own picker serves a self-signed one by default)."""

    cert_file: str | None = None
    """PEM certificate (chain) served. Unset with key_file: a self-signed certificate made at start, kept in
    runtime_dir/tls (names: localhost, the host name, 127.0.0.1)."""
    key_file: str | None = None
    """Its PEM private key; both or neither."""

    @model_validator(mode="after")
    def _pair(self) -> ExtprocTls:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("extproc.tls: cert_file and key_file go together (neither: a self-signed certificate)")
        return self


class ExtprocConfig(_Strict):
    """The ext_proc servers Envoy calls for every request."""

    processes: int | None = Field(None, ge=1, le=64)
    """ext_proc server processes, each its own endpoint in Envoy's ext_proc cluster (grpc.aio's per-stream cost
    is CPU-bound: scale by process, not thread). None: one per CPU core."""

    def process_count(self) -> int:
        return self.processes or max(1, os.cpu_count() or 1)

    host: str = "127.0.0.1"
    """Bind address of the gRPC servers (Envoy connects here)."""
    base_port: Port = 50051
    """Process i listens on base_port + i."""
    message_timeout_ms: int = Field(5000, ge=200)
    """Envoy's per-message ext_proc deadline. Envoy's default (200 ms) is too tight for Python under load;
    on expiry the request continues on Envoy's own balancing (failure_mode_allow)."""
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest request body accepted (Envoy buffers it for routing); larger gets 413."""
    max_tokenize_chars: int = Field(1 << 20, ge=4096)
    """Prompt text past this many characters is not tokenized for routing (it is far beyond any context
    window; the engine will judge the request). Bounds extproc's work per request."""
    route_explain: bool = True
    """Serve POST /cortex/v1/route (the routing decision as JSON, nothing forwarded) on ingest's admin port, behind
    the admin token (decided by extproc process 0, through a socket in runtime_dir). A `x-cortex-tenant` header
    shows that tenant's view (its cache salt)."""
    public_route_explain: bool = False
    """Also serve it on the public listener, to tenants marked trusted (every caller when no tenants are
    configured). Off by default: a decision shows which prompts the workers hold (docs/security.md)."""
    prediction_ttl_s: float = Field(2.0, ge=0)
    """How long the blocks of a just-routed prompt count as held by its worker when choosing (never as a
    claimed hit), until the worker's own events confirm them; 0 turns predictions off."""
    view_stale_after_s: float = Field(1.0, gt=0)
    """Ledger heartbeat age after which extproc stops trusting it and routes by load."""
    tls: ExtprocTls | None = None
    """`cortex epp` only: serve ext_proc over TLS (`tls: {}` for a self-signed certificate). None: plaintext h2c, as
    Cortex's own Envoy on the same host uses it. Local health checks then go over a Unix socket in runtime_dir."""
    routing_headers: bool = True
    """Send Cortex's x-cortex-* routing headers (worker, proven hit, mode, reason) to callers allowed to see them
    (trusted tenants; everyone when no tenants are configured). Off: no caller gets them, and those a worker sent
    are removed. A proven hit tells a caller that someone sent that prefix before (docs/security.md)."""


class BreakerConfig(_Strict):
    """The circuit breaker each extproc process keeps per worker (docs/reliability.md, "A worker that answers
    5xx"): a worker whose answers fail while its health probe passes is taken out of first choice. SMG's defaults:
    10 failures, 60 s open, 3 successes to close."""

    enabled: bool = True
    failure_threshold: int = Field(10, ge=1, le=1000)
    """Consecutive failed answers (a 5xx, or Envoy retrying past the worker: reset, refused, 5xx) that open it."""
    open_s: float = Field(60.0, gt=0, le=3600)
    """How long an open worker gets no first attempt before trial requests may go to it (half-open)."""
    half_open_trials: int = Field(3, ge=1, le=100)
    """Trial requests a half-open worker may have in flight at once as first choice; the rest go elsewhere."""
    success_threshold: int = Field(3, ge=1, le=100)
    """Successful answers in a row, while half-open, that close it again (any failure opens it again)."""


class PeersConfig(_Strict):
    """Other gateway replicas over the same fleet, and how this one tells them its work (docs/replicas.md).
    Off unless `host` is set. Each replica's ingest publishes, every `interval_s`, the prefill work and requests
    its own extproc processes have in flight per worker, and reads what its peers publish: the time model then
    prices the whole fleet's queue on each worker, not only this replica's share of it."""

    host: str | None = None
    """Bind address of this replica's publisher (a ZeroMQ PUB socket); None: no peering. Peers need to reach it,
    the public never: keep it off the public listener's network (the Kubernetes NetworkPolicy admits only the
    gateway's own pods)."""
    port: Port = 5600
    connect: list[str] = Field(default_factory=list)
    """The other replicas' publishers, as host:port. A name is resolved again every `resolve_interval_s` and every
    address it has is subscribed to (a headless Service's name gives every gateway pod; this replica's own
    reports are recognised by their id and ignored)."""
    replica_id: str | None = None
    """This replica's id in its reports (default: the host name and the port)."""
    interval_s: float = Field(0.02, gt=0, le=1)
    """How often this replica's work is published when it changed (at least every `heartbeat_s` when not)."""
    heartbeat_s: float = Field(0.5, gt=0, le=10)
    stale_after_s: float = Field(2.0, gt=0)
    """A peer silent this long is taken as gone: what it said is dropped."""
    max_peers: int = Field(16, ge=1, le=256)
    """Peers this replica keeps (one board row each); reports of more are ignored."""
    resolve_interval_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _stale(self) -> PeersConfig:
        if self.stale_after_s <= self.heartbeat_s:
            raise ValueError(f"peers.stale_after_s ({self.stale_after_s}) must exceed peers.heartbeat_s "
                             f"({self.heartbeat_s}), or a quiet peer is dropped between its heartbeats")
        return self

    @property
    def enabled(self) -> bool:
        return self.host is not None


class ObserveConfig(_Strict):
    """`cortex observe`: Envoy's access log of every request becomes per-request metrics (TTFT, inter-token time,
    tokens, the engine's own cached_tokens against Cortex's claim), the request log and the status page's recent
    decisions (docs/observability.md)."""

    enabled: bool = True
    """Run the observer and Envoy's response observation (a Lua filter and a gRPC access log). Off: none of the
    per-request series, no request log, and streams are never asked for usage."""
    host: str = "127.0.0.1"
    """Bind address of both observer ports (Envoy connects to the first; keep it private)."""
    port: Port = 9092
    """gRPC access-log service Envoy streams every finished request to."""
    http_port: Port = 9093
    """/cortex/decisions and /cortex/hit-ratio (JSON for the status page)."""
    stream_usage: bool = True
    """Ask the engine for a streamed request's usage (`stream_options.include_usage`) when the client did not,
    and cut that usage event out of the stream again: every request's tokens and cached_tokens are then known.
    Off: a stream whose client did not ask has no usage (its tokens and hits are not counted)."""
    request_log: bool = True
    """Write one JSON line per request (never the prompt) to the observer's output."""
    request_log_path: str | None = None
    """File the request log is appended to (None: the observer's standard output, i.e. the gateway's log)."""
    envoy_access_log_path: str | None = None
    """Also have Envoy write its access log here, one JSON line per request with the request log's keys (those
    Envoy knows), joinable on request_id; `/dev/stdout` for the gateway's output. None: no Envoy access log."""
    request_log_sample: float = Field(1.0, ge=0, le=1)
    """Share of requests whose line is written, chosen by request id (the same request in Envoy's log and
    Cortex's is either both or neither). Metrics always count every request."""


class SchedulerConfig(_Strict):
    """How a worker is chosen (docs/scheduling.md). `rule: ttft` (the default) predicts each candidate's time to
    first token from the work queued there and the tokens it would still compute, and picks the smallest;
    `rule: cache_aware` is the older score, alpha * matched_tokens - beta * active - gamma * queue_latency.
    Both keep the guards against piling onto one GPU."""

    rule: Literal["ttft", "cache_aware"] = "ttft"
    """`ttft`: the time model (extproc/policies/ttft.py). `cache_aware`: the request-counting score
    (extproc/policies/cache_aware.py), kept for comparison."""
    alpha_ms_per_token: float = Field(0.045, ge=0)
    """Prefill time per uncached prompt token, the linear (weight-bound) part: 0.045 ms is ~22K tokens/s, an 8B
    model in bf16 on one H100 (2 x 8e9 FLOP per token at 36 % of 989 TFLOPS; docs/simulator.md's sources).
    Raise it for bigger models, whose prefill is slower per token. The time model starts from it and learns each
    worker's own rate from observed TTFTs (`calibrate`)."""
    attention_ms_per_token2: float = Field(1.06e-6, ge=0)
    """The attention part of prefill, which grows with context: computing u tokens after c cached ones costs
    this x u x (c + u / 2) ms. 1.06e-6 is an 8B GQA model on one H100 (4 x 32 layers x 4096 FLOP per query-key
    pair at 50 %): attention outweighs the linear part from ~85K-token prompts on."""
    step_ms: float = Field(6.2, ge=0)
    """The fixed cost of one engine step (reading the 16 GB of weights once at 77 % of 3.35 TB/s), paid once per
    chunk of `step_tokens`."""
    step_tokens: int = Field(8192, ge=1)
    """Prompt tokens one engine step computes at most (vLLM max_num_batched_tokens, SGLang chunked_prefill_size):
    a longer prompt is prefilled over several steps."""
    running_ms_per_request: float = Field(0.1, ge=0)
    """What each running request adds to every step a prefill shares with it (decode interference: its decode
    token and the read of its KV, ~0.05 ms per 1K tokens of context)."""
    work_weight: float = Field(0.25, ge=0)
    """The time model's price of fleet capacity: a candidate's score is its predicted TTFT plus this share of the
    prefill work it would spend, so between equal TTFTs the worker that recomputes less wins (a burst stays
    together, a cold copy elsewhere is not started for nothing)."""
    eviction_weight: float = Field(1.0, ge=0)
    """The time model's price of what a request evicts: on a worker whose pool is evicting, the new blocks a
    request brings evict as many tokens there, and the share of them that will be needed again (the worker's
    regretted over evicted tokens, ingest/regret.py) will be prefilled again. The score adds this weight times
    that share of the request's own prefill there. 0: evictions are free."""
    high_queue_ms: float = Field(8000.0, gt=0)
    """Predicted prefill queue (ms) at which a worker stops receiving cache-affinity traffic under `rule: ttft`:
    the watermark in work, beside the request-count one."""
    low_queue_ms: float = Field(4000.0, ge=0)
    """It receives affinity traffic again once its queue is back at or under this (hysteresis)."""
    claim_max_kv_usage: float = Field(0.9, gt=0, le=1)
    """A proven hit on a worker whose pool is at least this full (held by running requests, as the engine
    reports it) is not claimed: other requests' allocations can evict it before the engine schedules this one
    (docs/reliability.md, "Claims under cache pressure"). It still decides where the request goes. 1: always
    claim."""
    claim_horizon_share: float = Field(0.5, gt=0, le=1)
    """On a worker whose engine is evicting, a proven hit is claimed only while the tokens evicted there since
    this replica last sent the prefix, plus those expected until the engine admits the request, stay under this
    share of the pool's free part: when the prefix was freed that free part stood in front of it in the engine's
    LRU (docs/scheduling.md, "Claims that hold at scheduling time"). The free part then is taken as the free part
    now, which bursts of admissions make uncertain. 1: up to the whole free part."""
    claim_unknown_age_s: float = Field(30.0, ge=0)
    """For the rule above, a matched prefix this replica has not sent to the worker itself (another replica's or
    client's traffic put it there) is taken as this old, its evictions at the worker's recent rate."""
    calibrate: bool = True
    """Scale each worker's predictions by what its observed TTFTs say (`cortex observe` learns the ratio of
    observed to predicted per worker): a slow worker learns its own rate."""
    beta_ms_per_active: float = Field(5.0, ge=0)
    """`rule: cache_aware`: what one more running request on a worker costs a newcomer (batch contention in decode
    and chunked prefill)."""
    gamma: float = Field(1.0, ge=0)
    """`rule: cache_aware`: weight of the queueing delay (waiting requests x queued_request_ms)."""
    queued_request_ms: float = Field(100.0, ge=0)
    """How long one queued request holds the line (about one average prefill). Under `rule: ttft` only until the
    first request was routed: from then on the typical prefill of the requests routed stands in."""
    high_watermark: float = Field(48.0, gt=0)
    """Active requests (running + waiting, or Cortex's in-flight count if larger) at which a worker stops
    receiving cache-affinity traffic."""
    low_watermark: float = Field(32.0, ge=0)
    """It receives affinity traffic again once back at or under this (hysteresis)."""
    near_min_window: float = Field(2.0, ge=0)
    """A cache holder within this many active requests of the least-loaded worker is preferred outright."""
    cold_start_s: float = Field(300.0, ge=0)
    """A worker added less than this long ago counts as new (its cache starts empty)."""
    cold_start_share: float = Field(0.1, ge=0, le=1)
    """Share of the requests that no worker can serve from cache that go to a new worker, so it warms up."""
    replicas: int = Field(1, ge=1)
    """Gateway replicas routing over this fleet independently (each with its own view of its own traffic): set it
    to their count. With more than one, replicas deciding at the same instant see the same engines and would all
    pick the same fastest worker; each prompt then goes, among the `replicas` fastest candidates whose score is
    within `replica_band` typical prefills of the best, to its home (the rendezvous hash below), so different
    prompts spread while identical ones still meet (docs/scheduling.md, "Several replicas")."""
    replica_band: float = Field(1.0, ge=0)
    """With `replicas` > 1: how far behind the best a candidate may score, in typical prefills of the requests
    routed (what one collision with another replica's pick costs), and still take a prompt whose home it is.
    0: always the best, as with one replica."""
    prompt_home: bool = True
    """A prompt no worker holds goes, among the least loaded workers, to its home (a hash of its first block past
    the longest prefix any worker holds, the same on every replica), so replicas agree and repeats land together
    before any event arrives, while prompts that share only a system prompt spread. Off: a random least-loaded
    worker (pure load balancing for prompts nobody holds)."""
    tier_weights: dict[Literal["CPU", "STORAGE"], Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=lambda: {"CPU": 0.75, "STORAGE": 0.25})  # type: ignore[arg-type]
    """What a block a worker holds on a lower tier (its engine offloaded it: vLLM's OffloadingConnector, LMCache,
    SGLang HiCache) is worth in the score, against 1 for a block on its GPU: such a block is loaded instead of
    computed, which saves most of its prefill but not the transfer. Dynamo's defaults (CPU 0.75, disk 0.25;
    llm-d weighs CPU 0.8 and has no disk weight); docs/ledger.md, "Tiers". A tier left out counts 0. A
    lower-tier hit is claimed only where the engine reports it in cached_tokens (vLLM does)."""

    @model_validator(mode="after")
    def _watermarks(self) -> SchedulerConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(f"low_watermark ({self.low_watermark}) must be below high_watermark "
                             f"({self.high_watermark})")
        if self.low_queue_ms >= self.high_queue_ms:
            raise ValueError(f"low_queue_ms ({self.low_queue_ms}) must be below high_queue_ms "
                             f"({self.high_queue_ms})")
        return self


class PdConfig(_Strict):
    """Prefill/decode disaggregation for a model whose workers include `prefill` and `decode` roles (docs/pd.md)."""

    skip_prefill_uncached_tokens: int = Field(256, ge=0)
    """A KV handoff's cost in prompt tokens, for the skip rule: a request is served alone when that costs no more
    than the pair (docs/pd.md; with nothing cached, a prompt of at most this many tokens goes alone)."""
    skip_prefill_decode_hit_ratio: float = Field(0.8, ge=0, le=1)
    """Also skip the prefill leg when a decode-capable worker already holds at least this share of the prompt
    (vLLM decoders keep a prefix cache; SGLang decoders with --disaggregation-decode-enable-radix-cache)."""
    prefill_timeout_s: float = Field(60.0, gt=0)
    """vLLM: longest wait for the prefill leg's answer (it computes the whole prompt) before it counts as failed."""
    bootstrap_timeout_s: float = Field(30.0, gt=0)
    """SGLang: the pair's watchdog. A prefill leg not finished this long after dispatch (its decode never
    bootstrapped, or the transfer stalled) is cancelled together with its decode, instead of both waiting for
    the engines' own 300 s timeouts."""
    dispatch_timeout_s: float = Field(2.0, gt=0)
    """How long a prefill leg may take to be accepted by its worker (connection and request sent); slower
    counts as a failed dispatch and the pair is re-picked."""

    fallback_timeout_s: float = Field(120.0, gt=0)
    """Longest wait for a single-worker answer after the decode leg or its KV transfer failed before the client
    got a byte (extproc sends that request itself and answers with it whole, docs/pd.md)."""

    def start_budget_s(self, engine: str) -> float:
        """The longest starting a pair may take: two attempts at the prefill leg (the first pick, one re-pick),
        awaited whole for vLLM, until it is written for SGLang."""
        return 2 * engines.adapter(engine).pd_prefill_wait_s(self)


class TimeoutsConfig(_Strict):
    """Envoy's timeouts and keepalives between clients, Envoy and the workers (seed 004 §2.2/§5.2). A long prefill
    is silent (nothing is sent until the first token, and a non-streaming answer sends nothing until it is whole),
    so no timeout that counts silence applies once a request is routed, unless `routed_idle_s` is set: a dead worker
    machine (or client) is found by TCP keepalive, a dead worker process by the refused connection or reset."""

    worker_connect_s: float = Field(2.0, gt=0)
    """Longest wait for a TCP connection to a worker; a failed connect is retried once on the next-best worker."""
    keepalive_time_s: int = Field(30, ge=1)
    """TCP keepalive on client and worker connections: seconds of silence before the first probe. Keeps NATs
    and load balancers (which drop connections idle for 60-120 s) from cutting a request whose prefill sends
    nothing, on either side of the gateway."""
    keepalive_interval_s: int = Field(10, ge=1)
    """Seconds between unanswered keepalive probes."""
    keepalive_probes: int = Field(3, ge=1)
    """Unanswered probes after which the connection counts as dead and its request ends (a worker machine or a
    client gone without closing is noticed after time + probes x interval, 60 s by default)."""
    worker_idle_connection_s: float = Field(4.0, gt=0)
    """A pooled worker connection with no request is closed after this long. Below uvicorn's 5 s on purpose: a
    connection Envoy reuses just as the worker closes it would reset the request."""
    extproc_connect_s: float = Field(0.25, gt=0)
    """Longest wait for a connection to an extproc process (local): a dead one is skipped quickly."""
    request_receive_s: float = Field(300.0, ge=0)
    """How long a client may take to send its whole request, headers and body, including Cortex's routing of it
    (which may hold a PD pair's start, up to its start budget). Protects against clients that stall mid-upload.
    0: no limit."""
    stream_idle_s: float = Field(300.0, gt=0)
    """Envoy's stream idle timeout: a stream with no bytes in either direction for this long is reset. It covers a
    stream until its request headers are in (a client that opens a connection and goes silent); from then on the
    route's `routed_idle_s` replaces it (every route leads to a worker), so a long silent prefill is never cut by
    it, and a stalled body upload is bounded by `request_receive_s`."""
    routed_idle_s: float = Field(0.0, ge=0)
    """Idle timeout of a request once routed to a worker, in either direction. It counts from the moment the
    request is sent, so the prefill (and queueing, and for a non-streaming request the whole generation) count as
    silence. 0 (default): none, since a silent prefill of minutes is normal for long prompts under load. If set,
    make it longer than your slowest prefill plus queueing (non-streaming: the whole generation)."""


class LogConfig(_Strict):
    """Logs of Cortex's processes and Envoy (docs/deployment.md "Logs"), read at start; command-line flags win."""

    format: Literal["text", "json"] = "text"
    """`text`: a readable line per event (`[cortex.ingest] INFO ...`). `json`: one JSON object per line (ts,
    level, logger, process, msg and the event's fields), Envoy's own lines included."""
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level Cortex's processes write. Envoy's own lines stay at warning and above."""

    @field_validator("format", "level", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v


class MediaConfig(_Strict):
    """How the model's vLLM workers identify media items: each image's identifier is folded into the hash of every
    KV block its placeholders fill (docs/ledger.md, "Media"). Used only for models whose tokenizer directory holds a
    processor Cortex has a rule for (cortex/media.py)."""

    model_id: str | None = None
    """The workers' `--model` value (a path or a Hugging Face id; `/v1/models` lists it as `root`): vLLM hashes it
    into every image's identifier. Default: the model's `name`. Workers started with another value still serve
    the text before the first image from cache; their image blocks are never claimed."""
    hasher: Literal["blake3", "sha256", "sha512"] = "blake3"
    """The workers' `--mm-hasher-algorithm` (vLLM's default: blake3)."""


class ModelConfig(_Strict):
    """A served model: the name clients send, the engine family, and the files that tokenize like it."""

    name: str = Field(min_length=1)
    """The `model` value clients send (the engine's served model name)."""
    engine: Engine = engines.DEFAULT_ENGINE
    """Engine family of its workers: `vllm` or `sglang` (each has its own ledger and wire format)."""
    tokenizer: str
    """Directory holding tokenizer.json (+ tokenizer_config.json), or `pkg:<python package>` that ships one."""
    chat_template: str | None = None
    """Path to a Jinja chat template, overriding the one in tokenizer_config.json."""
    page_size: int | None = Field(None, ge=1)
    """The engine's KV block (page) size in tokens, as its events report it. Default: 16 for vLLM
    (`--block-size`), 1 for SGLang (`--page-size` on CUDA). A worker whose events disagree fails parity."""
    hash_algo: VllmHashAlgo | None = None
    """vLLM `--prefix-caching-hash-algo` of the workers: `sha256` (vLLM's default), `sha256_cbor`, `xxhash` or
    `xxhash_cbor`; used only to check hash parity, all four are reproduced. xxhash* needs `hash_seed`:
    without PYTHONHASHSEED vLLM seeds their root hash randomly per process and parity stays `unchecked`."""
    hash_seed: str | None = None
    """The workers' PYTHONHASHSEED if they set one (vLLM derives its root hash from it); None = unset."""
    scheduling: Literal["cortex", "transparent"] = "cortex"
    """`cortex`: Cortex picks workers (KV ledger, load, PD pairs). `transparent`: another scheduler owns this
    model's placement (a single scheduling authority, design §3); Cortex forwards by load alone, makes no KV or
    PD decision and never claims a hit, but still observes (ledger, metrics, headers)."""
    pd: PdConfig = PdConfig()
    """Prefill/decode orchestration knobs (used when the model has prefill and decode workers)."""
    media: MediaConfig = MediaConfig()
    """Media parts of chat requests (images as base64 data URLs are keyed like the engine's blocks)."""
    loras: list[str] = Field(default_factory=list)
    """LoRA adapters its workers serve, by name (vLLM `--lora-modules NAME=PATH`, SGLang `--lora-paths NAME=PATH`;
    every worker of the model is expected to serve them). vLLM clients pick one with `model: NAME`, which only
    works through Cortex when NAME is listed here. SGLang clients use `model: "<model>:NAME"` or `lora_path: NAME`,
    routed by that adapter's blocks whether listed or not (SGLang loads adapters at run time). A LoRA request
    only ever matches blocks the engine stored under the same adapter (docs/ledger.md)."""

    @field_validator("loras")
    @classmethod
    def _loras(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name or ":" in name:
                raise ValueError(f"{name!r}: a LoRA adapter name must be non-empty and contain no ':'")
        if len(set(value)) != len(value):
            raise ValueError(f"duplicate adapter name in {value}")
        return value

    def engine_page_size(self) -> int:
        return self.page_size or engines.adapter(self.engine).default_page_size

    def tokenizer_dir(self) -> Path:
        if self.tokenizer.startswith("pkg:"):
            return shipped_tokenizer_dir(self.tokenizer[4:])
        return Path(self.tokenizer).expanduser()


class AliasTarget(_Strict):
    model: str
    """A configured model name."""
    weight: float = Field(1.0, gt=0)
    """Relative share of the alias's requests (per request, at random: cache-friendly, see seed 004 §3.1)."""


class AliasConfig(_Strict):
    """A public model name clients send, served by one or more configured models (canary, versions)."""

    name: str = Field(min_length=1)
    targets: list[AliasTarget] = Field(min_length=1)
    fallback: str | None = None
    """Model used when the drawn target has no healthy worker."""
    draw: Literal["request", "session"] = "request"
    """`request`: each request draws its target by weight. `session`: a request with a session key
    (`session.headers`) draws by a hash of (alias, key), so a conversation stays on one version and keeps its KV
    cache (a canary by session; requests without a key still draw per request)."""


class WorkerConfig(_Strict):
    """One engine server (one OpenAI endpoint)."""

    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._:-]+$")
    """Name used in headers, metrics and /cortex/workers."""
    url: str
    """http://HOST:PORT of its OpenAI API, or https://HOST:PORT for one that serves TLS (checked as
    `upstream_tls` says, by every path that talks to it: Envoy, ingest's probes, extproc's PD legs; never a
    plaintext fallback). A hostname is resolved at start and again every
    `ingest.health_interval_s`: once the address in use is no longer among the answers, the worker moves to the
    first one (its ledger starts over; docs/deployment.md, "Worker DNS names")."""
    model: str
    """Name of the model (from `models`) it serves."""
    engine: Engine = engines.DEFAULT_ENGINE
    """Must match the model's engine."""
    kv_events: str | None = None
    """ZMQ PUB endpoint of the engine's KV events, e.g. tcp://10.0.0.5:5557 (None: route this worker by load).
    Cortex connects to it, so the engine must bind it: vLLM binds only an endpoint with `*` (`"endpoint":
    "tcp://*:5557"`) and connects out from any other, which Cortex names in /cortex/workers (docs/engines.md,
    "Publishers that connect"). The engine's bind spelling (tcp://*:PORT) is refused here."""
    kv_replay: str | None = None
    """ZMQ ROUTER replay endpoint (engine `replay_endpoint`), used to fill gaps."""
    kv_topic: str = ""
    """ZMQ topic prefix to subscribe to (the engine's `topic`; empty = all)."""
    role: Role = "both"
    """`both`: serves whole requests. `prefill` / `decode`: one side of a PD pool; Cortex pairs them per request
    (SGLang: concurrent legs with a bootstrap room; vLLM: prefill first, then decode with its kv_transfer_params)."""
    bootstrap_port: Port | None = None
    """SGLang prefill only: its --disaggregation-bootstrap-port. None: read from the worker's /server_info."""
    dp_size: int = Field(1, ge=1, le=256)
    """Data-parallel ranks behind this URL. Rank r publishes on the kv_events (and kv_replay) port + r, keeps
    its own cache, and is routed to as its own target (`<id>@<r>`) with the engine's rank selector."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError("must look like http://HOST:PORT or https://HOST:PORT")
        return value.rstrip("/")

    @field_validator("kv_events", "kv_replay")
    @classmethod
    def _zmq(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^(tcp://[^:/]+:\d+|ipc://.+)$", value):
            raise ValueError("must be a ZMQ endpoint such as tcp://HOST:PORT or ipc:///path")
        if value is not None and value.startswith("tcp://") and value[6:].rsplit(":", 1)[0] in ("*", "0.0.0.0"):
            # The engine's own endpoint spelling: it binds there; Cortex connects to the worker's address.
            raise ValueError(f"{value} is a bind address (what the engine's --kv-events-config says); give the "
                             "address Cortex connects to, e.g. tcp://10.0.0.5:5557")
        return value

    @property
    def tls(self) -> bool:
        """Served over TLS (an https:// url)."""
        return self.url.startswith("https://")

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        assert parts.hostname is not None and parts.port is not None  # checked by _url
        return parts.hostname, parts.port

    def address(self) -> str:
        """ip:port as Envoy's override_host compares it (resolved off the hot path: at start, then by ingest's
        re-resolution, ingest/membership.py address_moved). UNRESOLVED while the name does not resolve (a pod
        not scheduled yet, a typo): the worker then stays out of Envoy's endpoints and out of routing until it
        does, and nothing else is held up."""
        host, port = self.host_port
        try:
            ip = str(ipaddress.ip_address(host))
        except ValueError:
            try:
                ip = str(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
            except (OSError, UnicodeError):
                return UNRESOLVED
        return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


UNRESOLVED = ""
"""WorkerConfig.address() of a worker whose hostname does not resolve (yet)."""


class KubernetesPool(_Strict):
    """Workers discovered from Kubernetes: the Running and Ready pods a label selector (or an InferencePool)
    picks, kept current by a watch (docs/deployment.md, "Workers from Kubernetes")."""

    namespace: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Namespace of the pods (and the InferencePool). None: the namespace Cortex's own pod runs in (its service
    account's `namespace` file), else `default`."""
    selector: dict[str, str] = Field(default_factory=dict)
    """Pod labels that must all match (matchLabels). Give this or `inference_pool`."""
    inference_pool: str | None = None
    """Name of an InferencePool (inference.networking.k8s.io/v1) whose spec.selector.matchLabels and
    spec.targetPorts pick the pods instead (re-read at every watch renewal, at least once a minute)."""
    target_port: Port | None = None
    """The pods' OpenAI API port (required with `selector`; an InferencePool names its own)."""
    model: str
    """The configured model the pods serve."""
    engine: Engine = engines.DEFAULT_ENGINE
    """Must match the model's engine."""
    scheme: Literal["http", "https"] = "http"
    """How the pods' OpenAI API is reached: `https` when they serve TLS (mTLS in a cluster), checked as
    `upstream_tls` says (with pod IPs, set `upstream_tls.server_name` to the name their certificates carry)."""
    kv_events_port: Port | None = None
    """The pods' KV-event PUB port when a pod has no `cortex.io/kv-events-port` annotation. None: such pods are
    routed by load."""
    kv_replay_port: Port | None = None
    """The pods' replay port when a pod has no `cortex.io/kv-replay-port` annotation (None: no replay)."""
    api_server: str | None = None
    """Kubernetes API server URL. None: in-cluster (https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT).
    Plain http only to a loopback address (`kubectl proxy`)."""
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    """Bearer token, re-read for every request (projected tokens rotate); a missing file sends none."""
    ca_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    """CA bundle that signs the API server's certificate (a missing file: the system's CAs)."""

    @model_validator(mode="after")
    def _source(self) -> KubernetesPool:
        if bool(self.selector) == (self.inference_pool is not None):
            raise ValueError("give exactly one of `selector` (pod labels) and `inference_pool`")
        if self.selector and self.target_port is None:
            raise ValueError("`selector` needs `target_port` (the pods' OpenAI API port)")
        if self.api_server is not None:
            parts = urlsplit(self.api_server)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("api_server must look like https://HOST[:PORT]")
            if parts.scheme == "http" and parts.hostname not in ("localhost", "127.0.0.1", "::1"):
                raise ValueError("api_server: plain http is only allowed to a loopback address (the service "
                                 "account token would cross the network in the clear)")
        return self


class UpstreamTlsConfig(_Strict):
    """TLS from Cortex to the workers whose url is https:// (http workers are unchanged): Envoy, ingest's probes and
    extproc's PD legs all connect with it, and a worker that fails the check is refused, never retried in plaintext
    (docs/security/upstream-tls.md). Without this section an https worker is checked against the system's CAs."""

    ca_file: str | None = None
    """PEM bundle of the CAs that sign the workers' certificates. None: the system's CA bundle."""
    cert_file: str | None = None
    """PEM client certificate (chain) Cortex presents, for workers that require one (mutual TLS). Give `key_file`
    with it."""
    key_file: str | None = None
    """PEM private key of `cert_file` (unencrypted: mount it from a Secret readable by Cortex alone)."""
    server_name: str | None = None
    """Name sent as SNI and required in every worker certificate's subject alt names. None: each worker's own
    host from its url (a DNS name, or an IP address matched against the certificate's IP SANs). Set it when workers
    are addressed by IP but their certificates carry a service name (Kubernetes pods)."""
    verify: bool = True
    """Check the workers' certificates (chain and name). false encrypts without knowing who answers: only for a
    test bench; it cannot be combined with `ca_file` or `server_name`, which it would ignore."""

    @field_validator("ca_file", "cert_file", "key_file", "server_name")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty (leave it out instead)")
        return value

    @model_validator(mode="after")
    def _pairs(self) -> UpstreamTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (the client certificate and its key), or neither")
        if not self.verify and (self.ca_file is not None or self.server_name is not None):
            raise ValueError("verify: false checks no certificate, so ca_file and server_name would be ignored; "
                             "remove them or keep verify: true")
        return self


class DiscoveryConfig(_Strict):
    """Workers found at run time instead of listed in `workers`."""

    kubernetes: list[KubernetesPool] = Field(default_factory=list)
    """Pod pools watched through the Kubernetes API, each serving one model."""


class EppConfig(_Strict):
    """`cortex epp`: Cortex as the Gateway API Inference Extension's endpoint picker, called over ext_proc by a
    gateway it does not configure (docs/deployment.md#epp)."""

    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    """When Cortex cannot decide for a request it received (an internal error, not a refusal): FailOpen sends it
    to the least loaded endpoint; FailClose answers 503. Set it as the InferencePool's
    `endpointPickerRef.failureMode` (which tells the gateway what to do when Cortex is unreachable)."""
    fallback_endpoints: int = Field(0, ge=0, le=8)
    """Endpoints listed after the pick in x-gateway-destination-endpoint, for the gateway's retries. 0 for a
    gateway whose pool is an ORIGINAL_DST cluster (GIE's reference Envoy): it reads one ip:port and refuses a
    list. Raise it only for a gateway that balances with Envoy's override_host policy."""
    conformance_test: bool = False
    """Follow the GIE conformance suite's `test-epp-endpoint-selection` header (an endpoint list to pick from)
    and echo the served endpoint in `x-conformance-test-served-endpoint`. Test mode only: any client could steer
    its request with that header."""


class TenantLimits(_Strict):
    """What one tenant may use, per gateway replica (docs/tenancy.md: divide fleet-wide figures by the replica
    count, as SMG's limits are per router). None: no limit of that kind."""

    requests_per_s: float | None = Field(None, gt=0)
    """Sustained request rate (a token bucket shared by the replica's extproc processes)."""
    burst: int | None = Field(None, ge=1)
    """Requests that may arrive at once above the rate (the bucket's depth). Default: max(1, requests_per_s)."""
    tokens_per_minute: int | None = Field(None, ge=1)
    """Charged tokens (prompt + completion, weighted by `admission.charge`) per minute, reserved at admission and
    settled with the engine's usage when the request ends."""
    max_concurrent: int | None = Field(None, ge=1)
    """Requests of this tenant in flight at once."""
    token_quota: int | None = Field(None, ge=1)
    """Charged tokens per `quota_period_s` (a daily budget by default)."""
    quota_period_s: int = Field(86400, ge=60)
    """The token quota's period, in seconds, aligned to the Unix epoch (86400: each UTC day)."""


class TenantConfig(_Strict):
    """One tenant: who it is (API keys, or the trusted tenant header's value), its priority and its limits."""

    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Name in metrics, logs and the tenant header. Metrics label by it (bounded by the config)."""
    api_keys: list[str] = Field(default_factory=list)
    """`sha256:<64 hex>` digests of the tenant's API keys (`cortex hash-key` prints one); a plain key is refused,
    so the file never holds a secret. Clients send `Authorization: Bearer <key>`."""
    priority: int = Field(0, ge=-100, le=100)
    """Priority band: a higher band's waiting requests are released first; within a band tenants share by
    `weight`."""
    weight: float = Field(1.0, gt=0)
    """Share of its band's releases when several tenants wait (weighted fair queueing)."""
    limits: TenantLimits = TenantLimits()
    trusted: bool = False
    """Sees Cortex's routing headers (x-cortex-*, which reveal cache hits) and may call route explain. Others get
    neither: a hit on another tenant's prompt must not be observable."""
    shared_prefix_group: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Tenants naming the same group share KV cache (they trust each other); every other tenant's prompts are
    salted apart (`admission.isolate_caches`)."""

    @field_validator("api_keys")
    @classmethod
    def _digests(cls, value: list[str]) -> list[str]:
        for key in value:
            if not re.fullmatch(r"sha256:[0-9a-f]{64}", key):
                raise ValueError("api_keys holds SHA-256 digests written `sha256:<64 lowercase hex>`, never a key "
                                 "itself (`cortex hash-key` prints the digest of a key)")
        return value


class AuthConfig(_Strict):
    """Who is calling: API keys (Authorization: Bearer), or a tenant header set by a trusted auth layer."""

    required: bool = False
    """Refuse (401) a request whose key is missing or unknown, before any routing work. Off: such requests are
    the `default_tenant`'s."""
    tenant_header: str | None = Field(None, pattern=r"^[a-z0-9-]+$")
    """A header naming the tenant, set by an authenticating proxy in front of Cortex (lowercase). Off by default:
    only enable it when clients cannot reach Cortex except through that proxy, since any client could set it."""
    default_tenant: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Tenant of unauthenticated traffic when `required` is false; configured like any other, or unlimited."""


class WaitingRoomConfig(_Strict):
    """Where requests wait when every candidate worker is full, instead of piling onto the engines."""

    enabled: bool = True
    """Off: a full fleet still gets the request (the least loaded worker), as before."""
    ttl_s: float = Field(30.0, gt=0)
    """Longest wait; then 503 with Retry-After and `x-cortex-dropped-reason: queue_ttl`."""
    max_requests: int = Field(256, ge=1)
    """Waiting requests per extproc process; an arrival past it is refused at once (503, `queue_full`)."""
    max_bytes: int = Field(64 << 20, ge=1 << 20)
    """Request bytes waiting per extproc process (the bodies Envoy holds for them); past it, `queue_full`."""
    queue_depth: int | None = Field(None, ge=0)
    """A worker whose engine queue (waiting requests) is over this also counts as full. None: watermark only."""


class ChargeWeights(_Strict):
    """How tokens are charged against `tokens_per_minute` and `token_quota` (seed 004 §3.4)."""

    uncached_prompt: float = Field(1.0, ge=0)
    """Per prompt token the engine computes."""
    cached_prompt: float = Field(0.1, ge=0)
    """Per prompt token served from the KV cache."""
    completion: float = Field(1.0, ge=0)
    """Per generated token."""


class AdmissionConfig(_Strict):
    """Tenancy and overload: limits, the waiting room, charging, cache isolation (docs/tenancy.md)."""

    waiting_room: WaitingRoomConfig = WaitingRoomConfig()
    charge: ChargeWeights = ChargeWeights()
    default_max_tokens: int = Field(1024, ge=1)
    """Completion tokens reserved for a request that sets no max_tokens (settled with the real figure after)."""
    isolate_caches: bool = True
    """When tenants are configured, salt each tenant's prompts apart (vLLM/SGLang `cache_salt`) so no tenant's
    request ever hits another's KV blocks, except within a `shared_prefix_group`."""
    retry_after_s: int = Field(1, ge=1)
    """Retry-After on a 503 from the waiting room (a 429 carries the time until the limit allows one)."""
    objectives: dict[str, int] = Field(default_factory=dict)
    """Priorities by objective name, as llm-d's `x-llm-d-inference-objective` header (or its deprecated
    `x-gateway-inference-objective`) names them: the GIE InferenceObjective objects' `priority`. A request naming
    one waits in that band instead of its tenant's; an unknown name keeps the tenant's (docs/deployment.md#epp)."""

    @field_validator("objectives")
    @classmethod
    def _bands(cls, value: dict[str, int]) -> dict[str, int]:
        for name, priority in value.items():
            if not name or not -100 <= priority <= 100:
                raise ValueError(f"admission.objectives[{name!r}]: a non-empty name with a priority in -100..100")
        return value


class SessionConfig(_Strict):
    """Session affinity: requests naming the same session key stay on one worker and one canary target."""

    headers: list[str] = Field(default_factory=lambda: ["x-smg-routing-key", "x-session-id"])
    """Request headers read, in order, for the session key (the first one present and not blank wins; names are
    case-insensitive). A key longer than 256 bytes is replaced by its digest. Empty: no session affinity and no
    per-session canary draw (docs/tenancy/sessions.md)."""

    @field_validator("headers")
    @classmethod
    def _lowercase(cls, value: list[str]) -> list[str]:
        # Envoy hands extproc lowercase header names (HTTP/2 rules), so the names are compared lowercased.
        names = [v.strip().lower() for v in value]
        if any(not n or n.startswith(":") for n in names):
            raise ValueError("session.headers: a header name must be non-empty and not a pseudo-header")
        return names


class StructuredOutputConfig(_Strict):
    """Checks of `response_format: json_schema` and the engines' guided_json / json_schema (seed 004 §3.3)."""

    check_schema: bool = True
    """Refuse (400) a request whose JSON schema is itself invalid, before routing."""
    cache_size: int = Field(1024, ge=0)
    """Validated schemas remembered by digest (bounded)."""
    validate_responses: bool = False
    """Check the JSON of non-streamed answers against their schema and count the outcomes (the answer is never
    changed). Envoy then sends request bodies only after extproc answered the headers (its mode override needs
    that), which Cortex otherwise avoids; a change takes effect at restart."""


class CortexConfig(_Strict):
    """The whole file. Unknown keys are errors, so a typo never silently falls back to a default."""

    listen: Listen = Listen()
    admin: AdminListen = AdminListen()
    ingest: IngestConfig = IngestConfig()
    extproc: ExtprocConfig = ExtprocConfig()
    observe: ObserveConfig = ObserveConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    log: LogConfig = LogConfig()
    auth: AuthConfig = AuthConfig()
    tenants: list[TenantConfig] = Field(default_factory=list)
    """Who may call and how much (docs/tenancy.md). Empty: one unlimited default tenant, no keys."""
    admission: AdmissionConfig = AdmissionConfig()
    session: SessionConfig = SessionConfig()
    structured_output: StructuredOutputConfig = StructuredOutputConfig()
    breaker: BreakerConfig = BreakerConfig()
    """Per-worker circuit breakers on the answers workers give (docs/reliability.md)."""
    peers: PeersConfig = PeersConfig()
    """The other gateway replicas this one shares its work with (docs/replicas.md)."""
    runtime_dir: str | None = None
    """Where generated Envoy files, the shared ledger view, logs and workers.json live (default
    /tmp/cortex-<listen port>). workers.json keeps fleet changes made through the admin API across restarts;
    `cortex run --reset-workers` forgets them."""
    block_size: int = Field(16, ge=1, le=4096)
    """Cortex's own key block size in tokens; engine blocks are mapped onto it."""
    models: list[ModelConfig] = Field(min_length=1)
    """Served models (at least one)."""
    aliases: list[AliasConfig] = Field(default_factory=list)
    """Public names mapped to weighted models; listed by /v1/models beside the models."""
    workers: list[WorkerConfig] = Field(default_factory=list)
    """Workers known at start."""
    discovery: DiscoveryConfig = DiscoveryConfig()
    epp: EppConfig = EppConfig()
    upstream_tls: UpstreamTlsConfig = UpstreamTlsConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> CortexConfig:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"models: duplicate model name in {names}")
        alias_names = [a.name for a in self.aliases]
        clash = sorted(set(alias_names) & set(names) | {a for a in alias_names if alias_names.count(a) > 1})
        if clash:
            raise ValueError(f"aliases: {clash} duplicate an alias or a model name")
        for a in self.aliases:
            for ref in [t.model for t in a.targets] + ([a.fallback] if a.fallback else []):
                if ref not in names:
                    raise ValueError(f"aliases[{a.name}]: {ref!r} is not one of the models {names}")
        # A vLLM adapter is named by `model` itself: each name must lead to one model (SGLang's are qualified).
        adapters = [a for m in self.models if engines.adapter(m.engine).lora_as_model for a in m.loras]
        taken = set(names) | set(alias_names)
        clash = sorted({a for a in adapters if adapters.count(a) > 1 or a in taken})
        if clash:
            raise ValueError(f"models[].loras: vLLM adapter(s) {clash} also name another model, adapter or alias")
        ids = [w.id for w in self.workers]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"workers: duplicate worker id {dup}")
        by_name = {m.name: m for m in self.models}
        for w in self.workers:
            if w.model not in by_name:
                raise ValueError(f"workers[{w.id}].model: {w.model!r} is not one of the models {names}")
            if by_name[w.model].engine != w.engine:
                raise ValueError(f"workers[{w.id}].engine: {w.engine!r} but model {w.model!r} is served by "
                                 f"{by_name[w.model].engine!r}")
            if w.bootstrap_port is not None and (
                    w.role != "prefill" or not engines.adapter(w.engine).pd_prefill_needs_bootstrap_port):
                raise ValueError(f"workers[{w.id}].bootstrap_port: only an SGLang prefill worker has one")
            if w.dp_size > 1 and w.kv_events is not None and not w.kv_events.startswith("tcp://"):
                raise ValueError(f"workers[{w.id}].kv_events: data-parallel ranks need a tcp:// endpoint "
                                 "(rank r publishes on port + r)")
        for m in self.models:
            if self.block_size % m.engine_page_size():
                raise ValueError(f"models[{m.name}].page_size: {m.engine_page_size()} does not divide block_size "
                                 f"{self.block_size}; Cortex blocks must be whole engine pages (a Cortex hit must "
                                 "never claim part of a page the engine cannot reuse)")
        hold = self.longest_extproc_hold_s()
        if 0 < self.timeouts.request_receive_s <= hold:
            raise ValueError(f"timeouts.request_receive_s: {self.timeouts.request_receive_s} s would cut requests "
                             f"while extproc may still hold them (up to {hold} s: extproc.message_timeout_ms and "
                             "the PD start budgets); raise it or set 0")
        tenant_ids = [t.id for t in self.tenants]
        dup = sorted({i for i in tenant_ids if tenant_ids.count(i) > 1})
        if dup:
            raise ValueError(f"tenants: duplicate tenant id {dup}")
        keys = [k for t in self.tenants for k in t.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("tenants: the same API key digest is listed for two tenants (or twice)")
        if self.auth.required and not keys and self.auth.tenant_header is None:
            raise ValueError("auth.required: no tenant has an API key and no auth.tenant_header is set, so every "
                             "request would be refused")
        for i, pool in enumerate(self.discovery.kubernetes):
            if pool.model not in by_name:
                raise ValueError(f"discovery.kubernetes[{i}].model: {pool.model!r} is not one of the models {names}")
            if by_name[pool.model].engine != pool.engine:
                raise ValueError(f"discovery.kubernetes[{i}].engine: {pool.engine!r} but model {pool.model!r} is "
                                 f"served by {by_name[pool.model].engine!r}")
        targets = sum(w.dp_size for w in self.workers)
        if targets > self.ingest.max_workers:
            raise ValueError(f"workers: {targets} routing targets (workers x dp ranks) but ingest.max_workers is "
                             f"{self.ingest.max_workers}")
        return self

    def longest_extproc_hold_s(self, waiting_room: bool = True) -> int:
        """How long extproc may hold one request message, plus slack (Envoy's max_message_timeout): a PD pair's
        start budget, an SGLang decode's headers waiting for its prefill (the watchdog), or a single-worker
        fallback answering; after the waiting room's time-to-live when it is on (a released request may then
        start a pair, and Envoy takes one deadline extension per message)."""
        longest = max((max(m.pd.start_budget_s(e), m.pd.bootstrap_timeout_s + 5, m.pd.fallback_timeout_s)
                       for m in self.models for e in engines.ENGINE_NAMES), default=0.0)
        room = self.admission.waiting_room
        wait = room.ttl_s if waiting_room and room.enabled else 0.0
        return int(max(longest + 10, self.extproc.message_timeout_ms / 1000 + 1) + wait)

    def runtime_path(self) -> Path:
        return Path(self.runtime_dir or f"/tmp/cortex-{self.listen.port}")

    def view_path(self) -> Path:
        """The shared ledger view ingest writes and extproc reads."""
        return self.runtime_path() / "ledger.view"

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def pd(self, model: str) -> PdConfig:
        """A model's PD settings (the defaults for a name that is not configured)."""
        m = self.model(model)
        return m.pd if m is not None else PdConfig()


def parse_config(data: Any, source: str = "<config>") -> CortexConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return CortexConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"{source}: {exc.error_count()} problem(s):"]
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            value = err.get("input")
            shown = repr(value) if not isinstance(value, dict | list) else type(value).__name__
            lines.append(f"  - {where}: {err['msg']} (got {shown[:80]})")
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | os.PathLike[str]) -> CortexConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse_config(data, str(p))


def reachable_host(host: str) -> str:
    """Where this machine reaches a server bound to `host` (a wildcard bind answers on loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def check_models(cfg: CortexConfig) -> None:
    """Load and exercise every model's bundle (tokenizer files, chat template, page size); raises BundleError
    with one line naming the model and the path. `cortex check` and `cortex run` call it before anything starts."""
    from cortex.model_bundle import BundleError, ModelBundle, verify_bundle

    for m in cfg.models:
        try:
            where = m.tokenizer_dir()
        except BundleError as exc:
            raise BundleError(f"model {m.name!r}: tokenizer {m.tokenizer}: {exc}") from None
        bundle = ModelBundle.load(m.name, where, m.chat_template)
        verify_bundle(bundle, m.engine_page_size(), m.chat_template)


def dump_config(cfg: CortexConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True), sort_keys=False)


def reference_markdown() -> str:
    """Every field with its default and meaning, generated from the schema (docs/configuration.md)."""
    lines: list[str] = []

    def section(title: str, model: type[BaseModel], prefix: str) -> None:
        lines.extend([f"### `{title}`", "", (model.__doc__ or "").strip(), "",
                      "| field | default | meaning |", "|---|---|---|"])
        nested = []
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                nested.append((f"{prefix}{name}", ann))
                continue
            if field.is_required():
                default = "required"
            elif field.default_factory is not None:
                default = f"`{field.default_factory()!r}`"  # type: ignore[call-arg]
            else:
                default = f"`{field.default!r}`"
            desc = " ".join((field.description or "").split())
            lines.append(f"| `{prefix}{name}` | {default} | {desc} |")
        lines.append("")
        for sub_prefix, sub in nested:
            section(sub_prefix, sub, f"{sub_prefix}.")

    section("cortex.yaml (top level)", CortexConfig, "")
    section("models[]", ModelConfig, "")
    section("workers[]", WorkerConfig, "")
    section("aliases[]", AliasConfig, "")
    section("aliases[].targets[]", AliasTarget, "")
    section("tenants[]", TenantConfig, "")
    section("discovery.kubernetes[]", KubernetesPool, "")
    return "\n".join(lines)
