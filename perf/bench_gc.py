"""How long one full garbage collection stops extproc, with and without its start-up heap settled.

Builds in one process what an extproc process holds (the imports, the Qwen2.5 model's tokenizer and chat
template, the Router and its caches, a ledger view of four workers), routes `--requests` next turns of an 8K and a
128K-token conversation so the piece, element and key-chain caches fill as traffic fills them, then times a full
collection (`gc.collect()`, what CPython runs on its own when enough objects have survived) `--rounds` times:
first with the heap as start-up left it, then after `cortex.gc_pauses.settle()` and as many requests again. The
figure is the pause every request in flight in that process waits through (cortex/gc_pauses.py).
Ingest's pauses at a 256-worker fleet are printed by perf/fleet_scale.py.

    python perf/bench_gc.py [--requests 40] [--rounds 5]

One process, no network; about a minute on 2 vCPUs.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without installing the package

from bench_decision import Text, body, conversation, make_config, next_turn, publish_targets

from cortex.gc_pauses import settle
from cortex.ledger_view import ViewWriter
from extproc.cluster_view import ClusterView
from extproc.registry import ModelRegistry
from extproc.request import parse_body
from extproc.router import Router


def full_collections(rounds: int) -> list[float]:
    """ms of each of `rounds` full collections."""
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t) * 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40, help="next turns routed per conversation size and phase")
    ap.add_argument("--rounds", type=int, default=5, help="full collections timed per phase")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_config(Path(tmp))
        cfg.runtime_path().mkdir(parents=True, exist_ok=True)
        writer = ViewWriter(cfg.view_path(), max_workers=cfg.ingest.max_workers, capacity=1 << 18)
        publish_targets(writer, cfg)
        writer.heartbeat()
        registry = ModelRegistry(cfg)
        cluster = ClusterView(cfg, cfg.view_path(), 0)
        writer.heartbeat()
        cluster.refresh()
        router = Router(cfg, cluster, registry)
        text = Text(registry.bundles[next(iter(registry.bundles))], seed=7)
        bases = [(size, conversation(text, size)) for size in (8000, 128000)]

        def traffic() -> None:
            for size, base in bases:
                for _ in range(args.requests):
                    writer.heartbeat()
                    cluster.refresh()
                    router.commit(router.decide(parse_body("chat", body(next_turn(text, base, size)))))
                    router.deferred.run_pending()

        load = os.getloadavg()[0]
        traffic()
        before, objects_before = full_collections(args.rounds), len(gc.get_objects())
        frozen = settle()
        traffic()
        after, objects_after = full_collections(args.rounds), len(gc.get_objects())
    print(f"one full collection in an extproc-shaped process, ms (load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after; {args.requests} next turns of an 8K and a 128K chat per phase)")
    print(f"{'heap':>28} | {'objects walked':>14} | {'p50':>6} {'max':>6}")
    print(f"{'as start-up left it':>28} | {objects_before:>14,} | {statistics.median(before):>6.1f} "
          f"{max(before):>6.1f}")
    print(f"{'settled (' + format(frozen, ',') + ' frozen)':>28} | {objects_after:>14,} | "
          f"{statistics.median(after):>6.1f} {max(after):>6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
