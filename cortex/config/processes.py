"""Settings of Cortex's own processes: ingest (and its peering with other replicas), the ext_proc servers (with
their TLS, per-worker circuit breakers, structured-output checks and `cortex epp` mode), the observer, and the logs
they all write."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from cortex.config.base import Port, Strict


class IngestConfig(Strict):
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
    it some other way without publishing events is seen within this interval (longer past `load_reads_per_s`
    idle workers). Extproc treats a reading as
    unknown once older than max(2 s, 2 x the interval in force). Must not be below `load_poll_interval_s`
    (when not set, a larger `load_poll_interval_s` is used for both)."""
    routed_load_poll_interval_s: float = Field(0.5, gt=0, le=60)
    """How often the load of an active worker that this replica itself sends requests to is read: one with requests
    of this replica (or, peered, of a peer) in flight, or sent some within the last 30 s. Between two readings
    extproc adds the change in this replica's own in-flight count there (and its peers', as their reports said) to
    the reading, so that traffic is seen at once; other replicas' and clients' traffic there is seen at most this
    late (docs/performance.md, "Gateway CPU against SMG at 4 replicas"). An active worker nobody peered sends to is
    read every
    `load_poll_interval_s`. Between `load_poll_interval_s` and `idle_load_poll_interval_s` (when not set, clamped
    into that range)."""
    load_reads_per_s: float | None = Field(250.0, gt=0)
    """Most load reads per second this replica spends on its active workers, and as many again on its idle ones:
    where more are active than this allows at their cadence (`load_poll_interval_s`, `routed_load_poll_interval_s`),
    each is read every (active workers / this) seconds instead, so a fleet of 256 busy workers costs a replica what
    25 cost at 0.1 s; idle workers past this many are read every (idle workers / this) seconds instead of every
    `idle_load_poll_interval_s` (docs/performance.md, "Fleet scale"). The readings are older in proportion (this
    replica's own traffic is still seen at once, and an idle worker's events or a request routed to it read it at
    once). None: no bound."""
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
    event_shards: int = Field(0, ge=0, le=32)
    """Child processes that follow the workers' KV-event streams (the sockets, decoding, sequencing, ledgers, tail
    checks and replays) and send ingest each batch's net key changes, so a busy fleet's events use more than the
    one core ingest has (docs/ledger.md, "Event shards"). 0: ingest follows them itself, the right choice until
    ingest's `cortex_ingest_loop_cpu_seconds_total{loop="events"}` nears a core or the view lags
    (`cortex_ingest_view_lag_max_seconds`): a shard costs a process and a hop of ~0.1 ms per write section."""
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


class ExtprocTls(Strict):
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


class ExtprocConfig(Strict):
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
    transport: Literal["grpc", "http"] = "grpc"
    """How Cortex's own Envoy asks for each decision. `grpc`: Envoy's ext_proc filter, one gRPC stream per request.
    `http`: a Lua filter posts the request's headers and buffered body to extproc over HTTP/1.1, acts on the answer
    and posts the request's end (Envoy's access log tells the end of a request whose client left): the same
    decision, 25-30 % more requests per extproc core and up to ~1 ms less added latency on a 2-core host
    (docs/architecture.md, "The decision over HTTP"; docs/performance.md). Not with PD workers, nor with
    structured_output.validate_responses (both act in the response phase); `cortex epp` always speaks ext_proc."""
    http_base_port: Port = 50151
    """`transport: http`: process i takes decisions on http_base_port + i (host `host`)."""
    message_timeout_ms: int = Field(5000, ge=200)
    """Envoy's per-message ext_proc deadline. Envoy's default (200 ms) is too tight for Python under load;
    on expiry the request is served as `failure_mode` says."""
    failure_mode: Literal["auto", "open", "closed"] = "auto"
    """What Envoy does with a request when no extproc process answers (all down, or a message past its deadline).
    `open`: serve it on Envoy's own balancing, without Cortex (no cache-aware routing, no API-key check, no tenant
    limit). `closed`: refuse it (503, `x-cortex-dropped-reason: extproc_unavailable`, Retry-After). `auto`: closed
    when `auth.required` or any tenant is configured (a key or a limit must never be skipped), else open."""
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


class BreakerConfig(Strict):
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


class PeersConfig(Strict):
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
    interval_s: float = Field(0.1, gt=0, le=1)
    """How often this replica's work is published when it changed (at least every `heartbeat_s` when not). 0.1 s,
    not the 20 ms it was: four replicas spent 9-24 % less CPU for the same or a better hit ratio and TTFT
    (docs/performance.md, "Peer reports every 100 ms")."""
    heartbeat_s: float = Field(0.5, gt=0, le=10)
    share_load_readings: bool = True
    """Peered replicas split the reading of the workers' load: each worker is read by one live replica (a
    rendezvous hash of the ids), which sends its readings in its reports; the others apply them and read that
    worker themselves only when none arrived for two of its reads plus two report intervals. False: every
    replica reads every worker (docs/replicas.md, "Load readings, read once")."""
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



class StructuredOutputConfig(Strict):
    """Checks of `response_format: json_schema` and the engines' guided_json / json_schema (seed 004 §3.3)."""

    check_schema: bool = True
    """Refuse (400) a request whose JSON schema is itself invalid, before routing."""
    cache_size: int = Field(1024, ge=0)
    """Validated schemas remembered by digest (bounded)."""
    validate_responses: bool = False
    """Check the JSON of non-streamed answers against their schema and count the outcomes (the answer is never
    changed). Envoy then sends request bodies only after extproc answered the headers (its mode override needs
    that), which Cortex otherwise avoids; a change takes effect at restart."""


class EppConfig(Strict):
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


class ObserveConfig(Strict):
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


class LogConfig(Strict):
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
