"""The in-flight board shared by extproc processes: peers' rows are summed, and a restarted peer's new
row replaces its old one at the next upkeep (issue 11, defect 3)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from cortex.inflight import InflightBoard, Touch, TouchBoard

SLOTS = 8


def _counts(board: InflightBoard) -> list[int]:
    return [int(x) for x in board.totals()]


def test_refresh_keeps_a_live_peer_row(tmp_path: Path) -> None:
    me = InflightBoard(tmp_path, 0, 2, SLOTS)
    peer = InflightBoard(tmp_path, 1, 2, SLOTS)
    peer.inc(3)
    me.inc(3)
    assert _counts(me)[3] == 2
    row = me._rows[1]
    for _ in range(3):
        me.refresh()  # raised AttributeError (mmap has no fileno()) before the fix
    assert me._rows[1] is row, "an unchanged peer file must not be re-mapped"
    peer.inc(3)
    assert _counts(me)[3] == 3


def test_restarted_peer_row_is_remapped(tmp_path: Path) -> None:
    me = InflightBoard(tmp_path, 0, 2, SLOTS)
    old = InflightBoard(tmp_path, 1, 2, SLOTS)
    for _ in range(4):
        old.inc(2)
    assert _counts(me) == [0, 0, 4, 0, 0, 0, 0, 0]
    # The peer restarts: it writes a fresh zeroed file and renames it over the old one. Its old
    # process would be gone; here its mapping stays open, so stale counts would show if we kept it.
    new = InflightBoard(tmp_path, 1, 2, SLOTS)
    new.inc(5)
    me.refresh()
    assert _counts(me) == [0, 0, 0, 0, 0, 1, 0, 0]
    new.dec(5)
    new.inc(6)
    me.refresh()
    assert _counts(me) == [0, 0, 0, 0, 0, 0, 1, 0]


def test_removed_peer_file_stops_counting_and_returns(tmp_path: Path) -> None:
    me = InflightBoard(tmp_path, 0, 3, SLOTS)
    peer = InflightBoard(tmp_path, 2, 3, SLOTS)
    peer.inc(1)
    assert _counts(me)[1] == 1
    (tmp_path / "2.bin").unlink()
    me.refresh()
    assert _counts(me)[1] == 0
    back = InflightBoard(tmp_path, 2, 3, SLOTS)
    back.inc(7)
    assert _counts(me)[1] == 0 and _counts(me)[7] == 1


def test_refresh_while_a_caller_holds_the_old_row(tmp_path: Path) -> None:
    me = InflightBoard(tmp_path, 0, 2, SLOTS)
    InflightBoard(tmp_path, 1, 2, SLOTS).inc(0)
    assert _counts(me)[0] == 1
    held = me._rows[1]  # e.g. a reader mid-sum: closing the mapping under it must not raise
    InflightBoard(tmp_path, 1, 2, SLOTS)
    me.refresh()
    assert int(held[0]) == 1
    assert _counts(me)[0] == 0


_PEER = textwrap.dedent("""
    import sys, time
    from cortex.inflight import InflightBoard
    board = InflightBoard(sys.argv[1], 1, 2, {slots})
    for _ in range(int(sys.argv[3])):
        board.inc(int(sys.argv[2]))
    print("ready", flush=True)
    sys.stdin.readline()
