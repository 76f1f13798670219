"""What is served and by whom: models (with their prefill/decode and media settings), aliases over them, the workers
listed in the file, and the Kubernetes pools that discover more."""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from cortex import engines
from cortex.config.base import Port, Strict
from cortex.engine_hashes import VllmHashAlgo
from cortex.model_bundle import shipped_tokenizer_dir

if TYPE_CHECKING:
    Engine = str
else:
    # Every adapter module in cortex/engines, so a new engine is accepted without touching this file.
    Engine = Literal[engines.ENGINE_NAMES]
Role = Literal["both", "prefill", "decode"]


class PdConfig(Strict):
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


class MediaConfig(Strict):
    """How the model's vLLM workers identify media items: each image's identifier is folded into the hash of every
    KV block its placeholders fill (docs/ledger.md, "Media"). Used only for models whose tokenizer directory holds a
    processor Cortex has a rule for (cortex/media.py)."""

    model_id: str | None = None
    """The workers' `--model` value (a path or a Hugging Face id; `/v1/models` lists it as `root`): vLLM hashes it
    into every image's identifier. Default: the model's `name`. Workers started with another value still serve
    the text before the first image from cache; their image blocks are never claimed."""
    hasher: Literal["blake3", "sha256", "sha512"] = "blake3"
    """The workers' `--mm-hasher-algorithm` (vLLM's default: blake3)."""


class ModelConfig(Strict):
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


class AliasTarget(Strict):
    model: str
    """A configured model name."""
    weight: float = Field(1.0, gt=0)
    """Relative share of the alias's requests (per request, at random: cache-friendly, see seed 004 §3.1)."""


class AliasConfig(Strict):
    """A public model name clients send, served by one or more configured models (canary, versions)."""

    name: str = Field(min_length=1)
    targets: list[AliasTarget] = Field(min_length=1)
    fallback: str | None = None
    """Model used when the drawn target has no healthy worker."""
    draw: Literal["request", "session"] = "request"
    """`request`: each request draws its target by weight. `session`: a request with a session key
    (`session.headers`) draws by a hash of (alias, key), so a conversation stays on one version and keeps its KV
    cache (a canary by session; requests without a key still draw per request)."""


class WorkerConfig(Strict):
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


class KubernetesPool(Strict):
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


class DiscoveryConfig(Strict):
    """Workers found at run time instead of listed in `workers`."""

    kubernetes: list[KubernetesPool] = Field(default_factory=list)
    """Pod pools watched through the Kubernetes API, each serving one model."""
