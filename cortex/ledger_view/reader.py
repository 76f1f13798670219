"""The ledger view's lock-free reader (extproc, on the request path): prefix matches under the seqlock."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

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
    _STALE_WRITER_S,
    ViewBusy,
    _as_keys,
    _leading_counts,
    _lookup,
    _Mapping,
    _NotReady,
    _prefix_counts,
    _probe,
    _Torn,
)

T = TypeVar("T")


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
        self._raw_cache: tuple[int, int, bytes] | None = None
        self._meta_cache: tuple[bytes, dict[str, Any]] | None = None
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
        q = _chain(keys)
        return self._consistent(lambda m: _leading_counts(m, q))

    def match_detail(self, keys: Sequence[int] | np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`match`, plus which of the leading keys present in the view each of `slots` holds: bool[n, len(slots)]
        for the n leading keys some slot holds (past them no slot holds any key of the chain). What a hybrid
        model's sliding-window groups and a target's lower tiers need (cortex/hit_rule.py); `match` stays the
        common path."""
        q = _chain(keys)
        # The rows are copied under the seqlock (numpy's gather copies), then read at leisure.
        rows, workers = self._consistent(lambda m: (m.bits[_lookup(m, q, prefix=True)], m.max_workers))
        s = np.asarray(slots, dtype=np.intp)
        bits = ((rows[:, s // 64] >> (s % 64).astype(np.uint64)) & np.uint64(1)).astype(bool)
        return _prefix_counts(rows, workers), bits

    def _consistent(self, read: Callable[[_Mapping], T]) -> T:
        """`read(mapping)` as of one moment of the view: retried while the writer is mid-update or moved
        meanwhile (the seqlock), ViewBusy after RETRIES attempts."""
        m = self._live()
        for attempt in range(self.RETRIES):
            hdr = m.hdr
            seq = hdr[_H_SEQ]
            if seq & 1:
                m = self._wait(m, attempt)
                continue
            try:
                got = read(m)
            except _Torn:
                continue
            if hdr[_H_SEQ] == seq:
                return got
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

    def meta_raw(self) -> tuple[int, bytes]:
        """(version, the document's bytes), read once per version."""
        m = self._live()
        for attempt in range(self.RETRIES):
            hdr = m.hdr
            seq = hdr[_H_SEQ]
            if seq & 1:
                m = self._wait(m, attempt)
                continue
            version = hdr[_H_META_VERSION]
            cached = self._raw_cache
            # Growth copies the document and keeps epoch and version, so the cache survives it.
            if cached is not None and cached[0] == m.epoch and cached[1] == version:
                return version, cached[2]
            length = hdr[_H_META_LEN]
            raw = bytes(m.meta[:length])
            if hdr[_H_SEQ] == seq:
                self._raw_cache = (m.epoch, version, raw)
                return version, raw
        raise ViewBusy(f"view at {self._path} stayed mid-update through {self.RETRIES} attempts")

    def meta(self) -> tuple[int, dict[str, Any]]:
        """(version, document); the document is parsed once per version and shared -- do not mutate it."""
        version, raw = self.meta_raw()
        cached = self._meta_cache
        if cached is not None and cached[0] is raw:
            return version, cached[1]
        doc = orjson.loads(raw) if raw else {}
        self._meta_cache = (raw, doc)
        return version, doc

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

    def followed(self) -> bool:
        """Without a stat(): True if a read since the previous refresh() or followed() followed a retired file onto
        its successor (refresh() also notices a file replaced without being marked retired)."""
        self._live()
        followed, self._followed = self._followed, False
        return followed

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


def _chain(keys: Sequence[int] | np.ndarray) -> np.ndarray:
    q = _as_keys(keys)
    if q.size and not q.all():
        # A zero key is never stored, so the chain is matched only up to it.
        q = q[:int(np.argmin(q != 0))]
    return q
