"""Who is calling: a request's tenant, from its API key or a trusted tenant header, before any routing work.

Keys are compared by their SHA-256 digest (the config holds only digests): a dict lookup on the digest is
constant-time in the key's content, so an unknown key teaches a caller nothing about the known ones. The tenant
header is believed only when configured (an auth layer in front sets it and clients cannot reach Cortex past it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cortex.config import CortexConfig, TenantConfig, TenantLimits
from cortex.errors import ClientError

DEFAULT_ID = "default"


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    priority: int
    weight: float
    limits: TenantLimits
    trusted: bool
    """May see x-cortex-* routing headers and call route explain."""
    salt: str | None
    """The cache salt that keeps its prompts' KV blocks apart from other tenants' (None: not isolated)."""


def digest(key: str) -> str:
    """The form api_keys are written in (`cortex hash-key`)."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _salt(t: TenantConfig) -> str:
    # Within vLLM's cache_salt rule (no @ / \, at most 128 chars); the id pattern keeps it so.
    return f"cortex-group-{t.shared_prefix_group}" if t.shared_prefix_group else f"cortex-tenant-{t.id}"


class Directory:
    """The tenants of one config generation."""

    def __init__(self, cfg: CortexConfig) -> None:
        self.configured = bool(cfg.tenants)
        isolate = self.configured and cfg.admission.isolate_caches
        self.tenants: list[Tenant] = [
            Tenant(t.id, t.priority, t.weight, t.limits, t.trusted, _salt(t) if isolate else None)
            for t in cfg.tenants]
        by_id = {t.id: t for t in self.tenants}
        default = by_id.get(cfg.auth.default_tenant)
        if default is None:
            # No tenants configured: everyone is one unlimited tenant who sees everything (Cortex as before).
            default = Tenant(cfg.auth.default_tenant, 0, 1.0, TenantLimits(),
                             not self.configured, f"cortex-tenant-{cfg.auth.default_tenant}" if isolate else None)
            self.tenants.append(default)
        self.default = default
        self.by_id = {t.id: t for t in self.tenants}
        self.by_digest = {k: by_id[t.id] for t in cfg.tenants for k in t.api_keys}
        self.required = cfg.auth.required
        self.header = cfg.auth.tenant_header

    def identify(self, authorization: str | None, tenant_header: str | None) -> Tenant:
        """The caller's tenant; ClientError(401) when auth is required and neither a known key nor (when
        configured) a known tenant header names one. With auth optional, any request without a known key is the
        default tenant's (OpenAI clients send some bearer token even to servers that take none)."""
        if self.header is not None and tenant_header:
            tenant = self.by_id.get(tenant_header)
            if tenant is not None:
                return tenant
            raise ClientError(401, "The tenant named by the tenant header is not configured.")
        if authorization:
            scheme, _, key = authorization.strip().partition(" ")
            key = key.strip()
            if scheme.lower() == "bearer" and key:
                tenant = self.by_digest.get(digest(key))
                if tenant is not None:
                    return tenant
                if self.required:
                    raise ClientError(401, "Incorrect API key provided.")
                return self.default
            if self.required:
                raise ClientError(401, "The Authorization header must be `Bearer <API key>`.")
        if self.required:
            raise ClientError(401, "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.")
        return self.default
