"""Cortex's gRPC settings (cortex/grpc_runtime.py) against grpcio's defaults, side by side in one window.

Two `cortex run` gateways over the same simulated vLLM workers: one started with Cortex's default
`GRPC_EXPERIMENTS`, one with the variable set empty (grpcio's own defaults). Requests alternate between them, one
at a time, so that both see the same machine at the same moment (on a shared 2-core VM the machine's speed moves
more between runs than this setting does). Each request is a short chat with its own text (a new prompt, decided
in full). Per gateway it prints the CPU per request of each process kind (/proc, ms) and the p50 / p90 of the
request's latency, in phases: back to back, then `--gap-ms` apart (gRPC's threads sleep between messages, as at a
gateway's usual request rates).

    python perf/grpc_runtime_ab.py [--workers 4] [--seconds 20] [--gap-ms 50] [--rounds 2]

Loopback only; bounded by time (each phase `--seconds` per round).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cortex import grpc_runtime
from cortexbench import launch

MODEL = launch.MODEL


def _chat(url: str, i: int) -> float:
    t = time.perf_counter()
    status, _ = launch.http("POST", f"{url}/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": f"request {i}: " + "lorem ipsum dolor " * 30}]}, timeout=30)
    if status != 200:
        raise RuntimeError(f"HTTP {status} from {url}")
    return (time.perf_counter() - t) * 1000


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0, help="per phase and round")
    ap.add_argument("--gap-ms", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    names = {"cortex": "Cortex's settings", "grpc-defaults": "GRPC_EXPERIMENTS empty"}
    with tempfile.TemporaryDirectory() as tmp, launch.Procs(Path(tmp)) as sims:
        workers = launch.start_workers(sims, launch.ClusterSpec(workers=args.workers))
        with launch.Procs(Path(tmp)) as a, launch.Procs(Path(tmp)) as b:
            os.environ.pop(grpc_runtime.ENV, None)
            urls = {"cortex": launch.start_cortex(a, workers, events=True, name="cortex")}
            os.environ[grpc_runtime.ENV] = ""
            urls["grpc-defaults"] = launch.start_cortex(b, workers, events=True, name="grpc-defaults")
            os.environ.pop(grpc_runtime.ENV)
            groups = {"cortex": a, "grpc-defaults": b}
            n = 0
            for _ in range(2 * args.workers):  # warm-up: templates, tokenizers, every worker served once
                for url in urls.values():
                    _chat(url, n)
                    n += 1
            print(f"{args.workers} workers; load average {os.getloadavg()[0]:.1f}")
            for rnd in range(1, args.rounds + 1):
                for gap in (0.0, args.gap_ms / 1000):
                    lat: dict[str, list[float]] = {k: [] for k in urls}
                    cpu0 = {k: g.cpu_seconds() for k, g in groups.items()}
                    end = time.monotonic() + args.seconds
                    while time.monotonic() < end:
                        for k, url in urls.items():
                            lat[k].append(_chat(url, n))
                            n += 1
                            if gap:
                                time.sleep(gap)
                    cpu1 = {k: g.cpu_seconds() for k, g in groups.items()}
                    for k in urls:
                        count = len(lat[k])
                        parts = {p: (cpu1[k][p] - cpu0[k].get(p, 0.0)) * 1000 / count for p in cpu1[k]}
                        split = " ".join(f"{p}={v:.2f}" for p, v in sorted(parts.items()))
                        print(f"round {rnd}, {gap * 1000:3.0f} ms apart, {names[k]:>22}: {count} requests, CPU ms/req "
                              f"{sum(parts.values()):.2f} ({split}); latency p50 / p90 {_pct(lat[k], .5):.2f} / "
                              f"{_pct(lat[k], .9):.2f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
