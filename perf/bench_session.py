"""What session affinity adds to one decision: the policy's decide() with and without a session key, and the
per-session canary draw, in one process (no network, no tokenizer: the score stage alone, where the rule runs).

Candidates are built the production way (extproc/candidates.py) for 4 and 16 workers, half of them holding a
prefix of the prompt. The two variants run alternately, ROUNDS times each, and the median per-decision time of
each is printed, so a loaded machine slows both alike.

    python perf/bench_session.py [--decisions 20000] [--rounds 5]

Bounded: decisions x rounds x 2 variants x 2 fleet sizes (a few seconds on 2 vCPUs).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cortex.config import SchedulerConfig
from extproc import candidates
from extproc.cluster_view import TargetInfo
from extproc.policies import CacheAware, session
from extproc.policies.base import Candidate, Facts
from extproc.predictions import Predictions
from extproc.registry import session_draw

S = SchedulerConfig()


def fleet(n: int) -> list[Candidate]:
    targets = [TargetInfo(id=f"w{i}", worker=f"w{i}", rank=None, slot=i, model="m", engine="vllm",
                          address=f"127.0.0.1:{9000 + i}", exact_kv=True, healthy=True, engine_load=float(i % 3),
                          why="", suspect=False, added_at=None) for i in range(n)]
    matches = np.array([8 if i % 2 else 0 for i in range(n)], dtype=np.int64)
    return candidates.build(targets, matches=matches, keys=list(range(1, 65)), inflight=np.zeros(n, dtype=np.int64),
                            alive=True, predictions=Predictions(), hysteresis=candidates.Hysteresis(), scoring=S)


def per_decision_us(cands: list[Candidate], sess: int | None, n: int) -> float:
    policy, rng = CacheAware(), random.Random(1)
    facts = Facts(16, True, "no_cached_prefix", S, 12345, sess)
    t0 = time.perf_counter()
    for _ in range(n):
        policy.decide(cands, facts, rng)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    key = session.key_hash("conversation-0123456789")
    print(f"{'workers':>7} {'no session us':>14} {'session us':>11} {'added us':>9}")
    for n in (4, 16):
        cands = fleet(n)
        plain, sticky = [], []
        for _ in range(args.rounds):
            plain.append(per_decision_us(cands, None, args.decisions))
            sticky.append(per_decision_us(cands, key, args.decisions))
        a, b = statistics.median(plain), statistics.median(sticky)
        print(f"{n:>7} {a:>14.2f} {b:>11.2f} {b - a:>9.2f}")
        # The rule alone, on the decision the policy made without a key (what the difference above should be).
        facts = Facts(16, True, "no_cached_prefix", S, 12345, key)
        d = CacheAware().decide(cands, Facts(16, True, "no_cached_prefix", S, 12345, None), random.Random(1))
        t0 = time.perf_counter()
        for _ in range(args.decisions):
            session.stick(d, cands, facts)
        print(f"{'':>7} session.stick alone: {(time.perf_counter() - t0) / args.decisions * 1e6:.2f} us")
    models, weights = ["stable", "canary"], [95.0, 5.0]
    t0 = time.perf_counter()
    for i in range(args.decisions):
        session_draw("chat", f"user-{i}", models, weights)
    print(f"session_draw, 2 targets: {(time.perf_counter() - t0) / args.decisions * 1e6:.2f} us")


if __name__ == "__main__":
    main()
