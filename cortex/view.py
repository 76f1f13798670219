"""The shared ledger view: one writer (`ingest`) publishes which worker holds which block key, many readers
(`extproc`, on the request hot path) read it with no lock and no RPC.

Layout. Everything lives in one file (normally under /dev/shm) that every process maps with `mmap`.
`multiprocessing.shared_memory` is deliberately not used: in 3.11 its resource tracker unlinks a segment when
any attaching process exits, so a restarting reader would delete the writer's view. The file is

    header   16 native uint64 words (magic, layout version, epoch, seqlock counter, heartbeat,
             capacity, max_workers, words per bitset, keys held, meta version, meta length,
             meta capacity, retired flag, reserved)
    meta     `meta capacity` bytes holding an orjson document (routing metadata: worker addresses, ...)
    keys     uint64[capacity]           0 marks an empty slot, so keys are nonzero
    bits     uint64[capacity, words]    bit w set <=> worker w holds the key; words = ceil(max_workers / 64)

The table is open addressing with linear probing from slot `key & (capacity - 1)`: block keys are already
xxh3 outputs, so their low bits are as good as any hash. Deletion is by backward shift, so there are no
tombstones and a probe for an absent key always ends at the first empty slot. At a load of at most 0.5 that
costs 8 + 8 * words bytes per slot, i.e. 32 bytes per key for up to 64 workers when the table is fullest and
64 right after it doubles.

Consistency: a seqlock. The writer makes the counter odd before it mutates and even after; a reader reads
the counter (retrying while it is odd), copies what it needs (numpy fancy indexing copies), re-reads the
counter and retries if it moved, up to `ViewReader.RETRIES` times before raising `ViewBusy`. Readers never
write to the mapping, so any number of them cost the writer nothing. Torn reads are harmless until the
counter check throws them away: every slot index is masked, and probes are bounded.

A seqlock favours the writer: a reader only succeeds if no section opens during its ~20-60 us read. So the
writer keeps sections short: each op does its probing, insert placement and backward-shift deletion
(simulated on an overlay) first, and the section holds only the resulting vectorised stores. A reader that
meets an odd counter polls it briefly before sleeping, which rides out such sections. `batch()` is the
exception by design -- the whole batch is one section -- so a writer that is inside batches nearly all the
time starves readers (they get `ViewBusy` and should route without the view); keep bookkeeping that does
not touch the view outside the batch.

Memory ordering: the counter protocol needs "writer stores become visible in program order" and "reader
loads are performed in program order". x86-64 (TSO) gives both in hardware, so no fences are issued. What
this assumes: (1) the C compiler does not move a load or store across the boundaries between the separate
CPython/numpy calls that make up a section -- each access sits behind calls through function pointers, which
act as compiler barriers in practice though nothing formally promises it; (2) aligned 8-byte header words are
read and written whole (they are, on x86-64); (3) writer and readers share one host and one kernel. On weakly
ordered CPUs (aarch64) a reader's data loads may be satisfied after its second counter load, so a torn read
could go unnoticed; running there needs explicit barriers, which this module does not provide.

Growth and replacement: the writer never resizes a mapping. When the keys held would exceed `max_load` of the
capacity it builds a file of double capacity next to the path under a temporary name, copies the entries,
`os.rename`s it over the path and then sets the retired flag in the old file. A restarted writer does the
same with a fresh random epoch, so readers can tell an incarnation change (their cached view of the ledger
is gone) from a mere growth. A reader detects replacement with `refresh()` (the path's inode differs from
its mapping's); `match`, `meta` and `heartbeat_age` also refresh on their own when they see the retired flag,
which costs one word read per call. The old mapping stays valid, and stale but consistent, until the reader
drops it, so a reader is never left holding unmapped memory. If replacement happens inside a `batch()`, the
new file starts with an odd counter and the old one is left odd, so no reader ever sees half a batch.

Liveness: the writer stores `time.monotonic_ns()` as a heartbeat (on `heartbeat()` and at the end of every
write section). CLOCK_MONOTONIC is system-wide on Linux (one clock per boot, shared by all processes unless
they sit in different time namespaces), so a reader can compute the writer's silence directly. A writer that
dies inside a write section leaves the counter odd: readers then get `ViewBusy` (immediately once the
heartbeat is stale) until a new writer replaces the file.

Byte order is native; the magic word rejects a file from a host of the other endianness. The writer is not
thread-safe (it is meant to be driven by one ingest loop); a reader may be shared by threads, as `refresh`
swaps in a whole new mapping object rather than mutating the one a concurrent `match` is using.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

__all__ = ["ViewBusy", "ViewReader", "ViewWriter", "default_path"]

_MAGIC = int.from_bytes(b"CTXVIEW1", sys.byteorder)
_LAYOUT_VERSION = 1

(_H_MAGIC, _H_VERSION, _H_EPOCH, _H_SEQ, _H_HEARTBEAT, _H_CAPACITY, _H_MAX_WORKERS, _H_WORDS, _H_SIZE,
 _H_META_VERSION, _H_META_LEN, _H_META_CAP, _H_RETIRED) = range(13)
_HEADER_WORDS = 16
_HEADER_BYTES = _HEADER_WORDS * 8
_ALIGN = 64  # regions start on cache-line boundaries

_MIN_CAPACITY = 8
_MAX_KEY = (1 << 64) - 1
# Below this many unresolved keys a probe walk in Python beats another stage of numpy calls.
_SCALAR_TAIL = 16
# Slots past the home slot that the second probe stage gathers at once. At load 0.5 a linear probe
# runs past 1 + 8 slots rarely enough that the Python walk after it handles the stragglers cheaply.
_WINDOW = 8
_RAMP = np.arange(1, _WINDOW + 1, dtype=np.int64)
# clear_worker rebuilds into a new file instead of shifting slot by slot once more than
# capacity / _REBUILD_DIVISOR slots empty at once: a vectorised rebuild is O(capacity) but each
# backward shift is a few microseconds of Python.
_REBUILD_DIVISOR = 8
# A reader that finds the counter odd and the heartbeat older than this assumes the writer died
# mid-section and fails fast instead of sleeping through its retries.
_STALE_WRITER_S = 1.0


class ViewBusy(RuntimeError):
    """The writer kept the view mid-update through every retry; the caller should route without it."""


class _Torn(Exception):
    """A probe ran longer than the table: the reader saw a half-written table and must retry."""


class _NotReady(ValueError):
    """The file exists but does not hold a header yet."""


def default_path(name: str = "ledger") -> Path:
    """Where a view lives unless configured otherwise: tmpfs, so the mapping never touches a disk."""
    base = Path("/dev/shm")
    if not base.is_dir():
        base = Path(tempfile.gettempdir())
    return base / f"cortex-view-{name}"


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _layout(capacity: int, words: int, meta_cap: int) -> tuple[int, int, int, int]:
    """(meta offset, keys offset, bits offset, total bytes) of a file."""
    meta_off = _HEADER_BYTES
    keys_off = _round_up(meta_off + meta_cap, _ALIGN)
    bits_off = keys_off + capacity * 8
    total = bits_off + capacity * words * 8
    return meta_off, keys_off, bits_off, total


class _Mapping:
    """One mapped file and the array/memoryview windows over it. Immutable once built, so readers can swap
    whole mappings atomically by rebinding one attribute."""

    __slots__ = ("bits", "bmv", "capacity", "dev", "epoch", "hdr", "ino", "keys", "kmv", "mask",
                 "max_workers", "meta", "meta_cap", "mm", "umask", "words")

    def __init__(self, mm: mmap.mmap, ino: int, dev: int) -> None:
        if len(mm) < _HEADER_BYTES:
            raise _NotReady("view file is shorter than its header")
        hdr = memoryview(mm)[:_HEADER_BYTES].cast("Q")
        magic, version = hdr[_H_MAGIC], hdr[_H_VERSION]
        if magic == 0:
            hdr.release()
            raise _NotReady("view file header not written yet")
        if magic != _MAGIC:
            hdr.release()
            raise ValueError(f"not a Cortex view file (magic {magic:#x})")
        if version != _LAYOUT_VERSION:
            hdr.release()
            raise ValueError(f"view layout version {version}, this build reads {_LAYOUT_VERSION}")
        capacity, words, meta_cap = hdr[_H_CAPACITY], hdr[_H_WORDS], hdr[_H_META_CAP]
        max_workers = hdr[_H_MAX_WORKERS]
        meta_off, keys_off, bits_off, total = _layout(capacity, words, meta_cap)
        if (capacity < 1 or capacity & (capacity - 1) or words != -(-max_workers // 64)
                or len(mm) < total):
            hdr.release()
            raise ValueError("corrupt view file header")
        self.mm = mm
        self.ino, self.dev = ino, dev
        self.hdr = hdr
        self.epoch = hdr[_H_EPOCH]
        self.capacity, self.words, self.max_workers, self.meta_cap = capacity, words, max_workers, meta_cap
        self.mask = capacity - 1
        self.umask = np.uint64(capacity - 1)
        self.keys = np.frombuffer(mm, dtype=np.uint64, count=capacity, offset=keys_off)
        self.bits = np.frombuffer(mm, dtype=np.uint64, count=capacity * words, offset=bits_off).reshape(
            capacity, words)
        # Scalar paths (inserts, backward shifts, short probe tails) go through memoryviews: indexing one
        # returns a Python int in tens of nanoseconds, a numpy scalar costs several times that.
        self.kmv = memoryview(mm)[keys_off:bits_off].cast("Q")
        self.bmv = memoryview(mm)[bits_off:total].cast("Q")
        self.meta = memoryview(mm)[meta_off:meta_off + meta_cap]

    @classmethod
    def open(cls, path: str, *, writable: bool = False) -> _Mapping:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        try:
            # Identity comes from the descriptor, not the path: the path may be renamed over meanwhile.
            st = os.fstat(fd)
            if st.st_size < _HEADER_BYTES:
                raise _NotReady("view file is shorter than its header")
            mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            return cls(mm, st.st_ino, st.st_dev)
        except BaseException:
            mm.close()
            raise

    def release(self) -> None:
        """Unmap now if nothing else holds a window; otherwise the last reference's collection unmaps."""
        for mv in (self.hdr, self.kmv, self.bmv, self.meta):
            mv.release()
        self.keys = self.bits = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self.mm.close()


