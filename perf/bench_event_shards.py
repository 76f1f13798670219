"""What one applied batch costs each process, with the streams followed in ingest and in event shards (issue 28).

The same batches (vLLM's format: each stores 16 new 16-token blocks on one of `--targets` targets and, once the
target holds `--held` blocks, removes the 16 oldest) go three ways, in this process, alternately for `--rounds`:

- **in ingest**: `EventSource.perform` of each batch into a ledger whose sink is the real view writer (a view file in
  a temporary directory), as ingest does with `ingest.event_shards: 0`;
- **in a shard**: the same, in a shard's source whose sink is the shard's report (ingest/event_shard.py), and the
  report encoded, one report per `--per-report` batches (a shard sends one per turn of its loop);
- **ingest's part with shards**: those reports decoded and applied to the view (ingest/shards.py).

CPU per batch is this thread's time. What it leaves out is the same both ways: receiving a batch from its SUB socket
(in ingest or in a shard) and the tail checks after bursts (also in the shard, when sharded; ~0.25 ms each:
`python perf/bench_tail_check.py`); the hop between a shard and ingest (a ZMQ PAIR on loopback) is not timed here.
Numbers only.

    python perf/bench_event_shards.py [--targets 64] [--batches 4000] [--per-report 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without installing the package

from cortex.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from cortex.ledger_view import ViewWriter
from ingest.event_shard import Shard
from ingest.ledger_publish import KeySink
from ingest.regret import Regret
from ingest.shard_wire import TO_INGEST, Assign
from ingest.shards import ShardPool
from ingest.source import EventSource, follow

ALGO = "not-reproduced"  # hash parity unchecked: the batches carry made-up hashes


def batches(targets: int, n: int, held: int) -> list[tuple[int, int, bytes]]:
    """(target, seq, payload): round-robin over the targets, each a chain growing 16 blocks a batch."""
    out: list[tuple[int, int, bytes]] = []
    last: dict[int, int | None] = dict.fromkeys(range(targets))
    for i in range(n):
        t, seq = i % targets, i // targets
        first = (t << 32) + seq * 16 + 1
        hashes: list[int | bytes] = list(range(first, first + 16))
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [BlockStored(
            block_hashes=hashes, parent_block_hash=last[t], token_ids=[(t * 7919 + seq * 256 + k) % 150000
                                                                        for k in range(256)],
            block_size=16, lora_id=None, medium="GPU", lora_name=None)]
        if (seq + 1) * 16 > held:
            old = (t << 32) + (seq - held // 16) * 16 + 1
            gone: list[int | bytes] = list(range(old, old + 16))
            events.append(BlockRemoved(block_hashes=gone, medium="GPU"))
        last[t] = first + 15
        out.append((t, seq, encode_batch(KVEventBatch(ts=time.time(), events=events))))
    return out


def target(t: int, gen: int) -> Assign:
    return Assign(tid=f"w{t}", gen=gen, slot=t, engine="vllm", block_size=16, page_size=16, hash_algo=ALGO,
                  hash_seed=None, endpoint=None, replay_endpoint=None, topic="")


def source(ctx: zmq.asyncio.Context, t: int, sink: KeySink) -> EventSource:
    ev = follow(target(t, 0), ctx, sink, alloc=None, on_change=lambda: None, on_events=None)
    ev.perform(ev.sync.connected())
    return ev


def in_ingest(ctx: zmq.asyncio.Context, feed: list[tuple[int, int, bytes]], targets: int,
              root: Path) -> tuple[float, int]:
    view = ViewWriter(root / "in-ingest.view", max_workers=max(64, targets), capacity=1 << 18)
    sink = Regret(view, 16)
    sources = [source(ctx, t, sink) for t in range(targets)]
    cpu = time.thread_time()
    for t, seq, payload in feed:
        sources[t].perform(sources[t].sync.live(seq, payload))
    cpu = time.thread_time() - cpu
    size = view.size
    view.close(unlink=True)
    return cpu, size


async def sharded(ctx: zmq.asyncio.Context, feed: list[tuple[int, int, bytes]], targets: int, per_report: int,
                  root: Path) -> tuple[float, float, int]:
    frames: list[bytes] = []
    shard = Shard(ctx, frames.append)
    view = ViewWriter(root / "sharded.view", max_workers=max(64, targets), capacity=1 << 18)
    pool = ShardPool(1, view, Regret(view, 16), lambda: None, lambda: None)
    link = pool.shards[0]
    link.connected = True  # past the incarnation's hello (its first report)
    for t in range(targets):
        a = target(t, pool.next_gen())
        shard.handle(a)
        src = pool.source(a, on_change=lambda: None, on_events=None)
        link.sources[src.name] = src
        shard.followed[a.tid].source.perform(shard.followed[a.tid].source.sync.connected())
    shard.flush()
    frames.clear()
    cpu = time.thread_time()
    for i, (t, seq, payload) in enumerate(feed):
        ev = shard.followed[f"w{t}"].source
        ev.perform(ev.sync.live(seq, payload))
        shard.touched(ev.name)  # as the source's on_events does after each group of live batches
        if (i + 1) % per_report == 0:
            shard.flush()
    shard.flush()
    in_shard = time.thread_time() - cpu
    cpu = time.thread_time()
    for frame in frames:
        pool._received(link, TO_INGEST.decode(frame))
    in_owner = time.thread_time() - cpu
    size = view.size
    view.close(unlink=True)
    return in_shard, in_owner, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", type=int, default=64)
    ap.add_argument("--batches", type=int, default=4000)
    ap.add_argument("--held", type=int, default=1024, help="blocks a target holds before each store evicts")
    ap.add_argument("--per-report", type=int, default=1, help="batches per shard report (one per loop turn)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    feed = batches(args.targets, args.batches, args.held)
    print(f"{args.batches} batches over {args.targets} targets (16 blocks stored each, 16 removed once "
          f"{args.held} are held), {args.per_report} per report", flush=True)

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        # The shard's flush is scheduled on the loop; here it is called by hand, once per `per_report` batches.
        with tempfile.TemporaryDirectory() as tmp, contextlib.suppress(KeyboardInterrupt):
            root = Path(tmp)
            for r in range(args.rounds):
                alone, size = in_ingest(ctx, feed, args.targets, root)
                shard, owner, sharded_size = await sharded(ctx, feed, args.targets, args.per_report, root)
                # The same keys in the view either way, or the comparison is void.
                assert size == sharded_size, (size, sharded_size)
                n = args.batches
                print(f"round {r + 1}: in ingest {1e3 * alone / n:.3f} ms per batch | sharded: in the shard "
                      f"{1e3 * shard / n:.3f}, in ingest {1e3 * owner / n:.3f} ms per batch", flush=True)
        ctx.term()

    asyncio.run(run())


if __name__ == "__main__":
    main()
