"""In-flight request counts shared by all extproc processes, without locks.

Each extproc process owns one small file (`inflight/<index>.bin`, int64 per worker slot) and is its only
writer; a reader sums every process's row. A restarted process starts its row from zero: the requests it
was counting ended with it (their ext_proc streams were torn down).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np


class InflightBoard:
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
            self.own = np.zeros((max_workers,), dtype=np.int64)
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
        row = np.ndarray((self.max_workers,), dtype=np.int64, buffer=mm)
        self._rows[index] = row
        return row

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
