"""Who calls and how much they may use: tenants and their limits, authentication, and admission (the waiting room,
token charging, cache isolation, objective priorities)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from cortex.config.base import Strict


class TenantLimits(Strict):
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


class TenantConfig(Strict):
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


class AuthConfig(Strict):
    """Who is calling: API keys (Authorization: Bearer), or a tenant header set by a trusted auth layer."""

    required: bool = False
    """Refuse (401) a request whose key is missing or unknown, before any routing work. Off: such requests are
    the `default_tenant`'s."""
    tenant_header: str | None = Field(None, pattern=r"^[a-z0-9-]+$")
    """A header naming the tenant, set by an authenticating proxy in front of Cortex (lowercase). Off by default:
    only enable it when clients cannot reach Cortex except through that proxy, since any client could set it."""
    default_tenant: str = Field("default", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    """Tenant of unauthenticated traffic when `required` is false; configured like any other, or unlimited."""


class WaitingRoomConfig(Strict):
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
    """A worker whose engine queue (waiting requests) is over this also counts as full: the others' waiting
    requests as last read (`cluster_view.derived_waiting`); this replica's own count through the watermark.
    None: watermark only."""


class ChargeWeights(Strict):
    """How tokens are charged against `tokens_per_minute` and `token_quota` (seed 004 §3.4)."""

    uncached_prompt: float = Field(1.0, ge=0)
    """Per prompt token the engine computes."""
    cached_prompt: float = Field(0.1, ge=0)
    """Per prompt token served from the KV cache."""
    completion: float = Field(1.0, ge=0)
    """Per generated token."""


class AdmissionConfig(Strict):
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
