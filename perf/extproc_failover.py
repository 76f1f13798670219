"""What clients see while an extproc process dies: `cortex run` with two extproc processes over two simulated
workers, `--clients` clients sending chats back to back, one extproc process SIGKILLed `--kills` times,
`--every` seconds apart (the supervisor restarts it each time). Prints the answers by status and by whether
Cortex decided them (`x-cortex-assigned-worker` present) or Envoy served them without Cortex (failing open);
`--closed` runs the gateway with `extproc.failure_mode: closed`, where those become 503s.

    python perf/extproc_failover.py [--kills 3] [--every 6] [--clients 3] [--closed]

Loopback only; bounded (kills x every seconds).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness import MODEL, cluster, long_chat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--every", type=float, default=6.0)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--closed", action="store_true")
    args = ap.parse_args()
    extra = {"extproc": {"failure_mode": "closed"}} if args.closed else {}
    answers: Counter[tuple[int, bool]] = Counter()
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp), extproc_processes=2, extra_config=extra) as gw:
        done = threading.Event()

        def client() -> None:
            with httpx.Client(timeout=30) as c:
                while not done.is_set():
                    r = c.post(f"{gw.url}/v1/chat/completions", json={
                        "model": MODEL, "messages": long_chat(50, seed=1), "max_tokens": 2})
                    answers[(r.status_code, "x-cortex-assigned-worker" in r.headers)] += 1

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        try:
            time.sleep(2)
            for _ in range(args.kills):
                os.kill(max(gw.child_pids("cortexctl.cli extproc")), signal.SIGKILL)
                time.sleep(args.every)
        finally:
            done.set()
            for t in threads:
                t.join()
    total = sum(answers.values())
    decided = sum(n for (status, by_cortex), n in answers.items() if by_cortex)
    print(f"answers {total}: decided by Cortex {decided}, "
          f"served without Cortex {sum(n for (s, c), n in answers.items() if s == 200 and not c)}, "
          f"refused {sum(n for (s, c), n in answers.items() if s != 200 and not c)} "
          f"({dict(sorted(answers.items()))}; {args.kills} kills, {args.clients} clients)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
