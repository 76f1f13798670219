"""OpenAI-style errors: `{"error": {"message", "type", "code", "param"}}` with the matching HTTP status.

`code` is the HTTP status, as vLLM and SGLang send it, so clients see one shape whether the error came
from Cortex, Envoy (local replies are rewritten to this shape) or the engine.
"""

from __future__ import annotations

import orjson

from cortex import headers as H

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


# Why Cortex refused a request, when the place that refuses it names no sharper reason (docs/observability.md,
# "Why a request was refused"). Stable words a client or a dashboard can branch on, never free text.
_REASONS = {400: "invalid_request", 401: "unauthenticated", 403: "forbidden", 404: "not_found",
            405: "method_not_allowed", 413: "body_too_large", 415: "invalid_request", 422: "invalid_request",
            429: "rate_limited", 502: "bad_gateway", 503: "unavailable", 504: "timeout"}


def default_reason(status: int) -> str:
    return _REASONS.get(status, f"http_{status}")


class ClientError(Exception):
    """A request Cortex refuses, answered by Cortex itself and never forwarded to a worker."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.reason = reason or default_reason(status)
        """Why, in x-cortex-dropped-reason (and llm-d's x-llm-d-request-dropped-reason)."""
        self.headers = {H.DROPPED_REASON: self.reason, H.LLMD_DROPPED_REASON: self.reason, **(headers or {})}
        """Sent with the error: the dropped reason under both names, and any others (Retry-After)."""

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


# Messages can quote request values (an unknown model's name, a template's own text); a client must never get
# a multi-megabyte body echoed back in an error, so long messages keep their head and tail.
MAX_MESSAGE_CHARS = 1024


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    tail = MAX_MESSAGE_CHARS // 4
    return f"{message[:MAX_MESSAGE_CHARS - tail - 1]}…{message[-tail:]}"


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return orjson.dumps({"error": {"message": _bounded(message), "type": kind, "param": param, "code": status}})
