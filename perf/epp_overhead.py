"""What Cortex adds as a GIE endpoint picker, beside what it adds as its own gateway, in the same run.

Two simulated vLLM workers, and three paths to the worker that holds the prompt, requests interleaved:
- direct to the worker;
- GIE's reference Envoy (ORIGINAL_DST, full-duplex bodies, TLS to the picker) calling `cortex epp`;
- `cortex run` (Cortex's own Envoy, buffered bodies, plaintext h2c to extproc).
Both Cortex setups run one extproc process; the CPU each one's extproc spends per request is read from /proc.

    .venv/bin/python perf/epp_overhead.py [--requests 300] [--words 60,1500]

Bounded: a few hundred sequential requests per path and prompt size, loopback only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cortexbench.launch import free_ports
from perf.added_latency import measure, pct
from perf.procstat import cpu_seconds
from tests.harness import MODEL, Gateway, child_pids, long_chat, start_gateway, start_sim, stop
from tests.test_epp_e2e import GIE_REFERENCE, Fleet


def timed(client: httpx.Client, url: str, body: dict[str, object], n: int, pids: list[int],
          cpu: list[float]) -> list[float]:
    before = sum(cpu_seconds(p) for p in pids)
    out = measure(client, url, body, n)
    cpu.append((sum(cpu_seconds(p) for p in pids) - before) / n * 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--words", default="60,1500")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, httpx.Client(timeout=60) as client:
        root = Path(tmp)
        fleet = Fleet(root / "epp", {})
        (root / "epp").mkdir()
        (root / "run").mkdir()
        port, admin, ingest, extproc = free_ports(4)
        own = Gateway(root / "run", fleet.sims, port, admin, ingest, extproc, extproc_processes=1)
        try:
            for s in fleet.sims:
                start_sim(s, root)
            fleet.start_picker()
            gie = fleet.start_envoy(GIE_REFERENCE, fleet.listen, fleet.admin)
            start_gateway(own)
            assert fleet.picker is not None and own.proc is not None
            picker_pids = child_pids(fleet.picker.pid, "cortexctl.cli extproc")
            own_pids = own.child_pids("cortexctl.cli extproc")
            for words in (int(w) for w in args.words.split(",")):
                body = {"model": MODEL, "messages": long_chat(words, seed=words), "max_tokens": 1}
                r = client.post(f"{gie}/v1/chat/completions", json=body)
                holder = next(s for s in fleet.sims if s.id == r.headers["x-sim-worker"])
                tokens = r.json()["usage"]["prompt_tokens"]
                paths = {"direct": (f"{holder.url}/v1/chat/completions", []),
                         "epp": (f"{gie}/v1/chat/completions", picker_pids),
                         "run": (f"{own.url}/v1/chat/completions", own_pids)}
                lat: dict[str, list[float]] = {k: [] for k in paths}
                cpu: dict[str, list[float]] = {k: [] for k in paths}
                for url, pids in paths.values():  # warm every path; the repeat lands on the holder
                    timed(client, url, body, 20, pids, [])
                for _ in range(args.requests // 10):  # interleaved, so drift hits every path alike
                    for name, (url, pids) in paths.items():
                        lat[name] += timed(client, url, body, 10, pids, cpu[name])
                rows.append((tokens, lat, cpu))
        finally:
            stop(own.proc)
            fleet.stop_all()
    print(f"{'prompt tokens':>13} | {'direct p50':>10} | {'epp p50':>8} {'p90':>6} {'added':>6} {'cpu/req':>8} | "
          f"{'run p50':>8} {'p90':>6} {'added':>6} {'cpu/req':>8}")
    for tokens, lat, cpu in rows:
        d = pct(lat["direct"], .5)
        cells = [f"{pct(lat[k], .5):>8.2f} {pct(lat[k], .9):>6.2f} {pct(lat[k], .5) - d:>6.2f} "
                 f"{statistics.mean(cpu[k]):>8.2f}" for k in ("epp", "run")]
        print(f"{tokens:>13} | {d:>10.2f} | {cells[0]} | {cells[1]}")
    print("(milliseconds; sequential requests, max_tokens=1, cache warm on the chosen worker; cpu/req is the extproc "
          "process's CPU per request)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
