"""The admin plane asks for its token on every admin route, in constant time, and is never on the public
listener (docs/security.md)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex import admin_auth
from tests.harness import MODEL, Gateway, cluster

pytestmark = pytest.mark.timeout(300)

TOKEN = "admin-token-0123456789abcdef"


def test_presented_reads_bearer_and_basic_passwords() -> None:
    basic = base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
    assert admin_auth.presented(f"Bearer {TOKEN}") == TOKEN
    assert admin_auth.presented(f"basic {basic}") == TOKEN
    for bad in ("", "Bearer", "Basic !!!", "Basic " + base64.b64encode(b"no-colon").decode(), f"Token {TOKEN}"):
        assert admin_auth.presented(bad) is None
    assert admin_auth.authorized(f"Bearer {TOKEN}", TOKEN)
    assert not admin_auth.authorized(f"Bearer {TOKEN}x", TOKEN)
    assert not admin_auth.authorized(None, TOKEN)


def test_a_missing_or_short_token_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(admin_auth.TokenError, match="No such file"):
        admin_auth.read_token(tmp_path / "absent")
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(admin_auth.TokenError, match="at least 16"):
        admin_auth.read_token(short)
    good = tmp_path / "good"
    good.write_text(f"  {TOKEN}\n")
    assert admin_auth.read_token(good) == TOKEN


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("admin")
    token_file = root / "admin-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    with cluster(root, n_sims=1, extra_config={"ingest": {"admin_token_file": str(token_file)}}) as g:
        yield g


def admin_routes(gw: Gateway) -> list[tuple[str, str, dict[str, Any] | None]]:
    return [("GET", f"{gw.ingest_url}/cortex/workers", None),
            ("POST", f"{gw.ingest_url}/cortex/workers", {"id": "evil", "url": "http://10.0.0.1:80", "model": "x"}),
            ("DELETE", f"{gw.ingest_url}/cortex/workers/sim-1", None),
            ("GET", f"{gw.ingest_url}/cortex/ui", None),
            ("GET", f"{gw.ingest_url}/cortex/ui/data", None),
            ("GET", f"{gw.observe_url}/cortex/decisions", None),
            ("GET", f"{gw.observe_url}/cortex/hit-ratio", None),
            ("POST", gw.explain_url, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})]


def test_every_admin_route_answers_401_without_the_token(gw: Gateway) -> None:
    for method, url, body in admin_routes(gw):
        for headers in ({}, {"authorization": "Bearer wrong-token-0123456789"}):
            r = httpx.request(method, url, json=body, headers=headers, timeout=10)
            assert r.status_code == 401, (method, url, r.status_code)
            assert r.json()["error"]["code"] == 401 and "Bearer" in r.headers["www-authenticate"]
    assert "sim-1" in {w["id"] for w in httpx.get(f"{gw.ingest_url}/cortex/workers", timeout=10, headers={
        "authorization": f"Bearer {TOKEN}"}).json()["workers"]}  # nothing was removed or added


def test_the_token_opens_them_and_a_browser_can_use_basic_auth(gw: Gateway) -> None:
    bearer = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{gw.ingest_url}/cortex/workers", headers=bearer, timeout=10).status_code == 200
    assert httpx.get(f"{gw.observe_url}/cortex/decisions", headers=bearer, timeout=10).status_code == 200
    page = httpx.get(f"{gw.ingest_url}/cortex/ui/data", auth=("admin", TOKEN), timeout=10)
    assert page.status_code == 200
    assert page.json()["observation"]["available"]  # the page reaches the observer with the token too


def test_route_explain_is_on_the_admin_port_behind_the_token(gw: Gateway) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    r = httpx.post(gw.explain_url, json=body, headers=gw.admin_headers, timeout=30)
    assert r.status_code == 200 and r.json()["chosen"] == "sim-1"
    # Off the public listener by default: Envoy's 404, never a decision.
    public = httpx.post(f"{gw.url}/cortex/v1/route", json=body, timeout=30)
    assert public.status_code == 404 and "chosen" not in public.text
    # A bad body is refused as on the public path; an unknown tenant view is a 404.
    bad = httpx.post(gw.explain_url, content=b"{", headers=gw.admin_headers, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
    unknown = httpx.post(gw.explain_url, json=body, timeout=30,
                         headers={**gw.admin_headers, "x-cortex-tenant": "nobody"})
    assert unknown.status_code == 404


def test_health_and_metrics_stay_open(gw: Gateway) -> None:
    for url in (f"{gw.ingest_url}/health/live", f"{gw.ingest_url}/health/ready", f"{gw.ingest_url}/metrics",
                f"{gw.observe_url}/health", f"{gw.observe_url}/metrics"):
        assert httpx.get(url, timeout=10).status_code == 200, url


def test_the_public_listener_never_serves_admin_routes(gw: Gateway) -> None:
    for path in ("/cortex/workers", "/cortex/ui", "/cortex/ui/data", "/cortex/decisions", "/cortex/hit-ratio",
                 "/health/ready", "/metrics", "/cortex/v1/route"):
        r = httpx.get(f"{gw.url}{path}", timeout=10, headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code != 200 or ("workers" not in r.text and "cortex_" not in r.text), path
    r = httpx.post(f"{gw.url}/cortex/workers", timeout=10, headers={"authorization": f"Bearer {TOKEN}"},
                   json={"id": "evil", "url": "http://10.0.0.1:80", "model": "x"})
    assert r.status_code != 201
    assert "evil" not in {w["id"] for w in httpx.get(f"{gw.ingest_url}/cortex/workers", timeout=10, headers={
        "authorization": f"Bearer {TOKEN}"}).json()["workers"]}


def test_engine_admin_paths_are_not_forwarded(gw: Gateway) -> None:
    """Only the inference API reaches workers: an engine's own admin plane (SGLang /flush_cache wipes every
    tenant's cache) gets Envoy's 404, without extproc or a worker seeing it."""
    for method, path in (("POST", "/flush_cache"), ("POST", "/abort_request"), ("GET", "/metrics"),
                         ("POST", "/reset_prefix_cache"), ("GET", "/server_info"), ("GET", "/v1/chat/completions/x"),
                         ("POST", "/v1/load_lora_adapter")):
        r = httpx.request(method, f"{gw.url}{path}", timeout=10)
        assert r.status_code == 404, (path, r.status_code)
        assert r.json()["error"]["code"] == 404 and "listen.paths" in r.json()["error"]["message"]
    assert httpx.get(f"{gw.url}/v1/models?limit=1", timeout=10).status_code == 200  # the query is not the path
    assert httpx.get(f"{gw.url}/cortex/health", timeout=10).status_code == 200
    assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200  # a worker's health stays public


def test_routing_headers_can_be_turned_off_for_everyone(tmp_path: Path) -> None:
    """extproc.routing_headers: false: no caller learns which worker served or what was cached."""
    with cluster(tmp_path, n_sims=1, extra_config={"extproc": {"routing_headers": False}}) as g:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 2}
        r = httpx.post(f"{g.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200
        assert not [k for k in r.headers if k.lower().startswith("x-cortex-")]
        assert r.headers["x-sim-worker"] == "sim-1"
