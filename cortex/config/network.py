"""Where Cortex listens and how the connections around it behave: the public and Envoy-admin listeners, Envoy's
timeouts and keepalives, and TLS from Cortex to the workers."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from cortex.api_paths import PUBLIC_PATHS
from cortex.config.base import Port, Strict


class Listen(Strict):
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


class AdminListen(Strict):
    """Envoy's admin interface (stats, /clusters, /ready)."""

    host: str = "127.0.0.1"
    """Bind address of Envoy admin. Keep it private: admin can change Envoy's state."""
    port: Port = 9901
    """Envoy admin port."""


class TimeoutsConfig(Strict):
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


class UpstreamTlsConfig(Strict):
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


def reachable_host(host: str) -> str:
    """Where this machine reaches a server bound to `host` (a wildcard bind answers on loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
