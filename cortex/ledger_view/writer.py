"""The ledger view's single writer (ingest): inserts, deletes, growth and metadata under the seqlock."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from cortex.ledger_view.layout import (
    _H_HEARTBEAT,
    _H_META_LEN,
    _H_META_VERSION,
    _H_RETIRED,
    _H_SEQ,
    _H_SIZE,
    _MAX_KEY,
    _MIN_CAPACITY,
    _REBUILD_DIVISOR,
    _as_keys,
    _layout,
    _lookup,
    _Mapping,
    _place,
    _probe,
    _write_header,
)

_SMALL = 8
"""Up to this many keys, add and remove probe and write in plain Python over the memoryviews: every numpy call costs
about a microsecond whatever its size and the vectorised path makes a dozen or more, so a write of one or two keys
(one engine step's batch under live traffic: the common case) costs 5-9 µs of CPU this way against 21-30 µs that
way; at 24 keys the two are even (`python perf/bench_view.py --small`, docs/performance.md)."""


class ViewWriter:
    """The single writer. Create it once per ingest incarnation; it replaces whatever file is at `path`."""

    def __init__(self, path: str | os.PathLike[str], *, max_workers: int = 64, capacity: int = 1 << 16,
                 meta_bytes: int = 1 << 20, max_load: float = 0.5) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be positive")
        if capacity < 1:
            raise ValueError("capacity must be positive")
        if meta_bytes < 2:
            raise ValueError("meta_bytes must hold at least an empty document")
        if not 0.0 < max_load <= 0.9:
            # Linear probing degrades sharply past ~0.9, and _place needs the table never to fill.
            raise ValueError("max_load must be in (0, 0.9]")
        self._path = os.fspath(path)
        self._max_workers = max_workers
        self._words = -(-max_workers // 64)
        self._meta_cap = meta_bytes
        self._max_load = max_load
        self._epoch = secrets.randbits(64) or 1
        self._depth = 0
        self._size = 0
        self._m: _Mapping | None = None
        cap = max(_MIN_CAPACITY, 1 << (capacity - 1).bit_length())
        try:
            predecessor: _Mapping | None = _Mapping.open(self._path, writable=True)
        except (OSError, ValueError):
            predecessor = None
        try:
            # The document starts empty, but its version continues the predecessor's: a reader that compares
            # versions alone then still sees the next set_meta as a change.
            self._m = self._build(cap, np.empty(0, np.uint64), np.empty((0, self._words), np.uint64),
                                  meta=None,
                                  meta_version=0 if predecessor is None else predecessor.hdr[_H_META_VERSION])
            if predecessor is not None:
                # Readers still on the old incarnation's file see this and refresh onto ours.
                predecessor.hdr[_H_RETIRED] = 1
        finally:
            if predecessor is not None:
                predecessor.release()

    # -- properties

    @property
    def size(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        return self._mapping().capacity

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def max_workers(self) -> int:
        return self._max_workers

    @property
    def path(self) -> str:
        return self._path

    # -- write sections

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Make every op inside one atomic update for readers. Keep it short: readers retry meanwhile."""
        m = self._mapping()
        if self._depth == 0:
            m.hdr[_H_SEQ] = m.hdr[_H_SEQ] + 1
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                # Growth inside the section may have swapped files; close the section on the live one.
                hdr = self._mapping().hdr
                hdr[_H_SEQ] = hdr[_H_SEQ] + 1
                hdr[_H_HEARTBEAT] = time.monotonic_ns()

    # -- table operations

    def add(self, worker: int, keys: Iterable[int]) -> None:
        if isinstance(keys, list) and len(keys) <= _SMALL and self._add_small(worker, keys):
            return
        word, bit, _ = self._bit(worker)
        q = self._checked(keys)
        if q.size == 0:
            return
        slots = _lookup(self._mapping(), q, prefix=False)
        absent = slots < 0
        new = np.unique(q[absent]) if absent.any() else None
        if new is not None and self._size + new.size > self._max_load * self._mapping().capacity:
            self._grow(self._size + new.size)
            slots = _lookup(self._mapping(), q, prefix=False)
        m = self._mapping()
        if new is not None:
            placed = self._plan_inserts(m, new)
            slots[absent] = placed[np.searchsorted(new, q[absent])]
        # All probing is done above; the section itself is a few vectorised stores, so readers rarely
        # collide with it.
        with self.batch():
            if new is not None:
                m.keys[placed] = new  # empty slots always have zero bits, so the rows need no clearing
                self._set_size(m, self._size + new.size)
            m.bits[slots, word] |= bit

    def remove(self, worker: int, keys: Iterable[int]) -> None:
        if isinstance(keys, list) and len(keys) <= _SMALL:
            self._remove_small(worker, keys)
            return
        word, _, clear = self._bit(worker)
        q = self._checked(keys)
        if q.size == 0:
            return
        m = self._mapping()
        slots = _lookup(m, q, prefix=False)
        slots = slots[slots >= 0]
        if slots.size == 0:
            return
        kept = m.bits[slots, word] & clear
        if self._words == 1:
            dead = slots[kept == 0]
        else:
            rows = m.bits[slots]
            rows[:, word] = kept
            dead = slots[~rows.any(axis=1)]
        plan = self._plan_deletes(m, np.unique(m.keys[dead]).tolist()) if dead.size else None
        with self.batch():
            m.bits[slots, word] = kept
            if plan is not None:
                self._apply(m, plan)

    def clear_worker(self, worker: int) -> None:
        word, bit, clear = self._bit(worker)
        m = self._mapping()
        had = (m.bits[:, word] & bit).nonzero()[0]
        if had.size == 0:
            return
        rows = m.bits[had]
        rows[:, word] &= clear
        dead = had[~rows.any(axis=1)]
        if dead.size > m.capacity // _REBUILD_DIVISOR:
            # Rebuilding into a new file leaves the current one untouched, so readers keep matching against
            # a consistent (if slightly stale) table, and the new one appears in a single rename.
            occupied = m.keys.nonzero()[0]
            bits = m.bits[occupied]
            bits[:, word] &= clear
            live = bits.any(axis=1)
            self._replace(m.capacity, m.keys[occupied][live], bits[live])
            return
        plan = self._plan_deletes(m, m.keys[dead].tolist()) if dead.size else None
        with self.batch():
            m.bits[had, word] &= clear
            if plan is not None:
                self._apply(m, plan)

    def set_meta(self, doc: dict[str, Any] | bytes) -> None:
        """Replace the meta document: a JSON-able dict, or a document already encoded as JSON bytes (ingest
        encodes cortex.contract.ClusterMeta itself)."""
        raw = doc if isinstance(doc, bytes) else orjson.dumps(doc)
        if len(raw) > self._meta_cap:
            raise ValueError(f"meta document is {len(raw)} bytes, the view holds at most {self._meta_cap}")
        m = self._mapping()
        with self.batch():
            m.meta[:len(raw)] = raw
            m.hdr[_H_META_LEN] = len(raw)
            m.hdr[_H_META_VERSION] = m.hdr[_H_META_VERSION] + 1

    def heartbeat(self) -> None:
        # A single aligned word: readers need no seqlock to read it whole.
        self._mapping().hdr[_H_HEARTBEAT] = time.monotonic_ns()

    def close(self, *, unlink: bool = False) -> None:
        m = self._m
        if m is None:
            return
        self._m = None
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(self._path)
                # Never unlink a successor's file.
                if (st.st_ino, st.st_dev) == (m.ino, m.dev):
                    os.unlink(self._path)
        m.release()

    def __enter__(self) -> ViewWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals

    def _add_small(self, worker: int, keys: list[int]) -> bool:
        """`add` for a few keys, in Python. False (nothing written) when the table must grow first: the vectorised
        path does that."""
        word, bit, _ = self._bit(worker)
        keys = _check_small(keys)
        m = self._mapping()
        kmv, words, mask = m.kmv, m.words, m.mask
        slots: list[int] = []
        new: dict[int, int] = {}  # absent key -> the empty slot it takes
        for k in keys:
            i = _probe(m, k)
            if i < 0:
                new[k] = -1
            else:
                slots.append(i)
        if new:
            if self._size + len(new) > self._max_load * m.capacity:
                return False
            taken: set[int] = set()
            for k in new:
                i = k & mask
                while kmv[i] or i in taken:
                    i = (i + 1) & mask
                taken.add(i)
                new[k] = i
                slots.append(i)
        b = int(bit)
        bmv = m.bmv
        with self.batch():
            for k, i in new.items():
                kmv[i] = k  # empty slots always have zero bits, so the rows need no clearing
            if new:
                self._set_size(m, self._size + len(new))
            for i in slots:
                j = i * words + word
                bmv[j] |= b
        return True

    def _remove_small(self, worker: int, keys: list[int]) -> None:
        """`remove` for a few keys, in Python."""
        word, bit, _ = self._bit(worker)
        keys = _check_small(keys)
        m = self._mapping()
        bmv, kmv, words = m.bmv, m.kmv, m.words
        clear = ~int(bit)
        slots = {i for i in (_probe(m, k) for k in keys) if i >= 0}
        if not slots:
            return
        dead = []
        for i in slots:
            j = i * words
            row = list(bmv[j:j + words])
            row[word] &= clear
            if not any(row):
                dead.append(kmv[i])
        plan = self._plan_deletes(m, dead) if dead else None
        with self.batch():
            for i in slots:
                j = i * words + word
                bmv[j] &= clear
            if plan is not None:
                self._apply(m, plan)

    def _mapping(self) -> _Mapping:
        if self._m is None:
            raise ValueError("view writer is closed")
        return self._m

    def _bit(self, worker: int) -> tuple[int, np.uint64, np.uint64]:
        if not 0 <= worker < self._max_workers:
            raise ValueError(f"worker {worker} outside 0..{self._max_workers - 1}")
        b = 1 << (worker & 63)
        return worker >> 6, np.uint64(b), np.uint64(_MAX_KEY ^ b)

    @staticmethod
    def _checked(keys: Iterable[int]) -> np.ndarray:
        q = _as_keys(keys)
        if q.size and not q.all():
            raise ValueError("block key 0 is reserved for empty slots")
        return q

    def _set_size(self, m: _Mapping, size: int) -> None:
        self._size = size
        m.hdr[_H_SIZE] = size

    @staticmethod
    def _plan_inserts(m: _Mapping, new: np.ndarray) -> np.ndarray:
        """Slots for distinct absent keys, found without writing (the writes happen in the section)."""
        kmv, mask = m.kmv, m.mask
        taken: set[int] = set()
        out = []
        for k in new.tolist():
            i = k & mask
            while kmv[i] or i in taken:
                i = (i + 1) & mask
            taken.add(i)
            out.append(i)
        return np.array(out, dtype=np.intp)

    @staticmethod
    def _plan_deletes(m: _Mapping, keys: list[int]) -> dict[int, tuple[int, int]]:
        """Backward-shift deletion of present keys, simulated on an overlay of the table outside the write
        section. Returns {slot: (its new key, the slot whose bits row it takes; -1 = zero the row)}."""
        kmv, mask = m.kmv, m.mask
        over: dict[int, tuple[int, int]] = {}  # slot -> (key now there, slot its bits row comes from)
        for k in keys:
            i = k & mask
            while True:
                v = over.get(i)
                if (v[0] if v is not None else kmv[i]) == k:
                    break
                i = (i + 1) & mask
            j = i
            while True:
                j = (j + 1) & mask
                v = over.get(j)
                if v is None:
                    v = (kmv[j], j)
                x = v[0]
                if x == 0:
                    break
                # x may fill the hole at i only if its home is not cyclically inside (i, j].
                if ((j - (x & mask)) & mask) >= ((j - i) & mask):
                    over[i] = v
                    i = j
            over[i] = (0, -1)
        return over

    def _apply(self, m: _Mapping, over: dict[int, tuple[int, int]]) -> None:
        """Carry out a `_plan_deletes` plan: slot -> (its new key, the slot whose bits row it takes; -1 = zero)."""
        if len(over) <= _SMALL:
            self._apply_small(m, over)
            return
        n = len(over)
        dst = np.fromiter(over, dtype=np.intp, count=n)
        keys = np.fromiter((v[0] for v in over.values()), dtype=np.uint64, count=n)
        src = np.fromiter((v[1] for v in over.values()), dtype=np.intp, count=n)
        moved = src >= 0
        rows = m.bits[src[moved]]  # gathered before any store, as sources may be overwritten below
        m.keys[dst] = keys
        m.bits[dst[moved]] = rows
        m.bits[dst[~moved]] = 0
        # Slots that end empty are exactly the deleted keys': a shift never refills an earlier hole, since
        # that hole ends the cluster walk.
        self._set_size(m, self._size - int(np.count_nonzero(keys == 0)))

    def _apply_small(self, m: _Mapping, over: dict[int, tuple[int, int]]) -> None:
        kmv, bmv, words = m.kmv, m.bmv, m.words
        # Rows gathered before any store, as sources may be overwritten below.
        rows = [(d, bmv[s * words:(s + 1) * words].tolist() if s >= 0 else None) for d, (_, s) in over.items()]
        emptied = 0
        for d, (k, _) in over.items():
            kmv[d] = k
            emptied += k == 0
        for d, row in rows:
            base = d * words
            for w in range(words):
                bmv[base + w] = row[w] if row is not None else 0
        self._set_size(m, self._size - emptied)

    def _grow(self, need: int) -> None:
        m = self._mapping()
        cap = m.capacity * 2
        while need > self._max_load * cap:
            cap *= 2
        occupied = m.keys.nonzero()[0]
        self._replace(cap, m.keys[occupied], m.bits[occupied])

    def _replace(self, capacity: int, keys: np.ndarray, bits: np.ndarray) -> None:
        """Publish a new file holding exactly (keys, bits) and retire the current one."""
        old = self._mapping()
        self._m = self._build(capacity, keys, bits, meta=old)
        old.hdr[_H_RETIRED] = 1
        old.release()

    def _build(self, capacity: int, keys: np.ndarray, bits: np.ndarray, meta: _Mapping | None,
               meta_version: int = 0) -> _Mapping:
        """Write a complete file under a temporary name in the target directory, then rename it into place.
        The document and its version come from `meta` if given, else the document is empty at `meta_version`.
        """
        target = Path(self._path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        total = _layout(capacity, self._words, self._meta_cap)[3]
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        mm: mmap.mmap | None = None
        new: _Mapping | None = None
        try:
            try:
                os.ftruncate(fd, total)
                mm = mmap.mmap(fd, total)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            # Built inside a batch, the file must look mid-update until that batch ends.
            _write_header(mm, epoch=self._epoch, seq=1 if self._depth else 0, capacity=capacity,
                          max_workers=self._max_workers, words=self._words, meta_cap=self._meta_cap)
            new = _Mapping(mm, st.st_ino, st.st_dev)
            if keys.size:
                slots = _place(keys, capacity)
                new.keys[slots] = keys
                new.bits[slots] = bits
            new.hdr[_H_SIZE] = keys.size
            if meta is not None:
                length = meta.hdr[_H_META_LEN]
                new.meta[:length] = meta.meta[:length]
                new.hdr[_H_META_LEN] = length
                new.hdr[_H_META_VERSION] = meta.hdr[_H_META_VERSION]
            else:
                new.hdr[_H_META_VERSION] = meta_version
            os.rename(tmp, self._path)
        except BaseException:
            if new is not None:
                new.release()
            elif mm is not None:
                mm.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._size = int(keys.size)
        return new

    def _check(self) -> None:
        """Assert every table invariant (tests and debugging; O(capacity) Python)."""
        m = self._mapping()
        keys = m.keys.tolist()
        mask = m.mask
        occupied = [i for i, k in enumerate(keys) if k]
        assert len(occupied) == self._size == m.hdr[_H_SIZE], "size out of sync"
        assert len({keys[i] for i in occupied}) == len(occupied), "duplicate key"
        assert not m.bits[m.keys == 0].any(), "bits left in an empty slot"
        assert m.bits[m.keys != 0].any(axis=1).all(), "key held by no worker"
        for i in occupied:
            j = keys[i] & mask
            while j != i:
                assert keys[j], f"key in slot {i} unreachable from its home {keys[i] & mask}"
                j = (j + 1) & mask


def _check_small(keys: list[int]) -> list[int]:
    """What `_checked` enforces, for a short list of keys: the keys as Python ints."""
    if not all(type(k) is int for k in keys):
        if not all(isinstance(k, int | np.integer) for k in keys):
            raise ValueError("block keys must be integers")
        keys = [int(k) for k in keys]
    for k in keys:
        if not 0 < k <= _MAX_KEY:
            raise ValueError("block key 0 is reserved for empty slots" if k == 0 else
                             f"block keys must be in [1, 2**64), got {k}")
    return keys
