"""The per-stream floor of an ext_proc server in Python: what Envoy + gRPC cost with no Cortex code at all.

One Envoy (the binary Cortex runs) with two listeners in front of one tiny upstream: one listener plain, one
with an ext_proc filter set up as Cortex's (request headers SEND, body BUFFERED sent without waiting for the
headers answer, response headers SEND, route cache cleared by the body answer). The ext_proc server answers
each message at once with what Cortex's answers look like (an empty headers answer, a body answer with one
header mutation, a response-headers answer adding one header), so what is measured is Envoy's ext_proc client,
the gRPC stream and Python's gRPC server, per request. Requests alternate between the two listeners, one at a
time, on kept-alive connections; "added" is the p50 (p90) difference. Server stacks (`--stacks`):

- `aio-generator`: grpc.aio, the handler an async generator over the request iterator (Cortex's);
- `aio-read-write`: grpc.aio, `context.read()` / `context.write()` in a plain coroutine;
- `sync-threads`: grpcio's thread-pool server, a generator handler;
- `aio-uvloop`: `aio-generator` on uvloop, as extproc runs;
- `grpclib`, `grpclib-uvloop`: grpclib's pure-Python HTTP/2 server on the asyncio loop, no gRPC threads (only when
  grpclib is installed: it is not a Cortex dependency);
- `authz-http`: not ext_proc: Envoy's ext_authz filter with an HTTP service (the buffered body sent along, the
  route cache cleared, one header taken from the answer onto the upstream request), answered by an aiohttp
  server on uvloop: one HTTP/1.1 exchange per request and no gRPC at all;
- `lua-http`: the same exchange made by a Lua filter (`httpCall` with the buffered body, then `clearRouteCache`).

gRPC's C-core settings are Cortex's (cortex/grpc_runtime.py) unless `GRPC_EXPERIMENTS` is set: run with
`GRPC_EXPERIMENTS=` (empty) for grpcio's own defaults. `--gap-ms` pauses between requests, so that
gRPC's threads sleep between messages as they do at a gateway's request rates rather than back to back.

    python perf/extproc_floor.py [--requests 400] [--stacks aio-generator,aio-read-write,sync-threads] [--gap-ms 50]

Loopback only; bounded (requests x 2 per stack), about 10 s per stack.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import importlib.util
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import yaml
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from procstat import cpu_seconds

from cortex import grpc_runtime
from cortex.envoy_config import envoy_binary
from tests.harness import free_ports

HOST = "127.0.0.1"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def _mutation(key: str, value: bytes) -> pb.HeaderMutation:
    return pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value))])


HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
BODY = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
    header_mutation=_mutation("x-worker", b"w1"), clear_route_cache=True)))
RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
    header_mutation=_mutation("x-cortex-worker", b"w1"))))
ANSWERS = {"request_headers": HEADERS, "request_body": BODY, "response_headers": RESPONSE_HEADERS}


def answer(req: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
    return ANSWERS.get(req.WhichOneof("request") or "")


async def aio_generator(requests: AsyncIterator[pb.ProcessingRequest], _ctx: Any) -> AsyncIterator[Any]:
    async for req in requests:
        if (a := answer(req)) is not None:
            yield a


async def aio_read_write(_requests: Any, ctx: grpc.aio.ServicerContext) -> None:
    while (req := await ctx.read()) is not grpc.aio.EOF:
        if (a := answer(req)) is not None:
            await ctx.write(a)


def sync_generator(requests: Iterator[pb.ProcessingRequest], _ctx: Any) -> Iterator[Any]:
    for req in requests:
        if (a := answer(req)) is not None:
            yield a


def _handler(fn: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {"Process": grpc.stream_stream_rpc_method_handler(
        fn, request_deserializer=pb.ProcessingRequest.FromString,
        response_serializer=pb.ProcessingResponse.SerializeToString)})


def serve_extproc(stack: str, port: int) -> None:
    if stack == "sync-threads":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        server.add_generic_rpc_handlers((_handler(sync_generator),))
        server.add_insecure_port(f"{HOST}:{port}")
        server.start()
        server.wait_for_termination()
        return

    async def run() -> None:
        aserver = grpc.aio.server()
        aserver.add_generic_rpc_handlers((_handler(aio_read_write if stack == "aio-read-write" else aio_generator),))
        aserver.add_insecure_port(f"{HOST}:{port}")
        await aserver.start()
        await aserver.wait_for_termination()

    async def run_grpclib() -> None:
        from grpclib.const import Cardinality, Handler
        from grpclib.server import Server

        class Service:
            def __mapping__(self) -> dict[str, Handler]:
                return {f"/{SERVICE}/Process": Handler(self.process, Cardinality.STREAM_STREAM,
                                                       pb.ProcessingRequest, pb.ProcessingResponse)}

            async def process(self, stream: Any) -> None:
                async for req in stream:
                    if (a := answer(req)) is not None:
                        await stream.send_message(a)

        srv = Server([Service()])
        await srv.start(HOST, port)
        await srv.wait_closed()

    if stack.endswith("uvloop"):
        import uvloop
        uvloop.install()
    asyncio.run(run_grpclib() if stack.startswith("grpclib") else run())


def serve_callout(port: int) -> None:
    """The HTTP stacks' decision server: reads the body (as a decision must) and names the worker."""
    import uvloop

    async def decide(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(headers={"x-worker": "w1", "x-cortex-worker": "w1"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", decide)
    uvloop.install()
    web.run_app(app, host=HOST, port=port, print=None, access_log=None)


def serve_upstream(port: int) -> None:
    async def ok(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/{tail:.*}", ok)
    web.run_app(app, host=HOST, port=port, print=None, access_log=None)


LUA = """
function envoy_on_request(h)
  local body = h:body()
  local bytes = body and body:getBytes(0, body:length()) or ""
  local answer = h:httpCall("extproc", {[":method"] = "POST", [":path"] = "/decide", [":authority"] = "decide",
                                        ["content-type"] = "application/json"}, bytes, 5000)
  h:headers():replace("x-worker", answer["x-worker"] or "")
  h:clearRouteCache()
end
"""


def authz_filter(cluster: str, path_prefix: str, upstream: tuple[str, ...], client: tuple[str, ...] = (),
                 max_body: int = 16 << 20) -> dict[str, Any]:
    """Envoy's ext_authz asking `cluster` over HTTP with the buffered body; the answer's `upstream` headers go onto
    the upstream request (the route cache cleared, so they can route it), its `client` headers onto the response."""
    response: dict[str, Any] = {"allowed_upstream_headers": {"patterns": [{"exact": h} for h in upstream]}}
    if client:
        response["allowed_client_headers_on_success"] = {"patterns": [{"exact": h} for h in client]}
    return {"name": "envoy.filters.http.ext_authz", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
        "transport_api_version": "V3", "clear_route_cache": True,
        "with_request_body": {"max_request_bytes": max_body, "allow_partial_message": False},
        "http_service": {"server_uri": {"uri": f"http://{HOST}/", "cluster": cluster, "timeout": "10s"},
                         "path_prefix": path_prefix, "authorization_response": response}}}


def _callout_filter(stack: str) -> dict[str, Any]:
    if stack == "lua-http":
        return {"name": "envoy.filters.http.lua", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": LUA}}}
    return authz_filter("extproc", "/decide", ("x-worker",), ("x-cortex-worker",))


def envoy_config(plain: int, extproc: int, upstream: int, grpc_port: int, stack: str = "") -> dict[str, Any]:
    def listener(name: str, port: int, filters: list[dict[str, Any]]) -> dict[str, Any]:
        router = {"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
        return {"name": name, "address": {"socket_address": {"address": HOST, "port_value": port}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                     "HttpConnectionManager",
            "stat_prefix": name,
            "route_config": {"virtual_hosts": [{"name": name, "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "route": {"cluster": "upstream"}}]}]},
            "http_filters": [*filters, router]}}]}]}

    ext_proc = {"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "extproc"}}, "message_timeout": "5s",
        "route_cache_action": "CLEAR", "send_body_without_waiting_for_header_response": True,
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                            "response_header_mode": "SEND", "response_body_mode": "NONE",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}}}

    def cluster(name: str, port: int, h2: bool) -> dict[str, Any]:
        c: dict[str, Any] = {"name": name, "type": "STATIC", "load_assignment": {"cluster_name": name, "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": HOST, "port_value": port}}}}]}]}}
        if h2:
            c["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}}
        return c

    return {"static_resources": {
        "listeners": [listener("plain", plain, []),
                      listener("extproc", extproc, [_callout_filter(stack) if stack in HTTP_STACKS else ext_proc])],
        "clusters": [cluster("upstream", upstream, False), cluster("extproc", grpc_port, stack not in HTTP_STACKS)]}}


HTTP_STACKS = ("authz-http", "lua-http")



def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))] * 1000


