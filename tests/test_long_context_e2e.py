"""Huge prompts through the real Envoy (issue 26): a ~1M-token body past the configured limit gets a clear
OpenAI-style 413, never a hang, and the gateway serves the next request; a multi-megabyte body under the limit
goes through Envoy's buffer and the ext_proc gRPC stream to a worker, whose own context-length error comes back."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.harness import MODEL, Gateway, cluster

pytestmark = pytest.mark.timeout(240)

LIMIT = 5 << 20
"""A deployment that caps request bodies at 5 MiB (about 870K of these one-token words)."""


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with cluster(tmp_path_factory.mktemp("longctx"), extra_config={"extproc": {"max_body_bytes": LIMIT}}) as g:
        yield g


def body(tokens: int) -> bytes:
    # " hello" is one Qwen2.5 token: the prompt is about `tokens` tokens.
    words = " hello" * tokens
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 1})


def post(gw: Gateway, raw: bytes) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                      timeout=60)


def test_a_million_token_body_is_refused_clearly_and_the_gateway_serves_on(gw: Gateway) -> None:
    raw = body(1_000_000)
    assert len(raw) > LIMIT
    r = post(gw, raw)
    assert r.status_code == 413, (r.status_code, r.text[:300])
    assert r.headers.get("x-cortex-dropped-reason") == "body_too_large"
    err = r.json()["error"]
    assert err["code"] == 413 and err["type"] == "invalid_request_error" and str(LIMIT) in err["message"]
    ok = post(gw, body(200))
    assert ok.status_code == 200, ok.text[:300]
    assert "x-cortex-dropped-reason" not in ok.headers


def test_a_multi_megabyte_body_under_the_limit_is_served(gw: Gateway) -> None:
    raw = body(700_000)
    assert 4 << 20 < len(raw) < LIMIT
    r = post(gw, raw)
    # It reached a worker, which judges it against its context window (the simulator, like vLLM, refuses it).
    assert r.headers.get("x-cortex-assigned-worker"), dict(r.headers)
    assert "x-cortex-dropped-reason" not in r.headers
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text[:300]
    assert post(gw, body(200)).status_code == 200
