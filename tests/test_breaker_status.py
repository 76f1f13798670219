"""The breaker status files extproc processes write and ingest reads (cortex/breaker_status.py)."""

from __future__ import annotations

from pathlib import Path

from cortex import breaker_status

A, B = "127.0.0.1:9000", "127.0.0.1:9001"


def test_the_worst_state_over_processes_and_an_open_one_past_its_time_reads_half_open(tmp_path: Path) -> None:
    breaker_status.write(breaker_status.path(tmp_path, 0), {
        A: {"state": "open", "failures": 0, "successes": 0, "trials": 0, "half_open_in_s": 30.0},
        B: {"state": "closed", "failures": 2, "successes": 0, "trials": 0}})
    breaker_status.write(breaker_status.path(tmp_path, 1), {
        A: {"state": "half_open", "failures": 0, "successes": 1, "trials": 1}})
    breaker_status.path(tmp_path, 2).write_text("{not json")  # a torn or foreign file counts as nothing
    now = breaker_status.read(tmp_path, 3)
    assert now[A] == {"state": "open", "processes": {"0": "open", "1": "half_open"}}
    assert now[B] == {"state": "closed", "processes": {"0": "closed"}}
    later = breaker_status.read(tmp_path, 3, now=breaker_status.time.time() + 31)
    assert later[A]["state"] == "half_open"
    # A process index beyond the configured count (a shrunk fleet of processes) is not read.
    assert breaker_status.read(tmp_path, 0) == {}
