"""Ingest throughput and memory: real msgpack batches -> decoder -> sync state machine -> ledger -> shared view.

Everything ingest does per batch except the socket read, in one process, as blocks/s, with batches grouped
the way EventSource groups what is already queued when events arrive faster than they are applied:
  vllm16   vLLM-shaped: 16-token blocks, 8 blocks per BlockStored, one BlockRemoved per evicted block
  sglang1  SGLang-shaped: 1-token pages (SGLang's CUDA default) accumulated into 16-token Cortex blocks
It also reports ingest's own memory per cached block (the Python maps behind the view; the view's bytes
per key are measured by perf/bench_view.py).

    .venv/bin/python perf/bench_ingest.py [--blocks 200000]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cortex.ledger_view import ViewWriter
from ingest.events import decode_batch
from ingest.hash_parity import ParityCheck
from ingest.ledger import Ledger
from ingest.source import DRAIN_MAX
from ingest.sync import Apply, SourceSync


def make_batches(shape: str, n_blocks: int, rng: random.Random) -> list[bytes]:
    """Chains of new blocks, with 25 % of stored blocks later evicted leaf-first."""
    page = 16 if shape == "vllm16" else 1
    pages_per_event = 8 if shape == "vllm16" else 64
    batches: list[bytes] = []
    next_hash = 1
    stored = 0
    live_chains: list[list[int]] = []
    while stored < n_blocks * (16 // page):
        events = []
        for _ in range(4):
            hashes = list(range(next_hash, next_hash + pages_per_event))
            next_hash += pages_per_event
            tokens = [rng.randrange(150_000) for _ in range(pages_per_event * page)]
            parent = None
            if live_chains and rng.random() < 0.5:
                parent = live_chains[rng.randrange(len(live_chains))][-1]
            events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                           "token_ids": tokens, "block_size": page, "lora_id": None, "medium": "GPU",
                           "lora_name": None, "extra_keys": None, "group_idx": 0})
            live_chains.append(hashes)
            stored += pages_per_event
        if len(live_chains) > 8 and rng.random() < 0.25:
            chain = live_chains.pop(0)
            if shape == "vllm16":
                events += [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in reversed(chain)]
            else:
                events.append({"type": "BlockRemoved", "block_hashes": list(reversed(chain)), "medium": "GPU"})
        batches.append(msgspec.msgpack.encode([time.time(), events, 0]))
    return batches


def run(shape: str, n_blocks: int, tmp: Path) -> tuple[float, float, int]:
    batches = make_batches(shape, n_blocks, random.Random(7))
    view = ViewWriter(tmp / f"{shape}.view", max_workers=64, capacity=1 << 18)
    page = 16 if shape == "vllm16" else 1
    ledger = Ledger(slot=0, engine="vllm" if page == 16 else "sglang", block_size=16,
                    parity=ParityCheck(engine="vllm" if page == 16 else "sglang", page_size=page))
    sync = SourceSync(has_replay=False)
    sync.connected()
    t0 = time.perf_counter()
    # As EventSource does under load: the batches already queued (up to DRAIN_MAX) share one view update.
    for start in range(0, len(batches), DRAIN_MAX):
        with ledger.deferred(view):
            for seq in range(start, min(start + DRAIN_MAX, len(batches))):
                for action in sync.live(seq, batches[seq]):
                    if isinstance(action, Apply):
                        ledger.apply(decode_batch(action.payload).events, view)
    elapsed = time.perf_counter() - t0
    cortex_blocks = ledger.blocks_stored * page / 16
    view.close(unlink=True)
    return cortex_blocks / elapsed, elapsed, ledger.blocks


def memory_per_block(n_blocks: int, tmp: Path) -> float:
    batches = make_batches("vllm16", n_blocks, random.Random(9))
    view = ViewWriter(tmp / "mem.view", max_workers=64, capacity=1 << 18)
    ledger = Ledger(slot=0, engine="vllm", block_size=16)
    decoded = [decode_batch(b).events for b in batches]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for events in decoded:
        ledger.apply(events, view)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    view.close(unlink=True)
    return (after - before) / max(1, ledger.blocks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=200_000, help="Cortex blocks to store per shape")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(f"{'shape':>8} | {'Cortex blocks/s':>15} | {'seconds':>7} | {'blocks held at end':>18}")
        for shape in ("vllm16", "sglang1"):
            rate, secs, held = run(shape, args.blocks if shape == "vllm16" else args.blocks // 4, tmp)
            print(f"{shape:>8} | {rate:>15,.0f} | {secs:>7.2f} | {held:>18,}")
        print(f"ingest memory per cached block (Python maps, vllm16): {memory_per_block(50_000, tmp):.0f} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
