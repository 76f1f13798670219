"""Upstream TLS: how every path that talks to an https:// worker connects to it (docs/security/upstream-tls.md).

One config (`upstream_tls`), two renderings that check the same things: a client `ssl.SSLContext` for the Python
paths (ingest's probes, extproc's PD legs and fallbacks), built once per process, and Envoy's UpstreamTlsContext
for the worker clusters (cortex/envoy_config.py). Both verify the chain against `ca_file` (else the system's CA
bundle) and the name (`server_name`, else the worker's own host), and present `cert_file`/`key_file` when given
(mutual TLS). A worker that fails the check is refused; nothing ever falls back to plaintext, and an http:// worker
is reached exactly as before.
"""

from __future__ import annotations

import ipaddress
import ssl
from pathlib import Path
from typing import Any

from cortex.config import ConfigError, UpstreamTlsConfig, WorkerConfig

SOCKET_MATCH_KEY = "cortex_tls"
"""Endpoint metadata key (namespace envoy.transport_socket_match) naming the TLS socket an endpoint uses."""


def verify_name(tls: UpstreamTlsConfig, worker: WorkerConfig) -> str | None:
    """The name an https worker's certificate must carry (and its SNI, unless an IP address); None for http."""
    if not worker.tls:
        return None
    return tls.server_name or worker.host_port[0]


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def system_ca_file() -> str:
    """The system's CA bundle as a file: Envoy has no implicit trust store, so "the system CAs" must be named to it
    (Python's default context reads the same file)."""
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile):
        if candidate and Path(candidate).is_file():
            return candidate
    raise ConfigError("upstream_tls.ca_file: not set and this system has no CA bundle file "
                      f"(looked for {paths.cafile or paths.openssl_cafile}); name the CA that signs the workers")


def _readable(field: str, path: str) -> str:
    p = Path(path).expanduser()
    try:
        with p.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"upstream_tls.{field}: cannot read {p}: {exc.strerror}") from None
    return str(p)


def ssl_context(tls: UpstreamTlsConfig) -> ssl.SSLContext:
    """The client context for https workers. Raises ConfigError naming the field and file that is wrong."""
    if tls.verify:
        cafile = _readable("ca_file", tls.ca_file) if tls.ca_file else None
        try:
            ctx = ssl.create_default_context(cafile=cafile)
        except ssl.SSLError as exc:
            raise ConfigError(f"upstream_tls.ca_file: {cafile}: not a PEM CA bundle ({exc.reason})") from None
    else:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if tls.cert_file and tls.key_file:
        cert, key = _readable("cert_file", tls.cert_file), _readable("key_file", tls.key_file)
        try:
            ctx.load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            raise ConfigError(f"upstream_tls.cert_file/key_file: {cert} with {key}: not a PEM certificate and its "
                              f"unencrypted key ({exc.reason})") from None
    return ctx


class WorkerTls:
    """The Python paths' side, one per process: the context is built once (at construction when files are named,
    so a bad file stops the process at start), and every request to a worker takes `kwargs(name)`."""

    def __init__(self, tls: UpstreamTlsConfig) -> None:
        self.config = tls
        self._ctx: ssl.SSLContext | None = None
        if tls.ca_file or tls.cert_file or not tls.verify:
            self._ctx = ssl_context(tls)

    def context(self) -> ssl.SSLContext:
        if self._ctx is None:
            self._ctx = ssl_context(self.config)
        return self._ctx

    def kwargs(self, name: str | None) -> dict[str, Any]:
        """aiohttp request arguments for a worker whose certificate must carry `name` (None: plain http, none)."""
        if name is None:
            return {}
        return {"ssl": self.context(), "server_hostname": name}

    @staticmethod
    def base_url(address: str, name: str | None) -> str:
        """scheme://address of a worker reached by address (ip:port), https when it has a TLS name."""
        return f"{'https' if name is not None else 'http'}://{address}"


def _absolute(path: str | None) -> str | None:
    # Envoy may run from another directory than the one the config was read in.
    return None if path is None else str(Path(path).expanduser().absolute())


def envoy_transport_socket(tls: UpstreamTlsConfig, name: str) -> dict[str, Any]:
    """Envoy's TLS transport socket for workers whose certificate must carry `name`."""
    common: dict[str, Any] = {}
    if tls.verify:
        san = {"san_type": "IP_ADDRESS" if is_ip(name) else "DNS", "matcher": {"exact": name}}
        common["validation_context"] = {"trusted_ca": {"filename": _absolute(tls.ca_file) or system_ca_file()},
                                        "match_typed_subject_alt_names": [san]}
    if tls.cert_file and tls.key_file:
        common["tls_certificates"] = [{"certificate_chain": {"filename": _absolute(tls.cert_file)},
                                       "private_key": {"filename": _absolute(tls.key_file)}}]
    context: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
    }
    if not is_ip(name):
        context["sni"] = name  # SNI carries host names only (RFC 6066)
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}
