"""What each target will really serve from its cache: the view's matches through the engine's hit rule.

The view's `match` gives each slot's leading run of the prompt's blocks, which is the hit of a target with one
full-attention KV-cache group on the GPU: the common case, left as it is. Two kinds of target need more
(ingest/ledger.py publishes them, cortex/contract.py carries their layout):

* a hybrid model's target (`groups`): its slot lists its full-attention spec, each sliding-window spec has a slot
  of its own, and the hit follows vLLM's hybrid rule (cortex/hit_rule.py) over which blocks each window slot
  holds, read from the same lookup (`Detail`: the view's per-key bits of those slots);
* a target with lower tiers (`tiers`): after its GPU hit, the engine's connector loads the run of blocks a lower
  tier holds (cortex/hit_rule.py tier_run). Those blocks count in the score at `scheduler.tier_weights` and are
  claimed only where the engine reports them in `cached_tokens` (the adapter's `counted_media`).

And a target whose engine folds tokens after each block into the block's hash (`lookahead_blocks`) gives up that
many blocks of its run: the last block of a hit also needs its lookahead tokens to match, which the keys do not
say (ingest/ledger.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cortex import engines, hit_rule
from cortex.kv_events import TIER_CPU, TIER_STORAGE
from extproc.cluster_view import TargetInfo

_TIER_ORDER = (TIER_CPU, TIER_STORAGE)
"""Where a block held on several lower tiers is loaded from: the nearest."""


@dataclass(frozen=True, slots=True)
class LowerHit:
    """A target's blocks right after its GPU hit that a lower tier holds (the run its connector would load)."""

    blocks: int
    by_medium: dict[str, int]
    credit: float
    """The blocks weighted by tier (scheduler.tier_weights): what they are worth in the score."""
    claimed: int
    """Of `blocks`, the leading ones the engine counts in `cached_tokens` (claimed with the GPU hit)."""


@dataclass(slots=True)
class Hits:
    matches: np.ndarray
    """Per slot: the blocks each target's engine reuses from its GPU (the hybrid rule and lookahead applied)."""
    lower: dict[int, LowerHit] = field(default_factory=dict)
    """Per slot with lower tiers and a run there."""
    withheld: dict[int, int] = field(default_factory=dict)
    """Per hybrid slot: blocks of its full-attention run the window rule left out (never claimed)."""


def detail_slots(workers: Sequence[TargetInfo]) -> np.ndarray | None:
    """The slots whose per-key bits the hit rule needs for these targets (None: plain targets only)."""
    slots = {g.slot for w in workers for g in w.groups if g.kind != hit_rule.FULL}
    slots.update(t.slot for w in workers if not w.groups for t in w.tiers)
    return np.array(sorted(slots), dtype=np.intp) if slots else None


def tiered(workers: Sequence[TargetInfo]) -> bool:
    """Some target publishes a lower tier that counts: its run after the GPU hit needs the whole prompt looked up
    (the early-stopping walk follows GPU runs only)."""
    return any(w.tiers and not w.groups for w in workers)


class Detail:
    """A lookup that also keeps, per key position, which of `slots` hold the key (bits past what the view
    returned stay False: no slot holds those keys)."""

    def __init__(self, match_detail: Callable[[list[int], np.ndarray], tuple[np.ndarray, np.ndarray] | None],
                 slots: np.ndarray) -> None:
        self._match = match_detail
        self.slots = slots
        self._parts: list[tuple[int, np.ndarray]] = []
        self._pos = 0

    def lookup(self, keys: list[int]) -> np.ndarray | None:
        got = self._match(keys, self.slots)
        start, self._pos = self._pos, self._pos + len(keys)
        if got is None:
            return None
        counts, bits = got
        self._parts.append((start, bits))
        return counts

    def bits(self) -> dict[int, np.ndarray]:
        """Per slot, held per key position over every key looked up so far."""
        held = np.zeros((self._pos, self.slots.size), dtype=bool)
        for start, bits in self._parts:
            held[start:start + bits.shape[0]] = bits
        return {int(s): held[:, i] for i, s in enumerate(self.slots)}


def resolve(matches: np.ndarray, workers: Sequence[TargetInfo], detail: Detail | None, limit: int,
            weights: Mapping[Any, float]) -> Hits:
    """Each target's reusable blocks from the view's `matches` (leading runs per slot) and `detail` (per-key
    bits of the slots `detail_slots` named), for a prompt of which at most `limit` blocks can be a hit."""
    special = [w for w in workers if w.groups or w.tiers or w.lookahead_blocks]
    if not special:
        return Hits(matches)
    out = matches.copy()
    bits = detail.bits() if detail is not None else {}
    lower: dict[int, LowerHit] = {}
    withheld: dict[int, int] = {}
    for w in special:
        run = int(matches[w.slot])
        hit = run
        if w.groups:
            hit = hit_rule.layout_hit(matches, [(g.slot, g.kind, g.need) for g in w.groups], bits, limit)
            if hit < run:
                withheld[w.slot] = run - hit
        if w.lookahead_blocks:
            hit = max(0, hit - w.lookahead_blocks)
        elif w.tiers and not w.groups:
            got = _lower(w, hit, bits, limit, weights)
            if got is not None:
                lower[w.slot] = got
        out[w.slot] = hit
    return Hits(out, lower, withheld)


def _lower(w: TargetInfo, gpu: int, bits: Mapping[int, np.ndarray], limit: int,
           weights: Mapping[Any, float]) -> LowerHit | None:
    held = {t.medium: bits[t.slot] for t in w.tiers if t.slot in bits}
    if not held:
        return None
    n = min(limit, *(h.size for h in held.values()))
    anywhere = np.zeros(n, dtype=bool)
    for h in held.values():
        anywhere |= h[:n]
    run = hit_rule.tier_run(anywhere, gpu, n)
    if run <= 0:
        return None
    by_medium: dict[str, int] = {}
    credit = 0.0
    counted = engines.adapter(w.engine).counted_media
    claimed, claiming = 0, True
    for i in range(gpu, gpu + run):
        medium = next(m for m in _TIER_ORDER if m in held and held[m][i])
        by_medium[medium] = by_medium.get(medium, 0) + 1
        credit += weights.get(medium, 0.0)
        claiming = claiming and medium in counted
        claimed += claiming
    return LowerHit(run, by_medium, credit, claimed)
