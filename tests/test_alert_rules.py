"""deploy/prometheus/cortex-alerts.yaml: valid rules (`promtool check rules`) whose every alert fires on synthetic
series and stays quiet where it must (`promtool test rules deploy/prometheus/cortex-alerts.test.yaml`).

promtool is Prometheus's own checker; scripts/setup.sh puts it in .venv/bin (scripts/install-prometheus.sh). A
machine without it fails here rather than skipping: CI must run these checks.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.test_dashboard import promtool

PROM = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULES = PROM / "cortex-alerts.yaml"
TESTS = PROM / "cortex-alerts.test.yaml"
RUNBOOK = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def _promtool(*args: str) -> str:
    r = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=PROM)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_promtool_check_rules() -> None:
    out = _promtool("check", "rules", RULES.name)
    assert "SUCCESS" in out


def test_promtool_test_rules() -> None:
    out = _promtool("test", "rules", TESTS.name)
    assert "SUCCESS" in out


def _alerts() -> list[dict[str, object]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_is_tested_firing() -> None:
    """Each alert appears with an expected alert in the promtool test file, not only in quiet cases."""
    doc = yaml.safe_load(TESTS.read_text())
    fired = {t["alertname"] for case in doc["tests"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert {str(a["alert"]) for a in _alerts()} <= fired


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, re.MULTILINE)}


def test_every_alert_has_severity_annotations_and_a_runbook_section() -> None:
    anchors = _anchors(RUNBOOK.read_text())
    for a in _alerts():
        labels, ann = a["labels"], a["annotations"]
        assert isinstance(labels, dict) and labels["severity"] in ("critical", "warning"), a["alert"]
        assert isinstance(ann, dict) and ann["summary"] and ann["description"], a["alert"]
        url = str(ann["runbook_url"])
        assert url.startswith("docs/operations.md#"), url
        assert url.split("#", 1)[1] in anchors, f"{a['alert']}: no section for {url} in docs/operations.md"