def wait_port(port: int, deadline_s: float = 15.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            c = http.client.HTTPConnection(HOST, port, timeout=1)
            c.request("POST", "/v1/completions", b"{}")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing answers on {HOST}:{port}")


def measure(stack: str, requests: int, gap_s: float = 0.0, prompt_chars: int = 0) -> dict[str, float]:
    plain, via, upstream, grpc_port, admin = free_ports(5)
    ctx = mp.get_context("spawn")
    up = ctx.Process(target=serve_upstream, args=(upstream,), daemon=True)
    if stack in HTTP_STACKS:
        ep = ctx.Process(target=serve_callout, args=(grpc_port,), daemon=True)
    else:
        ep = ctx.Process(target=serve_extproc, args=(stack, grpc_port), daemon=True)
    up.start()
    ep.start()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = envoy_config(plain, via, upstream, grpc_port, stack)
        cfg["admin"] = {"address": {"socket_address": {"address": HOST, "port_value": admin}}}
        path = Path(tmp) / "envoy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        envoy = subprocess.Popen([envoy_binary(), "-c", str(path), "--concurrency", "2", "-l", "error",
                                  "--disable-hot-restart"])
        try:
            wait_port(plain)
            wait_port(via)
            prompt: Any = ("lorem ipsum " * (prompt_chars // 12 + 1))[:prompt_chars] or list(range(21))
            body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
            conns = {"plain": http.client.HTTPConnection(HOST, plain), "via": http.client.HTTPConnection(HOST, via)}
            lat: dict[str, list[float]] = {"plain": [], "via": []}

            def one(name: str) -> float:
                t = time.perf_counter()
                conns[name].request("POST", "/v1/completions", body, {"content-type": "application/json"})
                r = conns[name].getresponse()
                r.read()
                if r.status != 200:
                    raise RuntimeError(f"{name}: HTTP {r.status}")
                return time.perf_counter() - t

            for _ in range(50):  # warm both paths: connections, gRPC stream setup, caches
                one("plain")
                one("via")
            assert ep.pid is not None
            cpu0, env0 = cpu_seconds(ep.pid), cpu_seconds(envoy.pid)
            for _ in range(requests):
                lat["via"].append(one("via"))
                lat["plain"].append(one("plain"))
                if gap_s:
                    time.sleep(gap_s)
            cpu1, env1 = cpu_seconds(ep.pid), cpu_seconds(envoy.pid)
        finally:
            envoy.terminate()
            envoy.wait(10)
            for p in (up, ep):
                p.terminate()
                p.join(10)
    return {"plain_p50": pct(lat["plain"], .5), "via_p50": pct(lat["via"], .5),
            "added_p50": pct(lat["via"], .5) - pct(lat["plain"], .5),
            "added_p90": pct(lat["via"], .9) - pct(lat["plain"], .9),
            "extproc_cpu_ms": 1000 * (cpu1 - cpu0) / requests, "envoy_cpu_ms": 1000 * (env1 - env0) / (2 * requests)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per path and stack (bounded)")
    ap.add_argument("--stacks", default="aio-generator,aio-read-write,sync-threads")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="pause after each pair of requests: a request rate such as a gateway's, where gRPC's threads "
                         "sleep between messages (default 0: back to back)")
    ap.add_argument("--prompt-chars", type=int, default=0,
                    help="send a text prompt of this many characters (default: 21 token ids)")
    args = ap.parse_args()
    grpc_runtime.configure()  # the servers start in spawned processes, which read it at their grpc's start
    print(f"decision-exchange floor, ms (load average {os.getloadavg()[0]:.1f}; "
          f"GRPC_EXPERIMENTS={os.environ[grpc_runtime.ENV]!r}); {args.requests} requests per path, one at a time, "
          f"{args.gap_ms:g} ms apart, prompt {args.prompt_chars or '21 ids'} chars")
    print(f"{'stack':>15} | {'plain p50':>9} {'via p50':>8} | {'added p50':>9} {'added p90':>9} | "
          f"{'extproc CPU ms/req':>18} {'envoy CPU ms/req':>16}")
    for stack in args.stacks.split(","):
        if stack.startswith("grpclib") and importlib.util.find_spec("grpclib") is None:
            print(f"{stack:>15} | skipped: grpclib is not installed")
            continue
        r = measure(stack, min(args.requests, 5000), args.gap_ms / 1000, args.prompt_chars)
        print(f"{stack:>15} | {r['plain_p50']:>9.3f} {r['via_p50']:>8.3f} | {r['added_p50']:>9.3f} "
              f"{r['added_p90']:>9.3f} | {r['extproc_cpu_ms']:>18.2f} {r['envoy_cpu_ms']:>16.2f}")
    print("envoy CPU is per request over both listeners (half the requests have no ext_proc)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
