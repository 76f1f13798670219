"""The admin plane's door: a bearer token every admin route asks for (docs/security.md).

The token comes from a file (`ingest.admin_token_file`; a Kubernetes Secret or a compose secret mounted read-only),
never from cortex.yaml itself, so the config can be shown and shared. Without one, the admin ports stay open only
while they listen on loopback: an admin port bound beyond it (`ingest.host`, `observe.host`) gets a token generated
at start (`generate_token`), kept in the runtime directory for the gateway's processes and shown once to the
person who started it, never logged. It is compared in constant time
(hmac.compare_digest). A browser reaches the status page with HTTP Basic auth, any user name and the token as the
password, so no token has to travel in a URL (and from there into logs and histories). Health probes stay open:
balancers and kubelets call them without credentials, and they reveal nothing but ready or not.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import os
import secrets
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

from aiohttp import web

from cortex.config import CortexConfig
from cortex.errors import error_body
from cortex.headers import DROPPED_REASON

OPEN_PATHS = frozenset({"/health/live", "/health/ready", "/health"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class TokenError(ValueError):
    pass


def read_token(path: str | Path) -> str:
    """The token in `path` (surrounding whitespace dropped); a missing, unreadable or short one is an error that
    stops the start, never a silently open admin plane."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise TokenError(f"admin token file {path}: {exc.strerror}") from None
    if len(token) < 16:
        raise TokenError(f"admin token file {path}: the token must be at least 16 characters")
    return token


def configured_token(token_file: str | None) -> str | None:
    return read_token(token_file) if token_file else None


GENERATED = "admin-token"
"""The generated token's file in the runtime directory (mode 0600)."""


def loopback(host: str) -> bool:
    """Only this machine reaches a server bound to `host` (a wildcard, a name or another address: anyone may)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposed(cfg: CortexConfig) -> list[str]:
    """The admin listeners bound beyond loopback, as `setting host` (empty: all on loopback)."""
    out = [] if loopback(cfg.ingest.host) else [f"ingest.host {cfg.ingest.host or '*'}"]
    if cfg.observe.enabled and not loopback(cfg.observe.host):
        out.append(f"observe.host {cfg.observe.host or '*'}")
    return out


def generated_path(cfg: CortexConfig) -> Path:
    return cfg.runtime_path() / GENERATED


def generate_token(cfg: CortexConfig) -> str | None:
    """At start, before any process of the gateway: a fresh token for this run when an admin listener binds beyond
    loopback and no `ingest.admin_token_file` is set, written for the gateway's processes to the runtime directory
    (mode 0600, replaced atomically) and returned to be shown once. None: a token is configured, or none is needed."""
    if cfg.ingest.admin_token_file or not exposed(cfg):
        return None
    token = secrets.token_urlsafe(32)
    path = generated_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{GENERATED}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token


def admin_token(cfg: CortexConfig) -> str | None:
    """The token every admin route asks for: the configured file's; else, with an admin listener beyond loopback,
    the one generated at start (a missing file is a TokenError, never an open admin port); None: loopback only."""
    if cfg.ingest.admin_token_file:
        return read_token(cfg.ingest.admin_token_file)
    if exposed(cfg):
        try:
            return read_token(generated_path(cfg))
        except TokenError:
            raise TokenError(f"{', '.join(exposed(cfg))} is beyond loopback and no ingest.admin_token_file is set: "
                             "the admin token generated at start is missing (start the gateway with `cortex run`, "
                             "or set ingest.admin_token_file)") from None
    return None


def presented(authorization: str) -> str | None:
    """The token a request presents: `Bearer <token>`, or Basic auth's password (any user name)."""
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None


def authorized(authorization: str | None, token: str) -> bool:
    given = presented(authorization or "")
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def middleware(token: str | None, open_paths: Collection[str] = OPEN_PATHS) -> Callable[..., Awaitable[
        web.StreamResponse]]:
    """An aiohttp middleware: 401 for an admin route without the token (no-op without a token)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is None or request.path in open_paths or authorized(request.headers.get("Authorization"), token):
            return await handler(request)
        return web.Response(status=401, body=error_body(401, "this admin route needs the admin token "
                                                             "(Authorization: Bearer <token>)"),
                            content_type="application/json",
                            headers={"WWW-Authenticate": 'Bearer realm="cortex admin", Basic realm="cortex admin"',
                                     DROPPED_REASON: "unauthenticated"})

    return check
