"""One finished request, read from Envoy's access-log entry: what extproc decided, what the Lua filter saw of
the response, and how it ended (cortex/observation.py has the metadata contract).

Pure: `read(entry, workers_by_address)` -> Observation. Every field the entry lacks stays None, so a request
that never reached a worker, a client that left early, or an engine that sent no usage is still one
observation, counted as what it was."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from google.protobuf import struct_pb2

from cortex import observation as obs

# Envoy's response flags, by the cause an operator acts on (first match wins: a client that left while the
# upstream was also failing is counted as the client leaving).
_CAUSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("client_disconnect", ("downstream_remote_reset", "downstream_connection_termination")),
    ("upstream_timeout", ("upstream_request_timeout", "stream_idle_timeout", "duration_timeout",
                          "upstream_max_stream_duration_reached")),
    ("upstream_connect_failure", ("upstream_connection_failure", "upstream_overflow",
                                  "upstream_retry_limit_exceeded")),
    ("upstream_reset", ("upstream_remote_reset", "upstream_connection_termination", "upstream_protocol_error",
                        "local_reset")),
    ("no_healthy_upstream", ("no_healthy_upstream", "no_route_found", "no_cluster_found")),
)
CAUSES = ("", *(c for c, _ in _CAUSES), "local_reply", "upstream_5xx", "upstream_4xx")
"""Every value `Observation.cause` takes ('' for a request that ended well)."""

OUTCOMES = ("over", "exact", "under", "unreported")
"""How the engine's cached_tokens compares with Cortex's claim (`over`: Cortex claimed more: an alarm;
`unreported`: the engine sent no cached_tokens, e.g. vLLM without --enable-prompt-tokens-details)."""


@dataclass(frozen=True)
class Observation:
    request_id: str
    start_s: float
    """Unix time the request's first byte reached Envoy."""
    method: str
    path: str
    status: int
    """The status the client got; 0 when it got none (it left, or the stream was reset before headers)."""
    cause: str
    routed: bool
    """extproc decided this request (its facts are in the entry)."""
    model: str
    worker: str
    """The worker that answered ('' when none did or it is not a configured one)."""
    prefill: str
    mode: str
    reason: str
    claimed: int | None
    """The x-cortex-cache-hit-tokens the client got (None: no claim was made)."""
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    """The engine's own figures, from the usage it sent (None: it sent none)."""
    usage_injected: bool
    ttft_s: float | None
    """First response chunk minus the request's arrival; streamed requests only."""
    itl_s: float | None
    """Mean time between tokens after the first: (last chunk - first chunk) / (completion tokens - 1)."""
    e2e_s: float | None
    chunks: int
    stream: bool
    prompt_hash: str = ""
    """observation.prompt_hash of the whole prompt ('' when extproc did not see one)."""
    first_ids: tuple[int, ...] = ()
    """The prompt's first token ids (up to observation.FIRST_IDS_LOGGED), never its text."""
    routed_prompt_tokens: int | None = None
    """Cortex's own count (an estimate when routing stopped early); prompt_tokens is the engine's."""
    tenant: str = ""
    reserved_tokens: int | None = None
    """Tokens it held reserved against its tenant's token limits (None: it held none)."""
    quota_period_s: int | None = None
    dropped_reason: str = ""
    """Why admission refused it ('' when it did not)."""
    queued_ms: float | None = None
    predicted_ttft_ms: float | None = None
    """The time model's TTFT for the worker that served it (absent under another rule)."""
    """How long it waited in the waiting room (None: it did not wait)."""
    alias: str = ""
    """The alias the client named ('' when it named a model): `model` is then the target it drew."""

    @property
    def outcome(self) -> str | None:
        """The claim against the engine's cached_tokens (OUTCOMES), or None when no claim was made."""
        if self.claimed is None:
            return None
        if self.cached_tokens is None:
            return "unreported"
        if self.claimed > self.cached_tokens:
            return "over"
        return "exact" if self.claimed == self.cached_tokens else "under"