def _as_keys(keys: Iterable[int] | np.ndarray) -> np.ndarray:
    """Keys as a 1-D uint64 array; values outside [0, 2**64) are a ValueError."""
    if isinstance(keys, np.ndarray):
        if keys.dtype == np.uint64:
            return keys.reshape(-1)
        if keys.dtype.kind == "u":
            return keys.reshape(-1).astype(np.uint64)
        if keys.dtype.kind == "i":
            if keys.size and keys.min() < 0:
                raise ValueError("block keys must be non-negative")
            return keys.reshape(-1).astype(np.uint64)
        raise ValueError(f"block keys must be integers, got dtype {keys.dtype}")
    if not isinstance(keys, list | tuple):
        keys = list(keys)
    try:
        q = np.array(keys, dtype=np.uint64)
    except OverflowError as e:
        raise ValueError(f"block keys must be in [1, 2**64): {e}") from None
    if q.ndim != 1:
        raise ValueError("block keys must be a flat sequence")
    return q


def _lookup(m: _Mapping, q: np.ndarray, prefix: bool) -> np.ndarray:
    """Slots of the nonzero keys `q` (a contiguous uint64 array).

    prefix=False: one slot per key, -1 where the key is absent. prefix=True: only the slots of the leading
    run of present keys (past the first absent key nothing counts, so those probes are skipped).

    Every numpy call costs about a microsecond here whatever its size, so the probe is staged to use few of
    them: all keys look at their home slot in one gather; the ones that collided look at the next
    _WINDOW slots in one 2-D gather (at load <= 0.5 that ends almost every probe); the rare rest, and any
    stage with only a handful of keys, walk in plain Python over the memoryview.
    """
    table = m.keys
    mask = m.mask
    idx = q.view(np.int64) & mask
    got = table[idx]
    pend = (got != q).nonzero()[0]
    if not pend.size:
        return idx
    n = q.size
    empty = got[pend] == 0
    if prefix:
        if empty.any():
            # pend is ascending, so the first empty home slot is the chain's first absent key.
            cut = int(empty.argmax())
            n = int(pend[cut])
            pend = pend[:cut]
    elif empty.any():
        idx[pend[empty]] = -1
        pend = pend[~empty]
    start = idx[pend]
    if pend.size > _SCALAR_TAIL:
        qp = q[pend]
        window = table[(start[:, None] + _RAMP) & mask]
        hit = window == qp[:, None]
        stop = hit | (window == 0)
        first = stop.argmax(axis=1)
        rows = np.arange(pend.size)
        ended = stop[rows, first]
        found = hit[rows, first]
        idx[pend[found]] = (start[found] + first[found] + 1) & mask
        missed = ended & ~found
        if missed.any():
            if prefix:
                cut = int(missed.argmax())
                n = int(pend[cut])
                ended = ended[:cut]
                pend = pend[:cut]
                start = start[:cut]
            else:
                idx[pend[missed]] = -1
        pend = pend[~ended]
        start = (start[~ended] + _WINDOW) & mask
    if pend.size:
        kmv = m.kmv
        for j, p, k in zip(pend.tolist(), start.tolist(), q[pend].tolist(), strict=True):
            if j >= n:
                break
            for _ in range(mask):
                p = (p + 1) & mask
                x = kmv[p]
                if x == k:
                    idx[j] = p
                    break
                if x == 0:
                    if prefix:
                        n = j
                    else:
                        idx[j] = -1
                    break
            else:
                raise _Torn
    return idx[:n] if prefix else idx


