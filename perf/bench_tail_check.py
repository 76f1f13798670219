"""What one tail check costs ingest: a DEALER opened for each check against the one kept connected (issue 28).

A tail check asks a publisher's replay ROUTER for anything newer than the last applied batch (docs/ledger.md,
"Windows"); at 256 busy workers ingest makes hundreds a second. This starts a ROUTER in a process of its own that
answers every request with the end marker at once (a publisher with nothing newer, the common answer), then times
`--checks` checks each way in this process, alternately for `--rounds` rounds: CPU per check is this process's
(its event loop and ZMQ's I/O thread: what ingest pays), wall per check the round trip. Numbers only; loopback.

    python perf/bench_tail_check.py [--checks 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without installing the package

from cortex.kv_events import END_SEQ
from ingest.source import ReplayLink, replay
from tests.harness import free_ports

ROUTER = """
import sys, zmq
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind("tcp://127.0.0.1:" + sys.argv[1])
end = bytes.fromhex(sys.argv[2])
while True:
    ident = sock.recv_multipart()[0]
    sock.send_multipart([ident, b"", b"", end, b""])
"""


async def _rounds(endpoint: str, checks: int, rounds: int) -> None:
    ctx = zmq.asyncio.Context()
    link = ReplayLink(ctx, endpoint)
    try:
        for r in range(rounds):
            for way in ("a DEALER per check", "one kept DEALER"):
                cpu, wall = time.process_time(), time.perf_counter()
                for i in range(checks):
                    if way == "one kept DEALER":
                        got = await link.ask(i + 1, timeout_s=2.0)
                    else:
                        got = await replay(ctx, endpoint, i + 1, timeout_s=2.0)
                    assert got == ([], True), got
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                print(f"round {r + 1}, {way}: {1000 * cpu / checks:.3f} ms CPU, {1000 * wall / checks:.3f} ms wall "
                      "per check", flush=True)
        print(f"connections the kept DEALER opened: {link.opened}")
    finally:
        link.close()
        ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checks", type=int, default=300, help="checks per way per round (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each way once per round (default %(default)s)")
    args = ap.parse_args()
    (port,) = free_ports(1)
    router = subprocess.Popen([sys.executable, "-c", ROUTER, str(port), END_SEQ.hex()])
    try:
        time.sleep(0.5)  # bound before the first connect; a DEALER would also wait for it
        asyncio.run(_rounds(f"tcp://127.0.0.1:{port}", args.checks, args.rounds))
    finally:
        router.kill()
        router.wait(10)


if __name__ == "__main__":
    main()
