"""Per-worker figures shared by all extproc processes of one replica, without locks.

Each extproc process owns one small file per board (`<board>/<index>.bin`, one number per worker slot) and is
its only writer; a reader combines every process's row. A restarted process starts its row from zero: the
requests it was counting ended with it (their ext_proc streams were torn down).

Two boards: `InflightBoard` counts the requests in flight per worker (int64, summed); `BacklogBoard` keeps,
per worker, the moment the prefill work this process sent there is predicted to be done (float64 on the
host's monotonic clock), so the work queued ahead of a new request is the sum over processes of what is left.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np


class SlotBoard:
    """The shared mechanics: one row of 8-byte numbers per process, each mapped once."""

    dtype: type[np.generic] = np.int64

    def __init__(self, directory: str | os.PathLike[str], index: int | None, processes: int,
                 max_workers: int) -> None:
        """`index` None: a reader of every process's row that owns none (ingest, to see where this replica's
        requests are in flight)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = index
        self.processes = processes
        self.max_workers = max_workers
        self._size = max_workers * 8
        self._maps: dict[int, mmap.mmap] = {}
        self._rows: dict[int, np.ndarray] = {}
        # (st_dev, st_ino) of the file each row was mapped from: a restarted peer replaces its file
        # (os.replace), so a different identity at the path means the mapped row is an orphan.
        self._ids: dict[int, tuple[int, int]] = {}
        if index is None:
            self.own = np.zeros((max_workers,), dtype=self.dtype)
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
        row = np.ndarray((self.max_workers,), dtype=self.dtype, buffer=mm)
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

    def totals(self) -> np.ndarray:
        total = self.own.copy()
        for i in range(self.processes):
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

    def backlog_ms(self, now: float | None = None) -> np.ndarray:
        """Per slot, the milliseconds of prefill work every process sent there that are not done yet."""
        t = time.monotonic() if now is None else now
        total = np.maximum(self.own - t, 0.0)
        for i in range(self.processes):
            if i != self.index:
                row = self._map(i)
                if row is not None:
                    total += np.maximum(row - t, 0.0)
        return total * 1000.0