def _probe(m: _Mapping, key: int) -> int:
    """Slot of one key, or -1."""
    kmv, mask = m.kmv, m.mask
    i = key & mask
    for _ in range(mask + 1):
        x = kmv[i]
        if x == key:
            return i
        if x == 0:
            return -1
        i = (i + 1) & mask
    raise _Torn


def _prefix_counts(b: np.ndarray, max_workers: int) -> np.ndarray:
    """For rows b[i] = holders of key i (bitsets), how many leading rows each worker appears in."""
    out = [0] * max_workers
    n = b.shape[0]
    if n:
        # cum[i] = workers holding keys 0..i. It only ever loses bits, so each worker's count is the row
        # where its bit drops out. Only rows where cum changes matter and there are at most max_workers of
        # them, so they are decoded in Python: fewer numpy calls than any vectorised bit unpacking.
        words = b.shape[1]
        if words == 1:
            cum = np.bitwise_and.accumulate(b.reshape(n))
            ends = (cum[:-1] != cum[1:]).nonzero()[0].tolist()
            ends.append(n - 1)
            sets = [[v] for v in cum[ends].tolist()]
        else:
            cum = np.bitwise_and.accumulate(b, axis=0)
            ends = (cum[:-1] != cum[1:]).any(axis=1).nonzero()[0].tolist()
            ends.append(n - 1)
            sets = cum[ends].tolist()
        after = [0] * words
        for end, row in zip(reversed(ends), reversed(sets), strict=True):
            for w in range(words):
                gone = row[w] & ~after[w]
                while gone:
                    low = gone & -gone
                    out[w * 64 + low.bit_length() - 1] = end + 1
                    gone ^= low
            after = row
    return np.array(out, dtype=np.int32)


