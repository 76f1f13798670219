"""What one Cortex replica costs while it watches workers that it sends nothing to (issue 12).

Starts K simulated vLLM workers (``cortex sim``) and one ``cortex run`` in front of them, sends a short warm-up
(a few requests, so every worker has served once), then measures over a fixed window:

* idle: nothing sent through this replica, the workers idle (a standby replica behind a balancer, or any
  replica at night);
* light: one request every ``--light-interval`` seconds through this replica, spread round robin;
* busy-elsewhere: the workers loaded by traffic that does not pass this replica (another replica, or clients
  going straight to a worker), one request at a time per worker, nothing through this replica.

For each it prints the gateway's CPU (user + system, from /proc, by part: envoy, extproc, ingest, and the
supervisor as `other`) in CPU milliseconds per wall second, and per worker watched; the workers' own CPU is
reported apart (it includes answering the replica's load polls). Also the /metrics reads each worker answered
per second (the simulator counts its HTTP requests) and, for the traffic phases, the requests completed (the
busy-elsewhere cost follows the workers' throughput, which a shared machine moves). Numbers only, nothing
asserted. Bounded in count and time; loopback only.

    python perf/idle_replica.py                      # K = 4 and 8; 30 s idle, 15 s per traffic phase
    python perf/idle_replica.py --workers 4 --window 10
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from cortexbench import launch

MODEL = launch.MODEL


def _cpu(procs: launch.Procs) -> dict[str, float]:
    return procs.cpu_seconds()


def _metrics_reads(workers: list[launch.Worker]) -> int:
    total = 0
    for w in workers:
        status, doc = launch.http("GET", f"{w.url}/sim/requests")
        if status == 200 and isinstance(doc, dict):
            total += int(doc.get("paths", {}).get("/metrics", 0))
    return total


def _chat(url: str, i: int, max_tokens: int = 8) -> None:
    launch.http("POST", f"{url}/v1/chat/completions", {
        "model": MODEL, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"light traffic {i}: " + "lorem ipsum " * 40}]}, timeout=30)


def _window(gateway: launch.Procs, sims: launch.Procs, workers: list[launch.Worker], seconds: float,
            load: threading.Thread | None = None, done: list[int] | None = None) -> dict[str, float]:
    g0, s0, m0, t0 = _cpu(gateway), _cpu(sims), _metrics_reads(workers), time.monotonic()
    if load is not None:
        load.start()
    time.sleep(seconds)
    g1, s1, m1, t1 = _cpu(gateway), _cpu(sims), _metrics_reads(workers), time.monotonic()
    if load is not None:
        load.join()
    wall = t1 - t0
    out = {part: (g1.get(part, 0.0) - g0.get(part, 0.0)) * 1000 / wall for part in sorted(set(g1) | set(g0))}
    out["gateway"] = sum(out.values())
    out["workers"] = (sum(s1.values()) - sum(s0.values())) * 1000 / wall
    out["metrics_reads_per_s"] = (m1 - m0) / wall
    out["requests"] = float(sum(done or []))
    return out


def _print(label: str, k: int, row: dict[str, float]) -> None:
    parts = " ".join(f"{p}={row.get(p, 0.0):6.1f}" for p in ("envoy", "extproc", "ingest", "other"))
    per_req = f" | {row['requests']:.0f} requests" if row["requests"] else ""
    print(f"K={k:<2} {label:<15} gateway {row['gateway']:6.1f} ms/s ({row['gateway'] / k:5.2f} per worker) | "
          f"{parts} | workers {row['workers']:6.1f} ms/s | /metrics reads {row['metrics_reads_per_s']:5.1f}/s"
          f"{per_req}", flush=True)


def run(k: int, idle_window: float, window: float, light_interval: float, root: Path) -> None:
    with launch.Procs(root) as sims, launch.Procs(root) as gateway:
        workers = launch.start_workers(sims, launch.ClusterSpec(workers=k))
        url = launch.start_cortex(gateway, workers, events=True)
        for i in range(2 * k):  # warm-up: every worker serves at least once (round robin on an empty ledger)
            _chat(url, i)
        time.sleep(3.0)  # let the warm-up's effects (fast polling, events) settle
        _print("idle", k, _window(gateway, sims, workers, idle_window))
        done = [0]

        def light() -> None:
            deadline = time.monotonic() + window
            while time.monotonic() < deadline:
                _chat(url, 1000 + done[0])
                done[0] += 1
                time.sleep(light_interval)

        row = _window(gateway, sims, workers, window, threading.Thread(target=light), done)
        _print(f"light 1/{light_interval:g}s", k, row)
        time.sleep(3.0)

        counts = [0] * k

        def elsewhere() -> None:
            deadline = time.monotonic() + window
            threads = []
            for n, w in enumerate(workers):
                def direct(n: int = n, w: launch.Worker = w) -> None:
                    while time.monotonic() < deadline:
                        _chat(w.url, 5000 + counts[n], max_tokens=32)
                        counts[n] += 1
                threads.append(threading.Thread(target=direct))
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        row = _window(gateway, sims, workers, window, threading.Thread(target=elsewhere), counts)
        _print("busy-elsewhere", k, row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, action="append", help="K (repeatable); default 4 and 8")
    ap.add_argument("--idle-window", type=float, default=30.0, help="seconds measured idle (default 30)")
    ap.add_argument("--window", type=float, default=15.0, help="seconds measured per traffic phase (default 15)")
    ap.add_argument("--light-interval", type=float, default=1.0, help="seconds between light-traffic requests")
    args = ap.parse_args()
    if not (1 <= args.window <= 300 and 1 <= args.idle_window <= 300):
        ap.error("--window and --idle-window must be within 1..300 s")
    for k in args.workers or [4, 8]:
        if not 1 <= k <= 32:
            ap.error("--workers must be within 1..32")
        with tempfile.TemporaryDirectory(prefix="idle-replica-") as tmp:
            run(k, args.idle_window, args.window, args.light_interval, Path(tmp))


if __name__ == "__main__":
    main()
