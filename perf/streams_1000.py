"""1,000 concurrent SSE streams held through the gateway, and slow clients: memory of each Cortex process.

Starts four simulated vLLM workers (slow decode, so a stream stays open: `--decode-ms-per-token`, default
500 ms, i.e. 2 tokens/s per stream) behind a real `cortex run` (Envoy + ingest + 2 extproc processes), then:

1. streams: `--streams` (1,000) SSE chat streams opened within `--ramp-s` seconds and held until the
   worker finishes (`--max-tokens`, default 40: about 20 s each); every stream is read to `[DONE]`; then
   the same again (`--rounds`, default 2), to tell memory kept for reuse from a leak.
   RSS of envoy, each extproc and ingest is read before, every second while they are held (peak), and
   after they closed.
2. slow clients: `--slow` (200) streams of `--slow-max-tokens` (60) whose client reads one SSE chunk a
   second while the worker sends two: the excess waits in socket buffers and the client, and must not grow
   the gateway. RSS is sampled at their start, every second, and at the end.

Bounded: fixed counts, a deadline per stream (`--deadline-s`); loopback only. The soft file-descriptor
limit is raised to the hard one (each stream is three sockets: client, Envoy downstream, Envoy upstream).

    python perf/streams_1000.py [--streams 1000] [--slow 200] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cortex import headers as H
from tests.faultkit import gateway_rss
from tests.harness import MODEL, Gateway, cluster, long_chat


def raise_fd_limit(need: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < need:
        raise SystemExit(f"need ~{need} file descriptors, the limit is {soft} (raise `ulimit -Hn`)")
    return soft


@dataclass
class Stream:
    ok: bool = False
    status: int = 0
    chunks: int = 0
    claimed: int | None = None
    cached: int | None = None
    error: str = ""


class Run:
    def __init__(self, gw: Gateway, args: argparse.Namespace) -> None:
        self.gw, self.args = gw, args
        self.open_now = 0
        self.open_peak = 0
        bases = [long_chat(150, seed=9000 + i) for i in range(10)]
        self.prompts = [[*bases[i % 10][:1], {"role": "user", "content": f"Question {i}: say something."}]
                        for i in range(max(args.streams, args.slow, 20))]

    async def stream(self, session: aiohttp.ClientSession, i: int, delay: float, read_every_s: float) -> Stream:
        await asyncio.sleep(delay)
        s = Stream()
        max_tokens = self.args.slow_max_tokens if read_every_s else self.args.max_tokens
        body = {"model": MODEL, "messages": self.prompts[i], "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            async with asyncio.timeout(self.args.deadline_s), \
                    session.post(f"{self.gw.url}/v1/chat/completions", json=body) as r:
                s.status = r.status
                opened = time.monotonic()
                self.open_now += 1
                self.open_peak = max(self.open_peak, self.open_now)
                try:
                    hit = r.headers.get(H.CACHE_HIT_TOKENS)
                    s.claimed = int(hit) if hit is not None else None
                    done = False
                    while line := await r.content.readline():
                        line = line.strip()
                        if not line:
                            continue
                        s.chunks += 1
                        if line == b"data: [DONE]":
                            done = True
                        elif line.startswith(b"data: "):
                            chunk = orjson.loads(line[6:])
                            if chunk.get("usage"):
                                s.cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                        if read_every_s:
                            await asyncio.sleep(read_every_s)
                            if self.args.slow_hold_s and time.monotonic() - opened >= self.args.slow_hold_s:
                                break  # the client gives up (closes) with most of the stream unread
                    held = read_every_s and self.args.slow_hold_s and not done
                    # A stream given up before its usage chunk has no engine figure to compare the claim with.
                    claim_ok = (s.claimed or 0) <= (s.cached or 0) or (bool(held) and s.cached is None)
                    s.ok = r.status == 200 and (done or bool(held)) and claim_ok
                finally:
                    self.open_now -= 1
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            s.error = f"{type(exc).__name__}: {exc}"[:200]
        return s

    async def phase(self, name: str, n: int, read_every_s: float) -> dict[str, Any]:
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        samples: list[dict[str, int]] = []
        before = gateway_rss(self.gw)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
            ramp = self.args.ramp_s
            tasks = [asyncio.create_task(self.stream(session, i, ramp * i / n, read_every_s)) for i in range(n)]
            t0 = time.monotonic()
            while not all(t.done() for t in tasks):
                await asyncio.sleep(1.0)
                samples.append(gateway_rss(self.gw))
                print(f"  {name}: t={time.monotonic() - t0:5.1f}s open={self.open_now:4d} "
                      f"rss MiB={ {k: round(v / 1024, 1) for k, v in samples[-1].items()} }", flush=True)
            results = [t.result() for t in tasks]
        await asyncio.sleep(self.args.settle_s)
        after = gateway_rss(self.gw)
        peak = {k: max(s.get(k, 0) for s in samples) for k in before} if samples else before
        mib = lambda d: {k: round(v / 1024, 1) for k, v in sorted(d.items())}  # noqa: E731
        out = {
            "phase": name, "streams": n, "ok": sum(r.ok for r in results), "open_peak": self.open_peak,
            "seconds": round(time.monotonic() - t0, 1), "chunks": sum(r.chunks for r in results),
            "rss_mib_before": mib(before), "rss_mib_peak": mib(peak), "rss_mib_after": mib(after),
            "errors": [r.error or f"status {r.status}" for r in results if not r.ok][:5],
        }
        if samples and read_every_s:
            # Growth while the slow clients were held: the first full sample against the last one.
            out["rss_mib_first_sample"], out["rss_mib_last_sample"] = mib(samples[0]), mib(samples[-1])
        self.open_peak = 0
        return out


async def main_async(gw: Gateway, args: argparse.Namespace) -> list[dict[str, Any]]:
    run = Run(gw, args)
    # Warm each process once (first-use allocations are not what this measures).
    await run.phase("warmup", 20, 0.0)
    # A second round shows whether what a round leaves behind is kept for reuse (flat) or leaks (grows).
    rows = [await run.phase(f"streams_round_{k + 1}", args.streams, 0.0) for k in range(args.rounds)
            if args.streams]
    if args.slow:
        rows.append(await run.phase("slow_clients", args.slow, 1.0))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of --streams streams, one after the other")
    ap.add_argument("--slow", type=int, default=200, help="slow clients reading one chunk a second (0: skip)")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--slow-max-tokens", type=int, default=60,
                    help="tokens per slow stream: the worker sends them in half the time the client reads them")
    ap.add_argument("--decode-ms-per-token", type=float, default=500.0)
    ap.add_argument("--slow-hold-s", type=float, default=0.0,
                    help="slow clients close after this many seconds (0: read to the end); with a long fast "
                         "stream, what the client left unread piles up somewhere: not in the gateway, we check")
    ap.add_argument("--ramp-s", type=float, default=10.0, help="streams are opened evenly over this many seconds")
    ap.add_argument("--deadline-s", type=float, default=180.0)
    ap.add_argument("--settle-s", type=float, default=5.0, help="wait after a phase before the 'after' reading")
    args = ap.parse_args()
    limit = raise_fd_limit(3 * args.streams + 500)
    print(f"file descriptor soft limit: {limit}", flush=True)
    sim_args = ("--decode-ms-per-token", str(args.decode_ms_per_token), "--max-running", "1000",
                "--num-blocks", "16000")
    with tempfile.TemporaryDirectory(prefix="cortex-streams-") as tmp, \
            cluster(Path(tmp), n_sims=4, replay=True, extproc_processes=2, sim_args=sim_args) as gw:
        rows = asyncio.run(main_async(gw, args))
    for row in rows:
        print("RESULT " + json.dumps(row), flush=True)
    return 0 if all(r["ok"] == r["streams"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
