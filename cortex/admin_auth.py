"""The admin plane's door: a bearer token every admin route asks for, when one is configured (docs/security.md).

The token comes from a file (`ingest.admin_token_file`; a Kubernetes Secret or a compose secret mounted read-only),
never from cortex.yaml itself, so the config can be shown and shared. It is compared in constant time
(hmac.compare_digest). A browser reaches the status page with HTTP Basic auth, any user name and the token as the
password, so no token has to travel in a URL (and from there into logs and histories). Health probes stay open:
balancers and kubelets call them without credentials, and they reveal nothing but ready or not.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

from aiohttp import web

from cortex.errors import error_body

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
                            headers={"WWW-Authenticate": 'Bearer realm="cortex admin", Basic realm="cortex admin"'})

    return check
