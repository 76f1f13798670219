"""The ledger view's file: header words, regions, and the open-addressing table both sides probe (see the
package docstring for the layout and the seqlock protocol)."""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

try:
    import cortex.ledger_view._native as _native
except ImportError:  # built where a C compiler was found at install (pyproject.toml); the numpy staging otherwise
    _native = None  # type: ignore[assignment]
NATIVE = _native is not None
"""The compiled probe and prefix count (`_native.pyx`) are in use."""

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
            return np.ascontiguousarray(keys.reshape(-1))
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
    run of present keys (past the first absent key nothing counts, so those probes are skipped)."""
    if not q.size:
        return np.zeros(0, dtype=np.int64)
    if _native is None:
        return _lookup_staged(m, q, prefix)
    out = np.empty(q.size, dtype=np.int64)
    n = (_native.leading_slots if prefix else _native.slots_of)(m.keys, q, out)
    if n < 0:
        raise _Torn
    return out[:n]


def _lookup_staged(m: _Mapping, q: np.ndarray, prefix: bool) -> np.ndarray:
    """`_lookup` in numpy, where `_native` is not built.

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


def _leading_counts(m: _Mapping, q: np.ndarray) -> np.ndarray:
    """Per worker, how many leading keys of the chain `q` it holds (int32[max_workers]); raises _Torn."""
    slots = _lookup(m, q, prefix=True)
    if _native is None:
        return _prefix_counts(m.bits[slots], m.max_workers)
    out = np.empty(m.max_workers, dtype=np.int32)
    _native.prefix_counts(m.bits, slots, np.empty(m.words, dtype=np.uint64), out)
    return out


def _prefix_counts(b: np.ndarray, max_workers: int) -> np.ndarray:
    """For rows b[i] = holders of key i (bitsets), how many leading rows each worker appears in."""
    if _native is not None:
        rows = np.ascontiguousarray(b if b.ndim == 2 else b.reshape(-1, 1), dtype=np.uint64)
        out = np.empty(max_workers, dtype=np.int32)
        _native.prefix_counts(rows, np.arange(rows.shape[0], dtype=np.int64), np.empty(rows.shape[1], np.uint64), out)
        return out
    return _prefix_counts_staged(b, max_workers)


def _prefix_counts_staged(b: np.ndarray, max_workers: int) -> np.ndarray:
    """`_prefix_counts` in numpy and Python, where `_native` is not built."""
    n = b.shape[0]
    words = b.shape[1] if b.ndim == 2 else 1
    if n and words > 1 and _LITTLE_ENDIAN:
        return _prefix_counts_wide(b, max_workers)
    out = [0] * max_workers
    if n:
        # cum[i] = workers holding keys 0..i. It only ever loses bits, so each worker's count is the row
        # where its bit drops out. Only rows where cum changes matter and there are at most max_workers of
        # them, so they are decoded in Python: fewer numpy calls than any vectorised bit unpacking.
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


_LITTLE_ENDIAN = sys.byteorder == "little"
"""The wide path reads each uint64 word's bits through its bytes, lowest first."""


def _prefix_counts_wide(b: np.ndarray, max_workers: int) -> np.ndarray:
    """`_prefix_counts` for more than 64 workers, vectorised: a 256-worker fleet whose workers all hold a
    512-block chain has 256 bits to decode, which the Python loop above pays ~0.2 us each for (50 us per lookup
    against ~20 here; docs/performance.md, "Fleet scale"). A worker's bit leaves the running AND at exactly one
    change row (or is never in it), so its count is that row + 1: the max over rows of bit x (row + 1)."""
    n = b.shape[0]
    cum = np.bitwise_and.accumulate(b, axis=0)
    ends = np.append((cum[:-1] != cum[1:]).any(axis=1).nonzero()[0], n - 1)
    sets = cum[ends]
    gone = sets.copy()
    gone[:-1] &= ~sets[1:]
    bits = np.unpackbits(np.ascontiguousarray(gone).view(np.uint8), axis=1, bitorder="little")[:, :max_workers]
    counts: np.ndarray = (bits * (ends + 1).astype(np.int32)[:, None]).max(axis=0).astype(np.int32)
    return counts


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
