"""The standard gRPC health protocol (grpc.health.v1.Health/Check) for the extproc processes, without a new
dependency: its two messages are one field each, encoded here by hand.

Service names an extproc process answers:
- "" (the server as a whole, what Envoy's ext_proc cluster health check asks): SERVING once the process has
  read ingest's target list at least once; it stays so while ingest restarts (the process still routes, by
  load), so Envoy never fails open for a reason the process can handle itself.
- "cortex.ledger_view": SERVING while the process reads a live ledger view now (what /health/ready asks).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

SERVICE = "grpc.health.v1.Health"
CHECK = f"/{SERVICE}/Check"
LEDGER_VIEW = "cortex.ledger_view"
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
"""The service GIE's reference gateway health-checks on its picker: answered as the server's own ("")."""

UNKNOWN, SERVING, NOT_SERVING = 0, 1, 2


def encode_request(service: str) -> bytes:
    data = service.encode()
    return b"\x0a" + _varint(len(data)) + data if data else b""


def decode_request(raw: bytes) -> str:
    """HealthCheckRequest.service; a malformed request reads as the whole-server check."""
    pos = 0
    while pos < len(raw):
        tag, pos = _read_varint(raw, pos)
        wire = tag & 7
        if wire == 2:
            n, pos = _read_varint(raw, pos)
            if tag >> 3 == 1:
                return raw[pos:pos + n].decode(errors="replace")
            pos += n
        elif wire == 0:
            _, pos = _read_varint(raw, pos)
        else:
            break
    return ""


def encode_response(status: int) -> bytes:
    return b"\x08" + _varint(status) if status else b""


def decode_response(raw: bytes) -> int:
    if len(raw) >= 2 and raw[0] == 0x08:
        return _read_varint(raw, 1)[0]
    return UNKNOWN


def channel(address: str) -> grpc.aio.Channel:
    """A channel for health checks. Reconnects are retried within a second: gRPC's default backoff grows to
    two minutes while a process is still starting, which would delay "ready" long after it serves."""
    return grpc.aio.insecure_channel(address, options=[
        ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000)])


def handler(status_of: Callable[[str], int | None]) -> grpc.GenericRpcHandler:
    """A generic handler for Check; `status_of(service)` returns None for a service it does not know."""

    async def check(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        service = decode_request(raw)
        status = status_of(service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
        return encode_response(status or UNKNOWN)

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Check": grpc.unary_unary_rpc_method_handler(check),
    })


async def check(channel: grpc.aio.Channel, service: str = "", timeout: float = 1.0) -> tuple[bool, str]:
    """(serving, reason) of one server."""
    call = channel.unary_unary(CHECK)
    try:
        raw = await call(encode_request(service), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return False, f"{exc.code().name.lower()}: {exc.details() or 'no answer'}"
    status = decode_response(raw)
    if status == SERVING:
        return True, "serving"
    return False, "not serving yet (has not read the ledger view)" if status == NOT_SERVING else "status unknown"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while pos < len(raw):
        b = raw[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
    return result, pos
