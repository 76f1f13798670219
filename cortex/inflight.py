"""Per-worker figures shared by all extproc processes of one replica, without locks.

Each extproc process owns one small file per board (`<board>/<index>.bin`, one number per worker slot) and is
its only writer; a reader combines every process's row. A restarted process starts its row from zero: the
requests it was counting ended with it (their ext_proc streams were torn down).

Three boards: `InflightBoard` counts the requests in flight per worker (int64, summed); `BacklogBoard` keeps,
per worker, the moment the prefill work this process sent there is predicted to be done (float64 on the
host's monotonic clock), so the work queued ahead of a new request is the sum over processes of what is left;
`TouchBoard` keeps when this process last sent each block key to each worker (a direct-mapped table, not one
number per worker), so a claim can tell a prefix the engine used a moment ago from one its LRU is about to evict.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class SlotBoard:
    """The shared mechanics: one row of 8-byte numbers per process, each mapped once."""

    dtype: type[np.generic] = np.int64

    @classmethod
    def width(cls, max_workers: int) -> int:
        """Numbers in one process's row: one per worker slot."""
        return max_workers

    def __init__(self, directory: str | os.PathLike[str], index: int | None, processes: int,
                 max_workers: int) -> None:
        """`index` None: a reader of every process's row that owns none (ingest, to see where this replica's
        requests are in flight)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = index
        self.processes = processes
        self.max_workers = max_workers
        self._width = self.width(max_workers)
        self._size = self._width * 8
        self._maps: dict[int, mmap.mmap] = {}
        self._rows: dict[int, np.ndarray] = {}
        # (st_dev, st_ino) of the file each row was mapped from: a restarted peer replaces its file
        # (os.replace), so a different identity at the path means the mapped row is an orphan.
        self._ids: dict[int, tuple[int, int]] = {}
        if index is None:
            self.own = np.zeros((self._width,), dtype=self.dtype)
            return
        path = self._path(index)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(b"\x00" * self._size)
        os.replace(tmp, path)
        own = self._map(index)
        assert own is not None
        self.own = own

    def _path(self, index: int) -> Path:
        return self.dir / f"{index}.bin"

    def _map(self, index: int) -> np.ndarray | None:
        row = self._rows.get(index)
        if row is not None:
            return row
        try:
            fd = os.open(self._path(index), os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_size < self._size:
                return None
            mm = mmap.mmap(fd, self._size)
        finally:
            os.close(fd)
        self._maps[index] = mm
        self._ids[index] = (st.st_dev, st.st_ino)
        row = np.ndarray((self._width,), dtype=self.dtype, buffer=mm)
        self._rows[index] = row
        return row

    def refresh(self) -> None:
        """Re-map peers' rows (a restarted peer replaced its file). Called off the hot path."""
        for i in list(self._rows):
            if i == self.index:
                continue
            try:
                st = os.stat(self._path(i))
                same = (st.st_dev, st.st_ino) == self._ids[i]
            except OSError:
                same = False  # the file is gone: stop counting a row nobody owns any more
            if same:
                continue
            # Drop our references and never close() the mapping: numpy does not keep the buffer exported,
            # so close() would unmap under any array still viewing the row (a segfault on its next read).
            # The array holds the mmap as its base; the mapping goes when the last reference does.
            self._rows.pop(i)
            self._maps.pop(i)
            self._ids.pop(i, None)


class InflightBoard(SlotBoard):
    """Requests in flight per worker slot, summed over every process."""

    def inc(self, slot: int) -> None:
        self.own[slot] += 1

    def dec(self, slot: int) -> None:
        if self.own[slot] > 0:
            self.own[slot] -= 1

    def totals(self, rows: int | None = None) -> np.ndarray:
        """Per slot, the sum of the first `rows` rows (default all: the replica's processes and, when peered,
        the rows ingest writes for its peers, cortex/peering.py)."""
        total = self.own.copy()
        for i in range(self.processes if rows is None else rows):
            if i != self.index:
                row = self._map(i)
                if row is not None:
                    total += row
        return total


