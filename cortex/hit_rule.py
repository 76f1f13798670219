"""The engine's cache-hit rule over Cortex's per-block residency (pure): how many leading prompt blocks a target
really serves from its cache, given which blocks each of its KV-cache groups and each lower tier holds.

A model whose layers all use full attention keeps one KV-cache group, and its hit is the leading run of blocks
the group holds: what the ledger view's prefix match already gives. A hybrid model (Gemma 3, gpt-oss, Llama 4:
sliding-window layers beside full attention) keeps one group per kind of layer, and vLLM publishes each group's
blocks apart. A sliding-window layer attends only to the last `window` tokens, so vLLM keeps (and caches) only the
blocks inside the window at the end of a request, and a hit needs the blocks of the window *back from the hit
point*, not the leading run. vLLM 0.32's rule (`vllm/v1/core/kv_cache_coordinator.py`,
`HybridKVCacheCoordinator.find_longest_cache_hit`; `single_type_kv_cache_manager.py`), which `hybrid_hit` follows:

1. the candidate length starts at the longest hit the request may have: `(prompt tokens - 1) // block`, since
   the engine always computes the last prompt token (`KVCacheManager.get_computed_blocks`);
2. full-attention groups first (`FullAttentionManager`): the leading run of blocks every group of that spec holds,
   up to the candidate;
3. each sliding-window spec (`SlidingWindowManager`): scanning down from the candidate, the first block `i` that
   ends a run of `need = ceil((window - 1) / block)` consecutive blocks its groups all hold gives a hit of `i + 1`
   blocks; with no such run, the run from block 0 if shorter than `need` (else nothing);
4. each spec may only shorten the candidate; while one does, every spec is checked again at the shorter length
   (a full-attention spec keeps its run, trimmed), until none does. Two specs of which the first is full
   attention settle in one pass (the engine breaks there too).

Eagle's dropped block, DCP/PCP and fine-grained partial hashes are not modelled: Cortex marks a target whose
layout needs them as not exact (ingest/ledger.py). Vectors: tests/fixtures/hybrid_hits.json, produced by running
vLLM's own KVCacheManager (tests/vectors/hybrid_hits_gen.py); tests/test_hit_rule.py.

Lower tiers (CPU, storage; vLLM's OffloadingConnector, LMCache, SGLang HiCache): the engine first takes its GPU
hit, then asks its connector for the blocks right after it (`get_num_new_matched_tokens(request,
num_computed_tokens)`: a prefix lookup from the GPU hit on). `tier_run` is that run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FULL = "full"
WINDOW = "window"


@dataclass(frozen=True, slots=True)
class Spec:
    """One kind of KV-cache group as the hit rule sees it."""

    kind: str
    """FULL (a prefix run) or WINDOW (the blocks of the window back from the hit point)."""
    need: int = 0
    """WINDOW: consecutive blocks a hit must end with (`window_need`)."""


def window_need(window_tokens: int, block_size: int) -> int:
    """Blocks a sliding-window hit must end with: vLLM's `cdiv(sliding_window - 1, block_size)`, at least one (a
    window of one token still needs the block before the hit point)."""
    return max(1, -(-(window_tokens - 1) // block_size))


def full_hit(held: np.ndarray, limit: int) -> int:
    """Leading blocks held, at most `limit`."""
    h = held[:limit]
    if h.all():
        return int(h.size)
    return int(np.argmin(h))


def window_hit(held: np.ndarray, limit: int, need: int) -> int:
    """vLLM's SlidingWindowManager.find_longest_cache_hit over `held` (block i held or not), for at most `limit`
    blocks: the end of the last run of `need` held blocks at or before `limit`; without one, the leading run."""
    h = held[:limit]
    n = int(h.size)
    if n == 0:
        return 0
    if need <= 1:
        idx = np.flatnonzero(h)
        return int(idx[-1]) + 1 if idx.size else 0
    # run[i] = consecutive held blocks ending at i (a cumulative count reset at each miss).
    c = np.cumsum(h, dtype=np.int64)
    reset = np.maximum.accumulate(np.where(h, 0, c))
    run = c - reset
    ends = np.flatnonzero(run >= need)
    if ends.size:
        return int(ends[-1]) + 1
    return full_hit(h, n)


def hybrid_hit(groups: Sequence[tuple[Spec, np.ndarray]], limit: int) -> int:
    """The hit, in blocks, of a target whose KV-cache specs hold `groups` (per spec: held per block, every group
    of the spec together), for a prompt of which at most `limit` blocks can be a hit (module docstring).

    Full-attention specs go first; then the others in their given order, as the engine sorts them."""
    order = sorted(groups, key=lambda g: g[0].kind != FULL)
    simple = len(order) == 2 and order[0][0].kind == FULL
    full_runs: dict[int, int] = {}
    hit = limit
    while True:
        cur = hit
        for i, (spec, held) in enumerate(order):
            if spec.kind == FULL:
                run = full_runs.get(i)
                if run is None:
                    run = full_runs[i] = full_hit(held, cur)
                cur = min(cur, run)
            else:
                cur = window_hit(held, cur, spec.need)
        if cur >= hit:
            return hit
        hit = cur
        if simple:
            return hit


def tier_run(held: np.ndarray, start: int, limit: int) -> int:
    """Blocks held on a lower tier right after the GPU hit (`start`): the connector's prefix lookup from there."""
    if start >= limit:
        return 0
    return full_hit(held[start:limit], limit - start)


def layout_hit(counts: np.ndarray, groups: Sequence[tuple[int, str, int]], bits: dict[int, np.ndarray],
               limit: int) -> int:
    """A hybrid target's hit from the view: `groups` its specs as (slot, kind, need); a full spec's held blocks
    are its slot's leading run (`counts`), a window spec's come from `bits` (held per key, the view's detail)."""
    specs = []
    for slot, kind, need in groups:
        if kind == FULL:
            held = np.zeros(limit, dtype=bool)
            held[:min(int(counts[slot]), limit)] = True
        else:
            got = bits.get(slot)
            held = np.zeros(limit, dtype=bool)
            if got is not None:
                n = min(limit, got.size)
                held[:n] = got[:n]
        specs.append((Spec(kind, need), held))
    return hybrid_hit(specs, limit)
