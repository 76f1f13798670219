"""OpenAI-style errors: `{"error": {"message", "type", "code", "param"}}` with the matching HTTP status.

`code` is the HTTP status, as vLLM and SGLang send it, so clients see one shape whether the error came
from Cortex, Envoy (local replies are rewritten to this shape) or the engine.
"""

from __future__ import annotations

import orjson

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


class ClientError(Exception):
    """A request Cortex refuses, answered by Cortex itself and never forwarded to a worker."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
        """Sent with the error (Retry-After, a dropped reason)."""

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
