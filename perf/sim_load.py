"""Load test of the engine simulator itself: N simulated workers under a few hundred concurrent streams.

Starts ``--workers`` ``cortex sim`` processes on loopback, keeps ``--concurrency`` streaming chat requests in
flight (spread round robin, each prompt sharing a system prefix with its worker's others so the cache hits)
until ``--requests`` have completed or ``--max-seconds`` have passed, then prints what the clients saw
(completions, errors, TTFT percentiles, token throughput) and what the simulators cost: their own CPU seconds
(user + system, from /proc) per second of wall time and per thousand streamed tokens. Bounded in count and
time; loopback only.

    python perf/sim_load.py                      # 4 vLLM workers, 256 concurrent, 1024 requests
    python perf/sim_load.py --engine sglang --concurrency 384 --requests 1536
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procstat import cpu_seconds

from cortexbench.launch import free_run

REPO = Path(__file__).resolve().parents[1]
MODEL = "Qwen/Qwen2.5-7B-Instruct"


def free_port() -> int:
    return free_run(1)



def start_workers(n: int, engine: str, extra: list[str]) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    procs, urls = [], []
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for i in range(n):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "cortexsim", "--engine", engine, "--port", str(port),
                                 "--worker-id", f"load-{i}", "--kv-events-port", str(free_port()), *extra],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        procs.append(proc)
        urls.append(f"http://127.0.0.1:{port}")
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("sim ready"):
            raise SystemExit(f"a worker did not start: {line!r}")
    return procs, urls


async def one(http: aiohttp.ClientSession, url: str, i: int, words: int, max_tokens: int,
              ttfts: list[float], tokens: list[int]) -> None:
    shared = " ".join(f"rule{k}" for k in range(words))
    body = {"model": MODEL, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": f"You follow these rules: {shared}"},
                         {"role": "user", "content": f"Request number {i}: answer briefly."}]}
    start = time.monotonic()
    n = 0
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        async for raw in resp.content:
            if not raw.startswith(b"data: {"):
                continue
            chunk = orjson.loads(raw[6:])
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    if n == 0:
                        ttfts.append(time.monotonic() - start)
                    n += 1
    tokens.append(n)


async def drive(urls: list[str], args: argparse.Namespace) -> dict[str, float]:
    ttfts: list[float] = []
    tokens: list[int] = []
    errors = 0
    next_id = 0
    deadline = time.monotonic() + args.max_seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def lane() -> None:
            nonlocal next_id, errors
            while next_id < args.requests and time.monotonic() < deadline:
                i = next_id
                next_id += 1
                try:
                    await one(http, urls[i % len(urls)], i, args.prompt_words, args.max_tokens, ttfts, tokens)
                except (aiohttp.ClientError, RuntimeError, TimeoutError):
                    errors += 1

        started = time.monotonic()
        await asyncio.gather(*(lane() for _ in range(args.concurrency)))
        wall = time.monotonic() - started
    ttfts.sort()
    return {"wall_s": wall, "completed": len(tokens), "errors": errors, "tokens": sum(tokens),
            "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else float("nan"),
            "ttft_p99_ms": 1000 * ttfts[int(0.99 * (len(ttfts) - 1))] if ttfts else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=300, help="size of the shared system prompt")
    p.add_argument("--max-seconds", type=float, default=180.0, help="stop issuing requests after this")
    p.add_argument("sim_args", nargs="*", help="extra flags for every worker (after --)")
    args = p.parse_args()
    procs, urls = start_workers(args.workers, args.engine, args.sim_args)
    try:
        before = [cpu_seconds(proc.pid) for proc in procs]
        result = asyncio.run(drive(urls, args))
        after = [cpu_seconds(proc.pid) for proc in procs]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(15)
    sim_cpu = sum(a - b for a, b in zip(after, before, strict=True))
    wall = result["wall_s"]
    print(f"engine={args.engine} workers={args.workers} concurrency={args.concurrency} "
          f"max_tokens={args.max_tokens} prompt_words={args.prompt_words} cores={os.cpu_count()}")
    print(f"completed={result['completed']} errors={result['errors']} wall={wall:.1f}s "
          f"tokens={result['tokens']} tokens_per_s={result['tokens'] / wall:.0f}")
    print(f"ttft_p50={result['ttft_p50_ms']:.0f}ms ttft_p99={result['ttft_p99_ms']:.0f}ms")
    print(f"simulator_cpu={sim_cpu:.1f}s ({sim_cpu / wall:.2f} cores busy on average, "
          f"{1000 * sim_cpu / max(result['tokens'], 1):.2f} ms CPU per streamed token)")
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