class BacklogBoard(SlotBoard):
    """Prefill work queued per worker slot: each process's row holds when the work it sent there will be done."""

    dtype = np.float64

    def push(self, slot: int, ms: float, now: float | None = None) -> None:
        """Queue `ms` of prefill work on `slot` behind what this process already sent there."""
        t = time.monotonic() if now is None else now
        self.own[slot] = max(float(self.own[slot]), t) + ms / 1000.0

    def lower(self, slot: int, done_at: float) -> None:
        """This process's work on `slot` is done by `done_at` at the latest (never later than it was)."""
        if done_at < self.own[slot]:
            self.own[slot] = done_at

    def backlog_ms(self, now: float | None = None, rows: int | None = None) -> np.ndarray:
        """Per slot, the milliseconds of prefill work every process (of the first `rows`) sent there that are not
        done yet."""
        t = time.monotonic() if now is None else now
        total = np.maximum(self.own - t, 0.0)
        for i in range(self.processes if rows is None else rows):
            if i != self.index:
                row = self._map(i)
                if row is not None:
                    total += np.maximum(row - t, 0.0)
        return total * 1000.0

    def latest(self) -> np.ndarray:
        """Per slot, when the last work any process sent there is predicted done (0: never sent): ingest reads
        it to tell the workers this replica sends requests to (their load is read less often)."""
        latest = self.own.copy()
        for i in range(self.processes):
            if i != self.index:
                row = self._map(i)
                if row is not None:
                    np.maximum(latest, row, out=latest)
        return latest


_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_LOW32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Touch:
    """What a replica knows of a prefix's last use on a worker: how long ago it last sent it there, and how many
    tokens the worker's engine has evicted since (as far as its published count says)."""

    age_s: float
    evicted_tokens: float


class TouchBoard(SlotBoard):
    """When this replica last sent each (worker, block key), and how much the worker had evicted by then: one
    direct-mapped table per process.

    An entry is two 8-byte words, each carrying the same 32-bit tag of the (worker slot, key) pair in its high
    half: the host's monotonic clock in milliseconds (mod 2**32, lowest bit set, so a written word is never 0,
    the empty one) and the worker's eviction count in tokens (mod 2**32) in their low halves. A reader takes an
    entry only when both tags match, so a write landing between its two reads makes the pair unknown, never
    younger. The entry's index is other bits of the same mix as the tag. A pair that lands on an occupied entry
    overwrites it: the older pair is forgotten, which only ever makes its prefix look unknown. Ages up to 2**32 ms
    (49 days) and up to 2**32 tokens evicted in between are told apart.
    """

    dtype = np.uint64
    ENTRIES = 1 << 16
    """Per process: 1 MiB; about the blocks of the last few hundred long prompts."""

    @classmethod
    def width(cls, max_workers: int) -> int:
        return 2 * cls.ENTRIES

    def __init__(self, directory: str | os.PathLike[str], index: int | None, processes: int,
                 max_workers: int) -> None:
        super().__init__(directory, index, processes, max_workers)
        self.evicted = np.zeros((max_workers,), dtype=np.float64)
        """Per worker slot, its eviction count as this process last read it (note_evicted)."""

    def note_evicted(self, slot: int, tokens: float) -> None:
        if 0 <= slot < self.evicted.size:
            self.evicted[slot] = tokens

    @staticmethod
    def _now_ms(now: float | None) -> int:
        return int((time.monotonic() if now is None else now) * 1000.0)

    def touch(self, slot: int, keys: np.ndarray, now: float | None = None) -> None:
        """Record that this process just sent `keys` (uint64 block keys) to worker `slot`."""
        if not len(keys):
            return
        mix = keys ^ np.uint64(((slot + 1) * _GOLDEN) & _MASK64)
        idx = 2 * (mix & np.uint64(self.ENTRIES - 1)).astype(np.intp)
        tag = (mix >> np.uint64(32)) << np.uint64(32)
        self.own[idx] = tag | np.uint64((self._now_ms(now) & _LOW32) | 1)
        self.own[idx + 1] = tag | np.uint64(int(self.evicted[slot]) & _LOW32)

    def last(self, slot: int, key: int, now: float | None = None) -> Touch | None:
        """The youngest send of `key` to worker `slot` by any process of this replica (None: not known)."""
        mix = (key ^ ((slot + 1) * _GOLDEN)) & _MASK64
        idx, tag = 2 * (mix & (self.ENTRIES - 1)), mix >> 32
        now_ms = self._now_ms(now) & _LOW32
        evicted_now = int(self.evicted[slot]) & _LOW32 if 0 <= slot < self.evicted.size else 0
        best: Touch | None = None
        for i in range(self.processes):
            row = self.own if i == self.index else self._map(i)
            if row is None:
                continue
            when, count = int(row[idx]), int(row[idx + 1])
            if when and when >> 32 == tag and count >> 32 == tag:
                age = ((now_ms - (when & _LOW32)) & _LOW32) / 1000.0
                if best is None or age < best.age_s:
                    best = Touch(age, float((evicted_now - (count & _LOW32)) & _LOW32))
        return best
