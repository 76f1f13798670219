"""How long a config reload stops extproc: its gRPC health answers, asked every 50 ms while the file is edited.

Envoy checks each extproc process with the standard gRPC health check (cortex/envoy_config.py); one check that
times out marks the process down, and while it is, requests skip Cortex (fail open: no routing, no tenant
limits). A reload that stopped the event loop for longer than that timeout made Envoy skip Cortex for a moment
(docs/configuration.md, "Live reload"). This starts `cortex run` over two simulated workers, edits cortex.yaml
`--reloads` times (an alias added, then removed: no model's files change), `--every` seconds apart, sends chats
meanwhile, and prints the health answers' p50 / p99 / max during the whole run, and how many answers came back
without Cortex's headers (Envoy failed open).

    python perf/reload_stall.py [--reloads 6] [--every 4]

Loopback only; bounded (reloads x every seconds of chats, one at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cortex import grpc_health
from tests.harness import MODEL, Gateway, cluster, long_chat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reloads", type=int, default=6)
    ap.add_argument("--every", type=float, default=4.0, help="seconds between edits")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp)) as gw:
        latencies, failed, skipped, answered = measure(gw, args.reloads, args.every)
    ms = sorted(x * 1000 for x in latencies)
    print(f"health answers {len(ms)} during {args.reloads} reloads: p50 {statistics.median(ms):.0f} ms, "
          f"p99 {ms[int(0.99 * (len(ms) - 1))]:.0f} ms, max {ms[-1]:.0f} ms, over 1 s {sum(x > 1000 for x in ms)}, "
          f"not serving {failed}; chats {answered}, without x-cortex headers (Envoy failed open) {skipped}")
    return 0


def measure(gw: Gateway, reloads: int, every: float) -> tuple[list[float], int, int, int]:
    latencies: list[float] = []
    failed = 0
    done = threading.Event()

    async def poll() -> None:
        nonlocal failed
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw.extproc_port}")
        while not done.is_set():
            started = time.perf_counter()
            ok, _ = await grpc_health.check(channel, "", timeout=5.0)
            latencies.append(time.perf_counter() - started)
            failed += not ok
            await asyncio.sleep(0.05)
        await channel.close()

    poller = threading.Thread(target=lambda: asyncio.run(poll()))
    poller.start()
    path = gw.root / "cortex.yaml"
    original = yaml.safe_load(path.read_text())
    skipped = answered = 0
    try:
        with httpx.Client(timeout=60) as client:
            for k in range(reloads):
                edited = dict(original)
                if k % 2 == 0:
                    edited["aliases"] = [{"name": "chat-prod", "targets": [{"model": MODEL}]}]
                tmp = path.with_suffix(".tmp")
                tmp.write_text(yaml.safe_dump(edited))
                tmp.replace(path)
                until = time.monotonic() + every
                while time.monotonic() < until:
                    r = client.post(f"{gw.url}/v1/chat/completions", json={
                        "model": MODEL, "messages": long_chat(200, seed=k), "max_tokens": 2})
                    answered += 1
                    skipped += not any(h.startswith("x-cortex") for h in r.headers)
    finally:
        done.set()
        poller.join()
    return latencies, failed, skipped, answered


if __name__ == "__main__":
    sys.exit(main())