def _place(keys: np.ndarray, capacity: int) -> np.ndarray:
    """Slots for distinct keys inserted into an empty linear-probing table, computed without a Python loop.

    Sorted by home slot h, key i lands at p_i = max(h_i, p_{i-1} + 1) = i + max_{j<=i}(h_j - j). Keys pushed
    past the end wrap to slot 0: placing those `over` keys first (home 0) and redoing the pass moves every
    other key to max(p_i, over + i) <= n - 1, so nothing wraps twice, and the cluster that ends at the last
    slot (where the wrapped keys' homes are) does not move at all since p_i = capacity - n + over + i there.
    Any placement where every slot from a key's home to its slot is occupied is a valid table.
    """
    n = keys.size
    if n == 0:
        return np.empty(0, np.intp)
    if n >= capacity:
        raise ValueError("table overfull")
    home = (keys & np.uint64(capacity - 1)).astype(np.intp)
    order = np.argsort(home, kind="stable")
    h = home[order]
    ramp = np.arange(n, dtype=np.intp)
    pos = ramp + np.maximum.accumulate(h - ramp)
    over = int(np.count_nonzero(pos >= capacity))
    if over:
        order = np.concatenate([order[n - over:], order[:n - over]])
        h = np.concatenate([np.zeros(over, np.intp), h[:n - over]])
        pos = ramp + np.maximum.accumulate(h - ramp)
        if pos[-1] >= capacity:
            raise AssertionError("linear-probing placement wrapped twice")
    slots = np.empty(n, np.intp)
    slots[order] = pos
    return slots


