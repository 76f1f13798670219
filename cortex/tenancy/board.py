"""Each tenant's counters, shared by a replica's extproc processes and its observer through small files.

- `held-x<i>.bin`, one per extproc process (its only writer): per tenant, requests in flight and tokens reserved.
  A restarted process replaces its file with zeros: the requests it held ended with its ext_proc streams, so
  their slots and reservations are released with them.
- `charged-<writer>.bin`: per tenant, tokens charged in the current minute and quota period (window id, amount).
  The observer charges what the engines report; an extproc process charges only when no observer runs. Kept
  across restarts: a restart must not hand a tenant its quota back.
- `rate.bin`: per tenant, the request bucket's theoretical arrival time (cortex/tenancy/limits.py: gcra), and
  `slots.json`, tenant id -> row, so a reload that reorders tenants keeps each one's counters.
A check and the counter it moves happen under one `flock` (`lock`), held for microseconds, so limits are exact
across processes; releases need no lock (a process only lowers its own counters).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

CAPACITY = 1024
"""Tenants a replica can count (ids beyond it share the last row; the config is far smaller)."""
INFLIGHT, RESERVED = 0, 1
MINUTE_WINDOW, MINUTE_CHARGED, QUOTA_WINDOW, QUOTA_CHARGED = 0, 1, 2, 3


def _mapped(path: Path, shape: tuple[int, ...], reset: bool) -> np.ndarray:
    size = int(np.prod(shape)) * 8
    if reset or not path.exists() or path.stat().st_size != size:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(b"\x00" * size)
        os.replace(tmp, path)
    return np.memmap(path, dtype=np.float64, mode="r+", shape=shape)


class _Views:
    """Read-only maps of other writers' files, kept while the file at the path is the same one (a restarted
    extproc process replaces its file: a new inode is mapped anew). One stat per read instead of a whole read."""

    def __init__(self) -> None:
        self._maps: dict[Path, tuple[tuple[int, int], np.ndarray]] = {}

    def rows(self, path: Path, shape: tuple[int, ...]) -> np.ndarray | None:
        try:
            st = os.stat(path)
        except OSError:
            self._maps.pop(path, None)
            return None
        ident = (st.st_ino, st.st_size)
        held = self._maps.get(path)
        if held is not None and held[0] == ident:
            return held[1]
        if st.st_size != int(np.prod(shape)) * 8:
            return None
        try:
            rows = np.memmap(path, dtype=np.float64, mode="r", shape=shape)
        except (OSError, ValueError):
            return None
        self._maps[path] = (ident, rows)
        return rows


class TenancyBoard:
    def __init__(self, directory: str | os.PathLike[str], writer: str, extproc_processes: int) -> None:
        """`writer`: `x<i>` for extproc process i (owns a held row, reset now), `observer`, or '' to only read."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.writer = writer
        self._lock_fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._held_paths = [self.dir / f"held-x{i}.bin" for i in range(extproc_processes)]
        self._charge_paths = [self.dir / f"charged-x{i}.bin" for i in range(extproc_processes)] + [
            self.dir / "charged-observer.bin"]
        self._slots: dict[str, int] = {}
        self._views = _Views()
        with self.locked():
            self.rate = _mapped(self.dir / "rate.bin", (CAPACITY,), reset=False)
            self.held = _mapped(self.dir / f"held-{writer}.bin", (CAPACITY, 2), reset=True) \
                if writer.startswith("x") else np.zeros((CAPACITY, 2))
            self.charges = _mapped(self.dir / f"charged-{writer}.bin", (CAPACITY, 4), reset=False) \
                if writer else np.zeros((CAPACITY, 4))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def slot(self, tenant: str) -> int:
        """The tenant's row, the same in every process (assigned once, first come)."""
        s = self._slots.get(tenant)
        if s is not None:
            return s
        path = self.dir / "slots.json"
        with self.locked():
            try:
                table: dict[str, int] = json.loads(path.read_text())
            except (OSError, ValueError):
                table = {}
            if tenant not in table:
                table[tenant] = min(len(table), CAPACITY - 1)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(table))
                os.replace(tmp, path)
        self._slots = {k: int(v) for k, v in table.items()}
        return self._slots[tenant]

    def held_total(self, slot: int) -> np.ndarray:
        """(in flight, reserved) for one tenant over every extproc process of the replica."""
        total = np.zeros(2)
        for path in self._held_paths:
            rows = self.held if path.name == f"held-{self.writer}.bin" else self._views.rows(path, (CAPACITY, 2))
            if rows is not None:
                total += rows[slot]
        return total

    def charged(self, slot: int, minute: int, quota_window: int) -> tuple[float, float]:
        """Tokens charged to the tenant in the given minute and quota window, by every writer."""
        in_minute = in_quota = 0.0
        for path in self._charge_paths:
            rows = self._views.rows(path, (CAPACITY, 4))
            if rows is None:
                continue
            row = rows[slot]
            if row[MINUTE_WINDOW] == minute:
                in_minute += row[MINUTE_CHARGED]
            if row[QUOTA_WINDOW] == quota_window:
                in_quota += row[QUOTA_CHARGED]
        return in_minute, in_quota

    def charge(self, slot: int, amount: float, minute: int, quota_window: int) -> None:
        """Add to this writer's charges (its own row: no lock needed)."""
        row = self.charges[slot]
        if row[MINUTE_WINDOW] != minute:
            row[MINUTE_WINDOW], row[MINUTE_CHARGED] = minute, 0.0
        if row[QUOTA_WINDOW] != quota_window:
            row[QUOTA_WINDOW], row[QUOTA_CHARGED] = quota_window, 0.0
        row[MINUTE_CHARGED] += amount
        row[QUOTA_CHARGED] += amount
