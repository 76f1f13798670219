"""What the circuit breakers add to one routing decision (extproc/breaker.py: `Breakers.skipped`, the only call on
the request path before the policy runs), with no breaker tripped (nearly always) and with one open.

    .venv/bin/python perf/bench_breaker.py [--workers 256] [--decisions 20000]

Pure CPU, a second or two. With a breaker open among a decision's candidates, that decision also runs its policy
twice when the open worker was its first choice (extproc/plan.py: decide); that cost is the policy's own and is
measured by perf/bench_decision.py.
"""

from __future__ import annotations

import argparse
import time

from cortex.config import BreakerConfig
from extproc.breaker import Breakers


def per_decision_us(br: Breakers, addrs: list[str], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        br.skipped((a for a in addrs), 1.0)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--decisions", type=int, default=20000)
    args = p.parse_args()
    addrs = [f"10.0.{i // 256}.{i % 256}:8000" for i in range(args.workers)]
    br = Breakers(BreakerConfig(failure_threshold=1))
    print(f"no breaker tripped: {per_decision_us(br, addrs, args.decisions):.2f} us per decision "
          f"({args.workers} candidates)")
    br.record(addrs[7], False, 0.0)
    print(f"one breaker open:   {per_decision_us(br, addrs, args.decisions):.2f} us per decision "
          f"({args.workers} candidates)")


if __name__ == "__main__":
    main()
