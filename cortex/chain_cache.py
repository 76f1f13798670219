"""The key chain of a prompt's prefix, cached at the boundary tokens of its text (issue 26: long contexts).

The piece cache (cortex/piecewise/piece_cache.py) spares tokenizing a conversation's earlier turns, but every turn
still assembled, hashed and looked up the whole prompt: at 128K tokens that was ~10 ms of a decision, and it grew
with the conversation, not with the turn. This cache keeps, for a prompt prefix that ends at a boundary token
(`<|im_start|>`, `<|im_end|>`: the text between them is encoded independently, proven per tokenizer at load),
where the walk stood there: the token count, the block keys hashed so far, the ids after the last of them, and
the prompt's first ids. The next turn, whose rendered text starts with that prefix, starts its walk there: it
tokenizes and hashes only what was appended, and looks up the cached keys in one vectorised call.

Why the keys equal a from-scratch computation:
  * the entry is found by a digest of the pieces up to the boundary, each given as the serial number of its
    entry in the piece cache (numbered when stored, never reused: equal numbers mean text the cache's dictionary
    found equal), so the text before the boundary is the same, cut into the same pieces; ids after a boundary
    never depend on the text before it (the segment-wise encoding's invariant, checked at load and on every
    piece begun alone);
  * everything else that changes ids or keys is in the digest's namespace: the chain's root (LoRA adapter, cache
    salt: tenant isolation), the block size, the holdback (a cut prompt keys fewer blocks), whether the
    tokenizer's special tokens are added; and the cache belongs to one SegmentEncoder, i.e. one tokenizer
    object, dropped with it on a reload. The block key function itself is fixed (cortex/blockkeys.py);
  * a walk that falls back to whole-text ids (SegmentMismatch) stores nothing.
tests/test_chain_cache.py compares cached against uncached keys on random conversations rendered with the real
Qwen2.5 tokenizer and template.

The digest is XXH3-128 (per-process random seed) over those numbers: the text is not encoded or hashed again
(it was hashed once by the piece cache's dictionary, whose hash the later lookup of the same string reuses).
The ledger is looked up afresh every time (blocks are evicted): only tokenizing and hashing are skipped.

Its counts (hits, misses, stores, stores skipped as too large, evictions) are plain integers bumped on the routing
thread; extproc's upkeep hands what changed since it last looked to Prometheus (extproc/metrics.py:
report_chain_caches), so a decision pays an integer increment, not a metric write.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import xxhash

_SEED = int.from_bytes(os.urandom(8), "little")
_BYTES_PER_KEY = 56  # a uint64 in the array, a list slot and its int object
_BYTES_PER_ENTRY = 400


@dataclass(frozen=True, slots=True)
class ChainState:
    """Where a walk stood right after a boundary token, hashed as far as the holdback lets it."""

    part: int
    """Index of the first text piece after the boundary (TokenCursor's parts)."""
    chars: int
    """Characters of text before it."""
    tokens: int
    keys: list[int]
    """Keys of the first max(0, (tokens - holdback) // block_size) blocks."""
    array: np.ndarray
    """The same keys as uint64, for the ledger lookup."""
    carry: np.ndarray
    """uint32 ids after those blocks, up to `tokens`."""
    head: tuple[int, ...]
    """The prompt's first ids (observation.FIRST_IDS_LOGGED at most)."""
    fingerprint: Any = None
    """XXH3-64 state over the UTF-8 text before the boundary: observation.prompt_hash of the whole prompt is this
    state fed the rest (streamed XXH3 equals one-shot), so the earlier turns' text is not encoded again."""

    def cost(self) -> int:
        return _BYTES_PER_ENTRY + _BYTES_PER_KEY * len(self.keys) + 4 * int(self.carry.size) + 8 * len(self.head)


class ChainCache:
    """Bounded LRU of ChainStates by prefix digest. Not thread-safe: used on the routing thread only."""

    def __init__(self, max_entries: int = 2048, max_bytes: int = 64 << 20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._cache: OrderedDict[int, ChainState] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = self.stores = self.evictions = 0
        self.skipped = 0
        """Stores refused: one entry would take more than an eighth of max_bytes (a cache of a few such is no LRU)."""
        self._reported = (0, 0, 0, 0, 0)
        self.enabled = True
        """Off: every walk starts from the prompt's beginning (perf/bench_decision.py's "before")."""

    def __len__(self) -> int:
        return len(self._cache)

    @property
    def bytes(self) -> int:
        return self._bytes

    def run(self, parts: list[str], namespace: tuple[int, ...],
            serial: Callable[[int, str], int | None]) -> ChainRun:
        """A prompt's pieces (text at even indices, boundary tokens at odd ones) against the cache. `serial`
        gives the number standing for a piece exactly (SegmentEncoder.serial: its piece cache entry's)."""
        return ChainRun(self, parts if self.enabled else [], namespace, serial)

    def counts(self) -> tuple[int, int, int, int, int]:
        """(hits, misses, stores, skipped, evictions) since the cache was made."""
        return self.hits, self.misses, self.stores, self.skipped, self.evictions

    def unreported(self) -> tuple[int, int, int, int, int]:
        """The counts since the last call (the first call: since the cache was made)."""
        now = self.counts()
        delta = tuple(a - b for a, b in zip(now, self._reported, strict=True))
        self._reported = now
        return delta  # type: ignore[return-value]

    def get(self, digest: int) -> ChainState | None:
        state = self._cache.get(digest)
        if state is not None:
            self._cache.move_to_end(digest)
        return state

    def put(self, digest: int, state: ChainState) -> None:
        cost = state.cost()
        if cost > self.max_bytes // 8:
            self.skipped += 1
            return
        old = self._cache.pop(digest, None)
        if old is not None:
            self._bytes -= old.cost()
        self._cache[digest] = state
        self._bytes += cost
        self.stores += 1
        while len(self._cache) > self.max_entries or self._bytes > self.max_bytes:
            _, gone = self._cache.popitem(last=False)
            self._bytes -= gone.cost()
            self.evictions += 1

    def clear(self) -> None:
        self._cache.clear()
        self._bytes = 0


class ChainRun:
    """One prompt against the cache: find the deepest cached boundary, store a deeper one once it is hashed.

    The digest of a boundary chains the namespace and the pieces' serial numbers (PieceCache.serial:
    one per cached piece, never reused), so the text is never encoded or hashed again here: the piece cache's
    dictionary already hashed and compared it. Pieces are numbered only once cached, so boundaries past the first
    uncached piece get their digests later, as the walk (or its tail) caches the pieces before them."""

    __slots__ = ("_hash", "_pos", "cache", "deepest", "digests", "parts", "restored", "serial")

    def __init__(self, cache: ChainCache, parts: list[str], namespace: tuple[int, ...],
                 serial: Callable[[int, str], int | None]) -> None:
        self.cache = cache
        self.parts = parts
        self.serial = serial
        self._hash = xxhash.xxh3_128(seed=_SEED)
        self._hash.update(repr(namespace).encode())
        self._pos = 0
        self.digests: dict[int, int] = {}
        """Part index after a boundary -> the digest of everything before it."""
        self.deepest = 0
        """Part index of the deepest boundary cached or stored for this prompt."""
        self.restored: ChainState | None = None

    def fingerprint(self, text: str) -> str:
        """observation.prompt_hash(text) for the text these pieces were cut from (or a longer text it begins),
        encoding only what follows the restored boundary."""
        state = self.restored
        if state is None or state.fingerprint is None:
            return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))
        h = state.fingerprint.copy()
        h.update(text[state.chars:].encode("utf-8", "surrogatepass"))
        return str(h.hexdigest())

    def _digest(self, part: int) -> int | None:
        """The digest of the boundary before parts[part], None when a piece before it is not cached."""
        got = self.digests.get(part)
        if got is not None or part > len(self.parts):
            return got
        h, parts, serial = self._hash, self.parts, self.serial
        i = self._pos
        while i < part:
            n = serial(i, parts[i])
            if n is None:
                break
            h.update(n.to_bytes(8, "little", signed=True))
            i += 1
            if not i & 1:
                self.digests[i] = h.intdigest()
        self._pos = i
        return self.digests.get(part)

    def restore(self) -> ChainState | None:
        if not self.parts:  # the cache is off: neither a hit nor a miss
            return None
        self._digest(len(self.parts))
        for part in sorted(self.digests, reverse=True):
            state = self.cache.get(self.digests[part])
            if state is not None:
                self.cache.hits += 1
                self.deepest = part
                self.restored = state
                return state
        self.cache.misses += 1
        return None

    def wants(self, part: int) -> bool:
        return part > self.deepest and self._digest(part) is not None

    def save(self, state: ChainState) -> None:
        digest = self._digest(state.part) if state.part > self.deepest else None
        if digest is None:
            return
        base = self.restored
        if base is not None and base.fingerprint is not None and base.part <= state.part:
            h, start = base.fingerprint.copy(), base.part
        else:
            h, start = xxhash.xxh3_64(), 0
        h.update("".join(self.parts[start:state.part]).encode("utf-8", "surrogatepass"))
        self.deepest = state.part
        self.cache.put(digest, replace(state, fingerprint=h))


def keys_array(prior: np.ndarray | None, keys: list[int], n: int) -> np.ndarray:
    """uint64 array of keys[:n], reusing `prior` (an array of its first keys) when given."""
    start = 0 if prior is None else min(int(prior.size), n)
    fresh = np.array(keys[start:n], dtype=np.uint64)
    if not start:
        return fresh
    assert prior is not None
    return np.concatenate((prior[:start], fresh)) if fresh.size else prior[:start]