def _scalars(s: struct_pb2.Struct) -> dict[str, Any]:
    """A metadata namespace's top-level scalars (what the contract puts there), without json_format's cost."""
    out: dict[str, Any] = {}
    for key, v in s.fields.items():
        kind = v.WhichOneof("kind")
        if kind == "number_value":
            out[key] = v.number_value
        elif kind == "string_value":
            out[key] = v.string_value
        elif kind == "bool_value":
            out[key] = v.bool_value
    return out


def _ids(value: Any) -> tuple[int, ...]:
    """The prompt's first ids, sent as "id,id,..." (cortex/observation.py); anything else reads as none."""
    if not isinstance(value, str) or not value:
        return ()
    try:
        return tuple(int(i) for i in value.split(",")[:obs.FIRST_IDS_LOGGED])
    except ValueError:
        return ()


def _seconds(d: Any) -> float | None:
    return d.seconds + d.nanos / 1e9 if d.ByteSize() else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def cause_of(flags: al.ResponseFlags, status: int, details: str) -> str:
    for cause, names in _CAUSES:
        if any(getattr(flags, n) for n in names):
            return cause
    if status >= 400 or status == 0:
        if details != "via_upstream":
            return "local_reply"
        return "upstream_5xx" if status >= 500 else "upstream_4xx"
    return ""


def read(entry: al.HTTPAccessLogEntry, workers_by_address: Mapping[str, str]) -> Observation:
    common = entry.common_properties
    meta = common.metadata.filter_metadata
    facts = _scalars(meta[obs.NAMESPACE]) if obs.NAMESPACE in meta else {}
    seen = _scalars(meta[obs.OBSERVED]) if obs.OBSERVED in meta else {}
    start = common.start_time.seconds + common.start_time.nanos / 1e9
    status = entry.response.response_code.value if entry.response.HasField("response_code") else 0
    cause = cause_of(common.response_flags, status, entry.response.response_code_details)

    worker = _str(facts.get(obs.WORKER))
    if not worker and common.upstream_remote_address.HasField("socket_address"):
        a = common.upstream_remote_address.socket_address
        worker = workers_by_address.get(f"{a.address}:{a.port_value}", "")

    completion = _int(seen.get("completion_tokens"))
    first_us, last_us = seen.get("first_us"), seen.get("last_us")
    stream = bool(facts.get(obs.STREAM))
    ttft = itl = None
    if stream and isinstance(first_us, (int, float)):
        ttft = max(0.0, first_us / 1e6 - start)
        if isinstance(last_us, (int, float)) and completion is not None and completion >= 2:
            itl = max(0.0, (last_us - first_us) / 1e6 / (completion - 1))
    e2e = _seconds(common.time_to_last_downstream_tx_byte) or _seconds(common.duration)
    return Observation(
        request_id=entry.request.request_id, start_s=start,
        method=base_pb2.RequestMethod.Name(entry.request.request_method) if entry.request.request_method else "",
        path=entry.request.path.partition("?")[0], status=status, cause=cause,
        routed=bool(facts), model=_str(facts.get(obs.MODEL)), worker=worker,
        prefill=_str(facts.get(obs.PREFILL)), mode=_str(facts.get(obs.MODE)), reason=_str(facts.get(obs.REASON)),
        claimed=_int(facts.get(obs.CLAIMED)), prompt_tokens=_int(seen.get("prompt_tokens")),
        completion_tokens=completion, cached_tokens=_int(seen.get("cached_tokens")),
        usage_injected=bool(facts.get(obs.USAGE_INJECTED)), ttft_s=ttft, itl_s=itl, e2e_s=e2e,
        chunks=_int(seen.get("chunks")) or 0, stream=stream, prompt_hash=_str(facts.get(obs.PROMPT_HASH)),
        first_ids=_ids(facts.get(obs.FIRST_IDS)),
        routed_prompt_tokens=_int(facts.get(obs.PROMPT_TOKENS)), tenant=_str(facts.get(obs.TENANT)),
        reserved_tokens=_int(facts.get(obs.RESERVED)), quota_period_s=_int(facts.get(obs.QUOTA_PERIOD)),
        dropped_reason=_str(facts.get(obs.DROPPED)), queued_ms=_float(facts.get(obs.QUEUED_MS)),
        predicted_ttft_ms=_float(facts.get(obs.PREDICTED_TTFT)),
        alias=_str(facts.get(obs.ALIAS)))