def _write_header(mm: mmap.mmap, *, epoch: int, seq: int, capacity: int, max_workers: int, words: int,
                  meta_cap: int) -> None:
    fields = [0] * _HEADER_WORDS
    fields[_H_MAGIC] = _MAGIC
    fields[_H_VERSION] = _LAYOUT_VERSION
    fields[_H_EPOCH] = epoch
    fields[_H_SEQ] = seq
    fields[_H_HEARTBEAT] = time.monotonic_ns()
    fields[_H_CAPACITY] = capacity
    fields[_H_MAX_WORKERS] = max_workers
    fields[_H_WORDS] = words
    fields[_H_META_CAP] = meta_cap
    struct.pack_into(f"{_HEADER_WORDS}Q", mm, 0, *fields)


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

    def set_meta(self, doc: dict[str, Any]) -> None:
        raw = orjson.dumps(doc)
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
    def _plan_deletes(m: _Mapping, keys: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Backward-shift deletion of present keys, simulated on an overlay of the table outside the write
        section. Returns (slots, their new keys, the slot whose bits row each takes; -1 = zero the row)."""
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
        n = len(over)
        return (np.fromiter(over, dtype=np.intp, count=n),
                np.fromiter((v[0] for v in over.values()), dtype=np.uint64, count=n),
                np.fromiter((v[1] for v in over.values()), dtype=np.intp, count=n))

    def _apply(self, m: _Mapping, plan: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        dst, keys, src = plan
        moved = src >= 0
        rows = m.bits[src[moved]]  # gathered before any store, as sources may be overwritten below
        m.keys[dst] = keys
        m.bits[dst[moved]] = rows
        m.bits[dst[~moved]] = 0
        # Slots that end empty are exactly the deleted keys': a shift never refills an earlier hole, since
        # that hole ends the cluster walk.
        self._set_size(m, self._size - int(np.count_nonzero(keys == 0)))

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


class ViewReader:
    """A lock-free reader. Cheap to construct; safe to recreate at any time (the view lives in the file)."""

    # Attempts before ViewBusy. A reader that finds the counter odd first polls it for up to _SPIN_NS (a
    # single op's write section lasts microseconds, far less than the shortest sleep); if the section is
    # still open -- a long batch -- it sleeps, doubling from _BACKOFF_S. Worst case about 3 ms in all,
    # unless the heartbeat says the writer is dead, which fails at once.
    RETRIES = 8
    _SPIN_NS = 100_000
    _BACKOFF_S = 25e-6

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(path)
        self._m: _Mapping | None = _Mapping.open(self._path)
        self._meta_cache: tuple[int, int, dict[str, Any]] | None = None
        self._followed = False

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ViewReader | None:
        try:
            return cls(path)
        except (FileNotFoundError, _NotReady):
            return None

    @property
    def epoch(self) -> int:
        return self._live().epoch

    @property
    def max_workers(self) -> int:
        return self._live().max_workers

    @property
    def size(self) -> int:
        return self._live().hdr[_H_SIZE]

    @property
    def path(self) -> str:
        return self._path

    def match(self, keys: Sequence[int] | np.ndarray) -> np.ndarray:
        """int32[max_workers]: per worker, how many leading keys of the chain it holds."""
        q = _as_keys(keys)
        if q.size and not q.all():
            # A zero key is never stored, so the chain is matched only up to it.
            q = q[:int(np.argmin(q != 0))]
        m = self._live()
        for attempt in range(self.RETRIES):
            hdr = m.hdr
            seq = hdr[_H_SEQ]
            if seq & 1:
                m = self._wait(m, attempt)
                continue
            try:
                slots = _lookup(m, q, prefix=True) if q.size else q.astype(np.intp)
                rows = m.bits[slots]
            except _Torn:
                continue
            if hdr[_H_SEQ] == seq:
                return _prefix_counts(rows, m.max_workers)
        raise ViewBusy(f"view at {self._path} stayed mid-update through {self.RETRIES} attempts")

    def holders(self, key: int) -> list[int]:
        if key < 0 or key > _MAX_KEY:
            raise ValueError("block keys must be in [1, 2**64)")
        if key == 0:
            return []
        m = self._live()
        for attempt in range(self.RETRIES):
            hdr = m.hdr
            seq = hdr[_H_SEQ]
            if seq & 1:
                m = self._wait(m, attempt)
                continue
            try:
                slot = _probe(m, key)
            except _Torn:
                continue
            row = m.bmv[slot * m.words:(slot + 1) * m.words].tolist() if slot >= 0 else []
            if hdr[_H_SEQ] == seq:
                return [w * 64 + b for w, word in enumerate(row) for b in range(64) if word >> b & 1]
        raise ViewBusy(f"view at {self._path} stayed mid-update through {self.RETRIES} attempts")

    def meta(self) -> tuple[int, dict[str, Any]]:
        """(version, document); the document is parsed once per version and shared -- do not mutate it."""
        m = self._live()
        for attempt in range(self.RETRIES):
            hdr = m.hdr
            seq = hdr[_H_SEQ]
            if seq & 1:
                m = self._wait(m, attempt)
                continue
            version = hdr[_H_META_VERSION]
            cached = self._meta_cache
            # Growth copies the document and keeps epoch and version, so the cache survives it.
            if cached is not None and cached[0] == m.epoch and cached[1] == version:
                return version, cached[2]
            length = hdr[_H_META_LEN]
            raw = bytes(m.meta[:length])
            if hdr[_H_SEQ] == seq:
                doc = orjson.loads(raw) if length else {}
                self._meta_cache = (m.epoch, version, doc)
                return version, doc
        raise ViewBusy(f"view at {self._path} stayed mid-update through {self.RETRIES} attempts")

    def heartbeat_age(self) -> float:
        """Seconds since the writer last proved it was alive."""
        beat = self._live().hdr[_H_HEARTBEAT]
        return max(0.0, (time.monotonic_ns() - beat) / 1e9)

    def refresh(self) -> bool:
        """Remap if the file at the path was replaced (growth or a new writer). True if the reader is on a
        different file than at the previous refresh(), including when a call in between followed a retired
        file on its own -- so a caller keying caches on refresh() never misses a replacement."""
        remapped = self._remap() or self._followed
        self._followed = False
        return remapped

    def _remap(self) -> bool:
        m = self._m
        if m is None:
            raise ValueError("view reader is closed")
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return False
        # Inode numbers are recycled, but not this one: our mapping keeps the old file alive.
        if st.st_ino == m.ino and st.st_dev == m.dev:
            return False
        try:
            new = _Mapping.open(self._path)
        except (FileNotFoundError, _NotReady):
            return False
        # The old mapping is not released: a concurrent match may still be reading it. It is unmapped when
        # its last reference goes.
        self._m = new
        return True

    def close(self) -> None:
        m, self._m = self._m, None
        if m is not None:
            m.release()

    def __enter__(self) -> ViewReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live(self) -> _Mapping:
        m = self._m
        if m is None:
            raise ValueError("view reader is closed")
        if m.hdr[_H_RETIRED]:
            if self._remap():
                self._followed = True
            m = self._m
            assert m is not None
        return m

    def _wait(self, m: _Mapping, attempt: int) -> _Mapping:
        """The counter was odd: follow a replacement, wait out a short section, fail fast on a dead writer,
        else back off."""
        hdr = m.hdr
        if hdr[_H_RETIRED]:
            return self._live()
        deadline = time.perf_counter_ns() + self._SPIN_NS
        while hdr[_H_SEQ] & 1:
            if time.perf_counter_ns() > deadline:
                break
        else:
            return m
        if (time.monotonic_ns() - hdr[_H_HEARTBEAT]) / 1e9 > _STALE_WRITER_S:
            raise ViewBusy(f"view at {self._path} was left mid-update by a writer silent for over "
                           f"{_STALE_WRITER_S:g} s")
        if 0 < attempt < self.RETRIES - 1:
            time.sleep(self._BACKOFF_S * (1 << (attempt - 1)))
        return m

