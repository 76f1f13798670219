"""What the response observation costs: the same streamed and JSON requests through a gateway with
`observe.enabled` off and on, the CPU of each process per request and per streamed token, and the TTFT
clients see.

One simulated vLLM worker with zero compute time (so the gateway's work is what is measured), a fresh gateway
per setting, then for each answer length (`--tokens`) N requests one at a time: the CPU each gateway process
(Envoy, extproc, observer) spent over the run, divided by the requests and by the tokens streamed. Two
lengths separate the per-request part from the per-token part (a line through the two points).

    python perf/bench_observe.py [--requests 200] [--tokens 16,256] [--rounds 2]

Loopback only; bounded (requests x lengths x settings x rounds), about two minutes here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from procstat import cpu_seconds

from cortexsim.timing import ZERO_COST_ARGS
from tests.harness import MODEL, Gateway, cluster, long_chat

SIM_ARGS = ZERO_COST_ARGS



def children(gw: Gateway) -> dict[str, int]:
    """The gateway's processes by part (cmdline), found under its supervisor."""
    assert gw.proc is not None
    out: dict[str, int] = {}
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            stat = (pid_dir / "stat").read_text()
            cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid != gw.proc.pid:
            continue
        for part in ("envoy", "extproc", "observe", "ingest"):
            if f" {part} " in f" {cmd} " or (part == "envoy" and "/envoy " in cmd):
                out[part] = int(pid_dir.name)
    return out


def run(gw: Gateway, tokens: int, n: int, stream: bool) -> dict[str, Any]:
    pids = children(gw)
    chat = long_chat(200, seed=tokens)
    body = {"model": MODEL, "messages": chat, "max_tokens": tokens, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=60) as client:
        for _ in range(10):  # warm: connections, caches, the chat's blocks
            client.post(f"{gw.url}/v1/chat/completions", json=body).read()
        before = {p: cpu_seconds(pid) for p, pid in pids.items()}
        ttfts, got = [], 0
        t0 = time.perf_counter()
        for _ in range(n):
            start = time.perf_counter()
            with client.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r:
                first = None
                for chunk in r.iter_raw():
                    if first is None:
                        first = time.perf_counter() - start
                    got += chunk.count(b"data: {") if stream else 0
                ttfts.append(first or 0.0)
        wall = time.perf_counter() - t0
        after = {p: cpu_seconds(pid) for p, pid in pids.items()}
    return {"cpu_ms_per_request": {p: 1000 * (after[p] - before[p]) / n for p in pids},
            "ttft_p50_ms": 1000 * statistics.median(ttfts), "wall_s": wall, "events": got}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", default="16,256", help="answer lengths (exactly this many tokens each)")
    ap.add_argument("--rounds", type=int, default=2, help="off/on alternations")
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    n = min(args.requests, 2000)
    results: dict[tuple[bool, int, bool], list[dict[str, Any]]] = {}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for enabled in (False, True):
            with tempfile.TemporaryDirectory() as tmp, cluster(
                    Path(tmp), n_sims=1, sim_args=SIM_ARGS,
                    extra_config={"observe": {"enabled": enabled, "request_log_path": str(Path(tmp) / "req.log")},
                                  "extproc": {"prediction_ttl_s": 0}}) as gw:
                for stream in (False, True):
                    for tokens in lengths:
                        results.setdefault((enabled, tokens, stream), []).append(run(gw, tokens, n, stream))
    print(f"observation cost, {n} requests per cell, {args.rounds} round(s) off/on alternately "
          f"(load average {load:.1f} before, {os.getloadavg()[0]:.1f} after); CPU ms per request, median of rounds")
    print(f"{'answer':>12} {'tokens':>6} {'observe':>7} | {'envoy':>6} {'extproc':>7} {'observer':>8} "
          f"{'total':>6} | {'TTFT p50 ms':>11} {'SSE events/req':>14}")
    for stream in (False, True):
        for tokens in lengths:
            for enabled in (False, True):
                runs = results[(enabled, tokens, stream)]
                cpu = {p: statistics.median(r["cpu_ms_per_request"].get(p, 0.0) for r in runs)
                       for p in ("envoy", "extproc", "observe")}
                ttft = statistics.median(r["ttft_p50_ms"] for r in runs)
                events = statistics.median(r["events"] for r in runs) / n
                print(f"{'SSE' if stream else 'JSON':>12} {tokens:>6} {'on' if enabled else 'off':>7} | "
                      f"{cpu['envoy']:>6.3f} {cpu['extproc']:>7.3f} {cpu['observe']:>8.3f} "
                      f"{sum(cpu.values()):>6.3f} | {ttft:>11.2f} {events:>14.1f}")
    # Per streamed token: the slope between the two lengths of what "on" adds over "off".
    if len(lengths) >= 2:
        lo, hi = lengths[0], lengths[-1]

        def added(tokens: int, part: str) -> float:
            on = statistics.median(r["cpu_ms_per_request"].get(part, 0.0) for r in results[(True, tokens, True)])
            off = statistics.median(r["cpu_ms_per_request"].get(part, 0.0) for r in results[(False, tokens, True)])
            return on - off

        for part in ("envoy", "observe"):
            per_token = (added(hi, part) - added(lo, part)) / (hi - lo)
            print(f"streams: observation adds {added(lo, part):.3f} ms ({lo} tokens) and {added(hi, part):.3f} ms "
                  f"({hi} tokens) of {part} CPU per request: ~{per_token * 1000:.2f} µs per streamed token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
