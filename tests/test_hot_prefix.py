"""One hot prefix floods a 4-worker simulated cluster, beside cooler prefixes, with KV pools too small to
hold everything everywhere. Cortex must keep the holder at or under its high watermark (spilling the rest, at
the watermark or before it where its queue would cost more than the prefix) and still reuse more cache than
pure load balancing. Assertions are on counts and ratios, never on time.

The shape is chosen so the comparison has a wide margin whatever the threads' timing: each prompt is ~190
KV blocks and a worker holds 800, so a worker keeps ~4 prompts. Cortex homes the ten cool prefixes (~2.5 per
worker, beside the hot one) and keeps them; load balancing sends all eleven everywhere and evicts them in
turn. Measured over eight runs: Cortex 1.5-1.7x the baseline's hit ratio, asserted at 1.1x. (With 400 blocks
and six cool prefixes both sides fitted almost everything and the gap was 1.1-1.35x, within the threads'
noise.)"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.harness import MODEL, Gateway, cluster, long_chat

pytestmark = pytest.mark.timeout(300)

HIGH, LOW = 4, 2
SCHEDULER = {"high_watermark": HIGH, "low_watermark": LOW}


def workload(n: int, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    hot = long_chat(900, seed=1)
    cool = [long_chat(900, seed=100 + i) for i in range(10)]
    out = []
    for i in range(n):
        base = hot if rng.random() < 0.4 else cool[rng.randrange(len(cool))]
        out.append([base[0], {"role": "user", "content": f"Question {i}: what does item {rng.randrange(999)} mean?"}])
    return out


def flood(gw: Gateway, requests: list[list[dict[str, str]]]) -> dict[str, Any]:
    board = gw.root / "rt" / "inflight" / "0.bin"
    peak = np.zeros(64, dtype=np.int64)
    stop = threading.Event()

    def watch() -> None:  # Cortex's own in-flight count per target, the figure the watermark governs
        while not stop.is_set():
            np.maximum(peak, np.fromfile(board, dtype=np.int64, count=64), out=peak)
            time.sleep(0.0005)

    def one(messages: list[dict[str, str]]) -> tuple[str, str, int, int]:
        with httpx.Client(timeout=60) as client:
            r = client.post(f"{gw.url}/v1/chat/completions",
                            json={"model": MODEL, "messages": messages, "max_tokens": 24})
            assert r.status_code == 200, r.text
            u = r.json()["usage"]
            return (r.headers["x-cortex-assigned-worker"], r.headers["x-cortex-route-reason"],
                    u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, requests))
    finally:
        stop.set()
        watcher.join()
    slots = {t["id"]: t["slot"] for t in gw.targets().values()}
    return {"requests": requests, "results": results, "peak": {wid: int(peak[s]) for wid, s in slots.items()},
            "hit_ratio": sum(r[2] for r in results) / sum(r[3] for r in results)}


def run(root: Path, events: bool) -> dict[str, Any]:
    """events=False is the baseline: the same gateway told nothing about the caches, and without the prompt's
    home (a hash of its first block, itself a cache-affinity rule), routes by load alone."""
    root.mkdir()
    scheduler = SCHEDULER if events else {**SCHEDULER, "prompt_home": False}
    with cluster(root, n_sims=4, sim_args=("--num-blocks", "800"), extra_config={"scheduler": scheduler},
                 events=events) as gw:
        return flood(gw, workload(160, seed=7))


def test_hot_prefix_spills_at_the_watermark_and_beats_load_balancing(tmp_path: Path) -> None:
    cortex = run(tmp_path / "cortex", events=True)
    baseline = run(tmp_path / "load-only", events=False)
    print(f"\nhit ratio cortex={cortex['hit_ratio']:.3f} load-only={baseline['hit_ratio']:.3f} peaks={cortex['peak']}")
    assert max(cortex["peak"].values()) <= HIGH, cortex["peak"]
    # The flood spilled off the hot prefix's first home: at the watermark, or earlier, where the time model
    # (the default rule) predicted the holder's queue would cost more than computing the prefix elsewhere.
    # Asserted on where the hot requests went, not on the label of the first spill: which one that is
    # (holder_over_high_watermark, holder_slower, or a worker that a cold-start share or an earlier spill
    # had already given the prefix) depends on the threads' timing.
    hot = long_chat(900, seed=1)[0]
    hot_workers = Counter(r[0] for m, r in zip(cortex["requests"], cortex["results"], strict=True) if m[0] == hot)
    print(f"hot prefix served by {dict(hot_workers)}")
    assert len(hot_workers) >= 2, (hot_workers, [r[1] for r in cortex["results"]])
    assert len({r[0] for r in cortex["results"]}) == 4  # every worker took part
    assert cortex["hit_ratio"] > baseline["hit_ratio"] * 1.1, (cortex["hit_ratio"], baseline["hit_ratio"])
