"""The in-flight board shared by extproc processes: peers' rows are summed, and a restarted peer's new
row replaces its old one at the next upkeep (issue 11, defect 3)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from cortex.inflight import InflightBoard

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
