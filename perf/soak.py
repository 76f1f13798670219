"""Soak: N minutes of mixed traffic through a real gateway with faults injected periodically.

Three simulated vLLM workers (with replay endpoints, a small KV pool so blocks get evicted) behind a real
`cortex run` (Envoy + ingest + 2 extproc processes). `--threads` clients send shared-prefix multi-turn chats,
alternately SSE and JSON, without pause. Every `--fault-every` seconds the next fault of the cycle is
injected:

* worker_restart: a worker is SIGKILLed and restarted 2 s later at the same URL with an empty cache;
* event_drops: a worker drops 30% of its KV-event batches for 20 s;
* extproc_kill: one extproc process is SIGKILLed (the supervisor restarts it).

Every minute it prints the RSS of each Cortex process and the counts so far; `errors` counts every broken
promise (tests/faultkit.py), split into `failed` (a request failed other than one in flight on a killed
worker) and `overclaims` (a claimed hit above the engine's own `cached_tokens`). Chats grow by a turn now
and then and end after `--max-turns` turns (a new one takes their place), so the working set stays about
the size of the KV pools. The last line is a JSON summary.

    python perf/soak.py [--minutes 30] [--threads 4] [--fault-every 60]

Loopback only; bounded by --minutes (traffic stops, then everything is stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.faultkit import Traffic, gateway_rss, killed_mid_flight, violation
from tests.harness import Gateway, cluster, start_sim

FAULTS = ("worker_restart", "event_drops", "extproc_kill")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Soak:
    def __init__(self, gw: Gateway, args: argparse.Namespace) -> None:
        self.gw, self.args = gw, args
        self.kills: dict[str, list[float]] = {}
        self.counts = {"requests": 0, "ok": 0, "excused": 0, "errors": 0, "exact_kv": 0, "claimed_tokens": 0,
                       "cached_tokens": 0, "connect_retries": 0, "unrouted": 0, "failed": 0, "overclaims": 0,
                       "overclaimed_tokens": 0}
        self.faults: dict[str, int] = dict.fromkeys(FAULTS, 0)
        self.examples: list[str] = []
        self.rng = random.Random(args.seed)
        self.drop_until: tuple[str, float] | None = None

    def account(self, traffic: Traffic) -> None:
        excuse = killed_mid_flight(self.kills)
        for o in traffic.drain():
            c = self.counts
            c["requests"] += 1
            c["connect_retries"] += o.connect_retries
            v = violation(o, excuse)
            if v is not None:
                c["errors"] += 1
                if o.completed:  # (b): the claim exceeded what the engine reported
                    c["overclaims"] += 1
                    c["overclaimed_tokens"] += (o.claimed or 0) - (o.cached or 0)
                else:  # (a): a request failed that no fault excuses
                    c["failed"] += 1
                if len(self.examples) < 10:
                    self.examples.append(v)
                    log(f"ERROR {v}")
            elif o.completed:
                c["ok"] += 1
                c["exact_kv"] += o.mode == "exact_kv_events"
                c["unrouted"] += o.claimed is None  # Envoy's fail-open route (extproc restarting)
                c["claimed_tokens"] += o.claimed or 0
                c["cached_tokens"] += o.cached or 0
            else:
                c["excused"] += 1

    def inject(self, k: int) -> None:
        kind = FAULTS[k % len(FAULTS)]
        self.faults[kind] += 1
        if kind == "worker_restart":
            sim = self.rng.choice(self.gw.sims)
            assert sim.proc is not None
            self.kills.setdefault(sim.id, []).append(time.monotonic())
            os.killpg(sim.proc.pid, signal.SIGKILL)
            sim.proc.wait(10)
            log(f"fault: {sim.id} SIGKILLed")
            time.sleep(2.0)
            start_sim(sim, self.gw.root)
            log(f"fault: {sim.id} restarted at {sim.url} with an empty cache")
        elif kind == "event_drops":
            sim = self.rng.choice(self.gw.sims)
            httpx.post(f"{sim.url}/sim/faults", json={"drop_events": 0.3}, timeout=10).raise_for_status()
            self.drop_until = (sim.url, time.monotonic() + 20.0)
            log(f"fault: {sim.id} drops 30% of its event batches for 20 s")
        else:
            pids = self.gw.child_pids("cortexctl.cli extproc")
            pid = self.rng.choice(pids)
            os.kill(pid, signal.SIGKILL)
            log(f"fault: extproc pid {pid} SIGKILLed")

    def upkeep(self) -> None:
        if self.drop_until is not None and time.monotonic() >= self.drop_until[1]:
            httpx.post(f"{self.drop_until[0]}/sim/faults", json={"drop_events": 0.0}, timeout=10).raise_for_status()
            self.drop_until = None

    def report(self, minute: int) -> dict[str, object]:
        rss = gateway_rss(self.gw)
        c = self.counts
        row = {"minute": minute, "rss_mib": {k: round(v / 1024, 1) for k, v in sorted(rss.items())}, **c,
               "faults": dict(self.faults)}
        log(f"minute {minute}: rss MiB {row['rss_mib']} | requests {c['requests']} ok {c['ok']} "
            f"excused {c['excused']} errors {c['errors']} (failed {c['failed']}, overclaims {c['overclaims']}) "
            f"exact_kv {c['exact_kv']} unrouted {c['unrouted']} "
            f"| faults {self.faults}")
        return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--fault-every", type=float, default=60.0, help="seconds between injected faults")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--num-blocks", type=int, default=3000, help="KV pool of each worker, in 16-token blocks")
    ap.add_argument("--max-turns", type=int, default=40,
                    help="a chat ends after this many added turns and a new one starts (0: chats grow forever)")
    args = ap.parse_args()
    # A stop signal still stops the fleet (the context managers below), not only this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    with tempfile.TemporaryDirectory(prefix="cortex-soak-") as tmp, \
            cluster(Path(tmp), n_sims=3, replay=True, extproc_processes=2,
                    sim_args=("--num-blocks", str(args.num_blocks))) as gw:
        soak = Soak(gw, args)
        rows = [soak.report(0)]
        traffic = Traffic(gw.url, total=10**9, threads=args.threads, prompts=12, words=(150, 900), max_tokens=24,
                          seed=args.seed, deadline_s=120.0, max_turns=args.max_turns).start()
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_fault, next_report, k = t0 + args.fault_every / 2, t0 + 60.0, 0
        try:
            while time.monotonic() < end:
                time.sleep(0.5)
                soak.upkeep()
                soak.account(traffic)
                now = time.monotonic()
                if now >= next_fault:
                    soak.inject(k)
                    k += 1
                    next_fault = now + args.fault_every
                if now >= next_report:
                    rows.append(soak.report(round((now - t0) / 60)))
                    next_report += 60.0
        finally:
            traffic.stop()
            traffic.join(timeout=150)
            if soak.drop_until is not None:
                soak.drop_until = (soak.drop_until[0], 0.0)
                soak.upkeep()
        soak.account(traffic)
        rows.append(soak.report(round((time.monotonic() - t0) / 60)))
        summary = {"minutes": args.minutes, "threads": args.threads, "first": rows[0], "last": rows[-1],
                   "errors": soak.counts["errors"], "examples": soak.examples}
        print("SUMMARY " + json.dumps(summary), flush=True)
        return 1 if soak.counts["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
