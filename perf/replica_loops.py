"""Where each Cortex replica's ingest spends its CPU during a `cortex bench` run, by loop (issue 28).

Starts `cortex bench` with the arguments given after `--` (one Cortex contestant; `--replicas N` for N replicas),
waits until the simulated workers have served a few requests of the run, then reads, over a fixed window:

* each replica's `cortex_ingest_loop_cpu_seconds_total{loop=...}` (ingest/loop_cpu.py), summed over the replicas, as
  CPU milliseconds per wall second;
* the `/metrics` reads the workers answered per second (the simulator counts its own requests: all replicas' load
  readings);
* the first replica's event batches, blocks stored and removed, and tail checks (the replay socket asked whether a
  burst's last batch was lost) per second (`/cortex/workers`);
* the load readings the replicas applied per second by source (`cortex_ingest_load_readings_total`: read
  themselves, or a peer's), and at the window's end each of the first replica's targets' poll interval and who
  read its latest reading;
* the requests the workers served per second.

Numbers only, nothing asserted. Bounded: the bench runs a fixed number of requests; every wait has a deadline; the
bench is stopped on exit. Loopback only (the bench's processes bind 127.0.0.1).

    python perf/replica_loops.py --window 20 -- --workload shared-prefix --overhead-probes 0 --sweep-rates off \\
        --replicas 4 --contestant cortex --requests 320
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return bytes(r.read())


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(p.name))
    out, stack = [], [root]
    while stack:
        for kid in children.get(stack.pop(), []):
            out.append(kid)
            stack.append(kid)
    return out


def _replica_configs(root: int) -> list[dict[str, Any]]:
    """The config of every `cortex run` the bench started (each replica's)."""
    configs = []
    for pid in _descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"cortexctl.cli" in b" ".join(argv) and b"run" in argv and b"-c" in argv:
            with open(argv[argv.index(b"-c") + 1].decode()) as f:
                configs.append(yaml.safe_load(f))
    return configs


def _sum_by(ports: list[int], series: str, label: str) -> dict[str, float]:
    """One labelled series of every replica's ingest, summed over the replicas by `label`."""
    out: dict[str, float] = {}
    for port in ports:
        for line in _get(f"http://127.0.0.1:{port}/metrics").decode().splitlines():
            if line.startswith(series + "{"):
                name, value = line.rsplit(" ", 1)
                key = name.split(f'{label}="')[1].split('"')[0]
                out[key] = out.get(key, 0.0) + float(value)
    return out


def _loops(ports: list[int]) -> dict[str, float]:
    return _sum_by(ports, "cortex_ingest_loop_cpu_seconds_total", "loop")


def _readings(ports: list[int]) -> dict[str, float]:
    return _sum_by(ports, "cortex_ingest_load_readings_total", "source")


def _cadence(port: int) -> str:
    doc = json.loads(_get(f"http://127.0.0.1:{port}/cortex/workers"))
    return ", ".join(f"{t['id']} every {t['load'].get('every_s', 0):.2f} s by {t['load'].get('read_by', '?')}"
                     for w in doc["workers"] for t in w["targets"])


def _served(workers: list[str]) -> tuple[int, int]:
    """(/metrics reads, chat requests) every worker answered so far."""
    reads = chats = 0
    for url in workers:
        paths = json.loads(_get(f"{url}/sim/requests"))["paths"]
        reads += int(paths.get("/metrics", 0))
        chats += sum(int(v) for k, v in paths.items() if "completions" in k)
    return reads, chats


def _stream(port: int) -> tuple[int, int, int, int]:
    """(batches, blocks stored, blocks removed, tail checks) of one replica's targets so far."""
    doc = json.loads(_get(f"http://127.0.0.1:{port}/cortex/workers"))
    targets = [t for w in doc["workers"] for t in w["targets"]]
    return (sum(t["batches"] for t in targets), sum(t["blocks_stored"] for t in targets),
            sum(t["blocks_removed"] for t in targets), sum(t["tail_checks"] for t in targets))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured (default %(default)s)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds after the run's first requests")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the `cortex bench` arguments")
    args = ap.parse_args()
    bench_args = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    out = Path(tempfile.mkdtemp(prefix="replica-loops-")) / "bench.json"
    bench = subprocess.Popen([sys.executable, "-m", "cortexctl.cli", "bench", *bench_args, "--json", str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        configs: list[dict[str, Any]] = []
        while time.monotonic() < deadline and bench.poll() is None:
            configs = _replica_configs(bench.pid)
            if configs and all(_ready(c) for c in configs):
                break
            time.sleep(1.0)
        else:
            raise SystemExit("replica_loops: the bench's replicas never became ready")
        ports = [int(c["ingest"]["port"]) for c in configs]
        workers = [str(w["url"]) for w in configs[0]["workers"]]
        first = _served(workers)[1]
        while _served(workers)[1] < first + 10:  # the run's traffic, not the warm-up
            if time.monotonic() > deadline or bench.poll() is not None:
                raise SystemExit("replica_loops: no traffic reached the workers")
            time.sleep(0.5)
        time.sleep(args.settle)
        g0 = _readings(ports)
        l0, (r0, c0), s0, t0 = _loops(ports), _served(workers), _stream(ports[0]), time.monotonic()
        time.sleep(args.window)
        l1, (r1, c1), s1, t1 = _loops(ports), _served(workers), _stream(ports[0]), time.monotonic()
        g1 = _readings(ports)
        el = t1 - t0
        print(f"{len(ports)} replica(s), {len(workers)} workers, window {el:.1f} s; requests served "
              f"{(c1 - c0) / el:.2f}/s; /metrics reads {(r1 - r0) / el:.1f}/s (all replicas)")
        print("replica 1: batches {:.1f}/s, blocks stored {:.1f}/s, removed {:.1f}/s, tail checks {:.1f}/s".format(
            *((b - a) / el for a, b in zip(s0, s1, strict=True))))
        if g1:
            print("load readings applied /s, all replicas: " + ", ".join(
                f"{k} {(g1[k] - g0.get(k, 0.0)) / el:.1f}" for k in sorted(g1)))
        print(f"replica 1's targets: {_cadence(ports[0])}")
        per = {k: 1000 * (l1[k] - l0[k]) / el for k in l1}
        print("ingest CPU ms/s, summed over replicas: " + ", ".join(f"{k} {v:.1f}" for k, v in per.items())
              + f"; total {sum(per.values()):.1f}")
    finally:
        if bench.poll() is None:
            bench.send_signal(signal.SIGINT)  # the bench stops what it started
            try:
                bench.wait(60)
            except subprocess.TimeoutExpired:
                bench.kill()


def _ready(cfg: dict[str, Any]) -> bool:
    try:
        _get(f"http://127.0.0.1:{cfg['ingest']['port']}/metrics")
    except OSError:
        return False
    return True


if __name__ == "__main__":
    main()