""")


def test_restart_of_a_real_peer_process(tmp_path: Path) -> None:
    """Two real processes: the peer counts, dies, restarts with a new file; the reader follows it."""
    code = _PEER.format(slots=SLOTS)
    me = InflightBoard(tmp_path, 0, 2, SLOTS)

    def start(slot: int, n: int) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(slot), str(n)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p

    first = start(4, 3)
    me.refresh()
    assert _counts(me)[4] == 3
    first.kill()
    first.wait(timeout=30)
    second = start(1, 2)
    try:
        me.refresh()
        assert _counts(me)[4] == 0 and _counts(me)[1] == 2
    finally:
        second.communicate("\n", timeout=30)


def test_a_reader_without_a_row_sums_every_process_and_writes_nothing(tmp_path: Path) -> None:
    # Ingest reads where this replica's requests are in flight (to poll those workers' load at the active
    # cadence); it must neither create a row nor zero one of extproc's.
    reader = InflightBoard(tmp_path, None, 2, SLOTS)
    assert list(tmp_path.iterdir()) == []
    assert _counts(reader) == [0] * SLOTS  # no process started yet
    a, b = InflightBoard(tmp_path, 0, 2, SLOTS), InflightBoard(tmp_path, 1, 2, SLOTS)
    a.inc(1)
    b.inc(1)
    b.inc(5)
    assert _counts(reader) == [0, 2, 0, 0, 0, 1, 0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.bin", "1.bin"]
    b2 = InflightBoard(tmp_path, 1, 2, SLOTS)  # process 1 restarts: its requests ended with it
    reader.refresh()
    assert _counts(reader) == [0, 1, 0, 0, 0, 0, 0, 0] and _counts(b2) == _counts(reader)


def test_touches_are_shared_by_the_replicas_processes_and_the_youngest_wins(tmp_path: Path) -> None:
    a = TouchBoard(tmp_path, 0, 2, SLOTS)
    b = TouchBoard(tmp_path, 1, 2, SLOTS)
    keys = np.array([7, 2**63 + 5, 2**64 - 1], dtype=np.uint64)
    a.note_evicted(3, 1000.0)
    a.touch(3, keys, now=1000.0)
    b.note_evicted(3, 1600.0)
    b.touch(3, keys[:1], now=1004.0)
    a.note_evicted(3, 2000.0)  # what process a reads now
    assert a.last(3, 7, now=1010.0) == Touch(pytest.approx(6.0, abs=0.002), 400.0)  # type: ignore[arg-type]
    assert a.last(3, 2**63 + 5, now=1010.0) == Touch(pytest.approx(10.0, abs=0.002), 1000.0)  # type: ignore[arg-type]
    assert a.last(3, 2**64 - 1, now=1010.0) == Touch(pytest.approx(10.0, abs=0.002), 1000.0)  # type: ignore[arg-type]
    assert a.last(4, 7, now=1010.0) is None  # another worker: never sent there
    assert a.last(3, 8, now=1010.0) is None


def test_a_touch_that_lands_on_an_occupied_entry_forgets_the_older_pair(tmp_path: Path) -> None:
    """The table is direct-mapped: a later pair on the same entry makes the earlier one unknown, never younger;
    an entry whose two words disagree (a write between a reader's two reads) is unknown too."""
    board = TouchBoard(tmp_path, 0, 1, SLOTS)
    board.touch(0, np.array([1], dtype=np.uint64), now=50.0)
    # Same entry index (low bits of the mix), other key and slot: both mixes share their low 16 bits.
    other = 1 ^ (1 * 0x9E3779B97F4A7C15 & (2**64 - 1)) ^ (2 * 0x9E3779B97F4A7C15 & (2**64 - 1)) ^ (1 << 40)
    board.touch(1, np.array([other], dtype=np.uint64), now=60.0)
    assert board.last(0, 1, now=61.0) is None
    assert board.last(1, other, now=61.0) is not None
    idx = int(np.flatnonzero(board.own)[0])
    board.own[idx + 1] ^= np.uint64(1 << 33)  # the count word now carries another tag
    assert board.last(1, other, now=61.0) is None


def test_touch_ages_and_counts_survive_their_32_bit_wrap(tmp_path: Path) -> None:
    board = TouchBoard(tmp_path, 0, 1, SLOTS)
    wrap = 2**32 / 1000.0
    board.note_evicted(2, 2**32 - 100.0)
    board.touch(2, np.array([99], dtype=np.uint64), now=wrap - 1.0)
    board.note_evicted(2, 2**32 + 300.0)
    assert board.last(2, 99, now=wrap + 2.0) == Touch(pytest.approx(3.0, abs=0.002), 400.0)  # type: ignore[arg-type]
