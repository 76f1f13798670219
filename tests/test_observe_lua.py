"""cortex/observe.lua in a real Envoy, against responses cut at awkward places: byte by byte, a usage key split
across two chunks, CRLF event ends, an error body that is not a stream, a content string that mentions
`"usage":{`, and the other APIs' usage shapes (the Responses API's input/output tokens, the Messages API's cache
reads kept apart, SGLang's meta_info). The upstream is a raw socket server writing exactly the chunks each case
asks for (with a pause between writes so Envoy reads them apart); Envoy's file access log prints what the filter
recorded."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cortex.envoy_config import envoy_binary
from cortex.observation import OBSERVED, lua_source
from tests.harness import free_ports, stop, wait_for

pytestmark = pytest.mark.timeout(120)

HEAD = '{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'


def event(doc: str, end: str = "\n\n") -> str:
    return f"data: {doc}{end}"


ROLE = event(HEAD + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}')
TOKEN = event(HEAD + '"choices":[{"index":0,"delta":{"content":" hi"},"finish_reason":null}]}')
# A content string that mentions the key: escaped inside JSON, so it is neither usage nor stripped.
TRICK = event(HEAD + '"choices":[{"index":0,"delta":{"content":"say \\"usage\\":{\\"prompt_tokens\\":9}"},'
                     '"finish_reason":"length"}]}')
USAGE = event(HEAD + '"choices":[],"usage":{"prompt_tokens":1042,"total_tokens":1047,"completion_tokens":5,'
                     '"prompt_tokens_details":{"cached_tokens":1024}}}')
DONE = "data: [DONE]\n\n"
STREAM = ROLE + TOKEN + TRICK + USAGE + DONE
KEPT = ROLE + TOKEN + TRICK + DONE


def byte_by_byte(s: str) -> list[str]:
    return list(s)


def split_in_usage_key(s: str) -> list[str]:
    cut = s.index('"usage":{') + 4
    return [s[:cut], s[cut:]]


def named(kind: str, doc: str) -> str:
    """An `event: <kind>` server-sent event (the Responses and Messages APIs' streams)."""
    return f"event: {kind}\ndata: {doc}\n\n"


# The other APIs' usage shapes, each the same 1042 prompt tokens (1024 cached) and 5 completion tokens.
RESPONSES_USAGE = ('"usage":{"input_tokens":1042,"input_tokens_details":{"cached_tokens":1024,"cache_write_tokens":0,'
                   '"input_tokens_per_turn":[],"cached_tokens_per_turn":[]},"output_tokens":5,"output_tokens_details":'
                   '{"reasoning_tokens":0},"total_tokens":1047}')
RESPONSES_STREAM = [
    named("response.created", '{"response":{"id":"resp_1","status":"in_progress","usage":null},"type":"x"}'),
    named("response.output_text.delta", '{"delta":"say \\"input_tokens\\":7","type":"x"}'),
    named("response.completed", '{"response":{"id":"resp_1","status":"completed",' + RESPONSES_USAGE + '},"type":"x"}'),
]
MESSAGES_STREAM = [
    named("message_start", '{"type":"message_start","message":{"id":"m","usage":{"input_tokens":1042,'
                           '"output_tokens":0}}}'),
    named("content_block_delta", '{"type":"content_block_delta","delta":{"type":"text_delta","text":"hi"}}'),
    named("message_delta", '{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"input_tokens":18,'
                           '"output_tokens":5,"cache_creation_input_tokens":0,"cache_read_input_tokens":1024}}'),
    named("message_stop", '{"type":"message_stop"}'),
]
GENERATE_STREAM = [event('{"text":"' + "x" * k + '","meta_info":{"id":"r","finish_reason":' +
                         ('{"type":"length","length":5}' if k == 5 else "null") +
                         f',"prompt_tokens":1042,"completion_tokens":{k},"cached_tokens":1024}}}}')
                   for k in range(1, 6)]

CASES: dict[str, tuple[str, list[str], str | None, bool]] = {
    # name: (content type, chunks written, what the client must get (None: all of it), usage injected by Cortex)
    "whole events": ("text/event-stream", [ROLE, TOKEN, TRICK, USAGE, DONE], KEPT, True),
    "byte by byte": ("text/event-stream", byte_by_byte(STREAM), KEPT, True),
    "usage key split": ("text/event-stream", split_in_usage_key(STREAM), KEPT, True),
    "crlf events": ("text/event-stream", [e.replace("\n\n", "\r\n\r\n") for e in (ROLE, TOKEN, USAGE, DONE)],
                    (ROLE + TOKEN + DONE).replace("\n\n", "\r\n\r\n"), True),
    "client asked": ("text/event-stream", [ROLE, TOKEN, TRICK, USAGE, DONE], STREAM, False),
    "json answer": ("application/json", ['{"id":"x","choices":[{"index":0,"message":{"content":"ok"}}],',
                                         '"usage":{"prompt_tokens":1042,"completion_tokens":5,"prompt_tokens_details"',
                                         ':{"cached_tokens":1024}},"kv_transfer_params":null}'],
                    None, True),
    "error body": ("application/json", ['{"error":{"message":"bad","code":400}}'], None, True),
    "responses stream": ("text/event-stream", RESPONSES_STREAM, None, False),
    "responses json": ("application/json", ['{"id":"resp_1","object":"response",', RESPONSES_USAGE + "}"], None, False),
    "messages stream": ("text/event-stream", MESSAGES_STREAM, None, False),
    "messages json": ("application/json", ['{"id":"m","type":"message","usage":{"input_tokens":18,"output_tokens":5,'
                                           '"cache_creation_input_tokens":0,"cache_read_input_tokens":1024}}'],
                      None, False),
    "generate stream": ("text/event-stream", [*GENERATE_STREAM, DONE], None, False),
    "generate json": ("application/json", ['{"text":"xxxxx","output_ids":[1,2,3,4,5],"meta_info":{"id":"r",',
                                           '"finish_reason":{"type":"length","length":5},"prompt_tokens":1042,',
                                           '"completion_tokens":5,"cached_tokens":1024}}'], None, False),
}


class Upstream:
    """HTTP/1.1 on a raw socket: each request's path names a case, whose chunks are written apart."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ")[1].decode()
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        ctype, chunks, _, _ = CASES[path.strip("/").replace("_", " ")]
        # `connection: close`: this server closes after each answer, and without the header Envoy keeps the
        # connection pooled and may send the next case down it as it closes (a 503 in a CI run).
        writer.write(f"HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\ntransfer-encoding: chunked\r\n"
                     "connection: close\r\n\r\n".encode())
        await writer.drain()
        for c in chunks:
            data = c.encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(asyncio.start_server(self.handle, "127.0.0.1", self.port),
                                         self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def envoy_config(listen: int, upstream: int, admin: int, log: Path) -> dict[str, Any]:
    fields = ["first_us", "last_us", "chunks", "bytes", "prompt_tokens", "completion_tokens", "cached_tokens"]
    fmt = {"path": "%REQ(:PATH)%", **{f: f"%DYNAMIC_METADATA({OBSERVED}:{f})%" for f in fields}}
    # What extproc would say: the client did not ask for usage, so Cortex did (header set by the test).
    mark = ('function envoy_on_request(h) if h:headers():get("x-injected") == "1" then '
            'h:streamInfo():dynamicMetadata():set("cortex", "usage_injected", true) end end')

    def lua(code: str) -> dict[str, Any]:
        return {"name": "envoy.filters.http.lua", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": code}}}

    hcm = {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "t",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "up"}}]}]},
        "http_filters": [lua(lua_source()), lua(mark), {"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        "access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(log), "log_format": {"json_format": fmt}}}],
    }}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{"name": "l", "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                           "filter_chains": [{"filters": [hcm]}]}],
            "clusters": [{"name": "up", "type": "STATIC", "load_assignment": {"cluster_name": "up", "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                    "address": "127.0.0.1", "port_value": upstream}}}}]}]}}]}}


@pytest.fixture(scope="module")
def envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("lua")
    listen, up_port, admin = free_ports(3)
    upstream = Upstream(up_port)
    upstream.start()
    log = root / "access.log"
    cfg = root / "envoy.yaml"
    cfg.write_text(yaml.safe_dump(envoy_config(listen, up_port, admin, log)))
    proc = subprocess.Popen([envoy_binary(), "-c", str(cfg), "--concurrency", "1", "-l", "warning",
                             "--disable-hot-restart", "--file-flush-interval-msec", "50"],
                            stdout=subprocess.DEVNULL, stderr=(root / "envoy.err").open("wb"), start_new_session=True)
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=1).status_code == 200, timeout=30,
                 what="envoy ready")
        yield f"http://127.0.0.1:{listen}", log
    finally:
        stop(proc)
        upstream.close()
        err = (root / "envoy.err").read_text()
        assert "script log" not in err, err  # the filter never failed


def logged(log: Path, path: str) -> dict[str, Any]:
    def entry() -> dict[str, Any] | None:
        if not log.exists():
            return None
        docs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        return next((d for d in docs if d["path"] == path), None)

    wait_for(lambda: entry() is not None, timeout=10, what=f"access log line for {path}")
    found = entry()
    assert found is not None
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_the_client_gets_the_stream_without_the_injected_usage_and_the_usage_is_read(
        envoy: tuple[str, Path], case: str) -> None:
    url, log = envoy
    _, chunks, expected, injected = CASES[case]
    path = "/" + case.replace(" ", "_")
    t0 = time.time()
    r = httpx.post(url + path, json={"stream": True}, headers={"x-injected": "1" if injected else "0"}, timeout=10)
    assert r.status_code == 200
    sent = "".join(chunks)
    assert r.text == (expected if expected is not None else sent)
    doc = logged(log, path)
    if case == "error body":
        assert doc["prompt_tokens"] is None and doc["cached_tokens"] is None
    else:
        assert (doc["prompt_tokens"], doc["completion_tokens"], doc["cached_tokens"]) == (1042, 5, 1024)
    assert doc["bytes"] == len(r.content)
    assert t0 * 1e6 <= doc["first_us"] <= doc["last_us"] <= time.time() * 1e6
