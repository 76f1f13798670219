"""Goodput: whether a run met its SLOs, and the bounded search for the highest rate that does (pure, with fake
measurements); then `cortex bench --goodput` end to end, tiny (two workers, round-robin, a few requests), with
SLOs that every run meets or none can, so the outcome does not depend on the machine's speed."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cortex.bench import goodput

REPO = Path(__file__).resolve().parents[1]


# ---- whether a run met the SLOs ----

def _json(ttft_ms: float | None, itl_ms: float | None, error: str | None = None) -> dict[str, Any]:
    return {"ttft_ms": ttft_ms, "itl_ms": itl_ms, "error": error}


def test_nearest_rank_is_exact_at_whole_ranks() -> None:
    assert goodput.nearest_rank(list(range(1, 11)), 90) == 9 and goodput.nearest_rank(list(range(1, 11)), 91) == 10
    assert goodput.nearest_rank([3.0, 1.0, 2.0], 50) == 2.0 and goodput.nearest_rank([], 90) is None
    assert goodput.nearest_rank(list(range(1, 101)), 99) == 99 and goodput.nearest_rank([5.0], 0) == 5.0


def test_verdict_counts_failures_as_missing_both_slos() -> None:
    nine_fast = [_json(100.0, 10.0)] * 9
    assert goodput.verdict([*nine_fast, _json(5000.0, 10.0)], 2000, 50)["ok"]  # p90 of 10: the 9th, 100 ms
    v = goodput.verdict([*nine_fast[:8], _json(5000.0, 10.0), _json(6000.0, 10.0)], 2000, 50)
    assert not v["ok"] and v["ttft_ms"] == 5000.0 and v["ttft_within_slo"] == 0.8
    failed = goodput.verdict([*nine_fast[:8], _json(None, None, "boom"), _json(None, None, "cut")], 2000, 50)
    assert not failed["ok"] and failed["ttft_ms"] is None and failed["itl_ms"] is None and failed["errors"] == 2
    assert goodput.verdict([*nine_fast, _json(None, None, "boom")], 2000, 50)["ok"]  # one in ten may fail
    slow_tokens = goodput.verdict([_json(100.0, 10.0)] * 8 + [_json(100.0, 80.0)] * 2, 2000, 50)
    assert not slow_tokens["ok"] and slow_tokens["itl_ms"] == 80.0
    # One-token answers have no ITL: the TTFT alone decides; no request at all fails.
    assert goodput.verdict([_json(100.0, None)] * 3, 2000, 50) == {
        "ok": True, "ttft_ms": 100.0, "itl_ms": None, "requests": 3, "errors": 0, "ttft_within_slo": 1.0}
    assert not goodput.verdict([], 2000, 50)["ok"]
    assert goodput.verdict([_json(100.0, 10.0)] * 5 + [_json(3000.0, 10.0)] * 5, 2000, 50, percentile=50)["ok"]


# ---- the search ----

def _fake(limit: float, calls: list[float]) -> Any:
    """A measurement that passes at rates up to `limit` inclusive and records every rate it is asked for."""
    def measure(rate: float) -> tuple[bool, dict[str, Any]]:
        calls.append(rate)
        return rate <= limit, {"ttft_ms": 1.0 if rate <= limit else math.inf}
    return measure


@pytest.mark.parametrize(("limit", "start", "rates", "goodput_", "fails_at", "bound"), [
    # Up the ladder from 4: 4, 8 pass, 16 fails; bisection 12 ✗, 10 ✓, 11 ✓ (6 runs).
    (11.0, 4.0, [4, 8, 16, 12, 10, 11], 11.0, 12.0, "bracketed"),
    # Down from 8: 8 ✗, 4 ✗, 2 ✓; then 3 ✓, 3.5 ✗, 3.25 ✓.
    (3.3, 8.0, [8, 4, 2, 3, 3.5, 3.25], 3.25, 3.5, "bracketed"),
    # Never fails within 6 runs: a lower bound at the top of the ladder.
    (1e9, 1.0, [1, 2, 4, 8, 16, 32], 32.0, None, "at least"),
    # Never passes: below the lowest rate tried.
    (0.0, 8.0, [8, 4, 2, 1, 0.5, 0.25], None, 0.25, "below"),
    # Bisection stops once the bracket is within 10 %: 10 ✓, 20 ✗, 15 ✗, 12.5 ✓, 13.75 ✗ (13.75 / 12.5 = 1.1).
    (13.0, 10.0, [10, 20, 15, 12.5, 13.75], 12.5, 13.75, "bracketed"),
])
def test_search_returns_the_bracket(limit: float, start: float, rates: list[float], goodput_: float | None,
                                    fails_at: float | None, bound: str) -> None:
    calls: list[float] = []
    res = goodput.search(_fake(limit, calls), start)
    assert calls == rates and [r["rate"] for r in res["runs"]] == rates
    assert (res["goodput"], res["fails_at"], res["bound"]) == (goodput_, fails_at, bound)
    assert all(r["ok"] == (r["rate"] <= limit) for r in res["runs"]) and len(calls) <= goodput.MAX_RUNS
    if res["passed_run"] is not None:
        assert res["passed_run"]["rate"] == goodput_ and res["passed_run"]["ok"]
    if res["failed_run"] is not None:
        assert res["failed_run"]["rate"] == fails_at and not res["failed_run"]["ok"]


def test_search_is_bounded_and_exact_when_the_limit_is_a_rung() -> None:
    calls: list[float] = []
    res = goodput.search(_fake(8.0, calls), 2.0, max_runs=3)
    assert calls == [2, 4, 8] and res["bound"] == "at least" and res["goodput"] == 8
    calls = []
    res = goodput.search(_fake(8.0, calls), 2.0, max_runs=12, tolerance=0.0)
    assert res["goodput"] == 8 and res["fails_at"] is not None and res["fails_at"] - 8 < 0.05 and len(calls) == 12
    calls = []
    assert goodput.search(_fake(8.0, calls), 8.0, max_runs=1)["bound"] == "at least" and calls == [8]
    with pytest.raises(ValueError):
        goodput.search(_fake(1.0, []), 0.0)


@pytest.mark.parametrize("seed", range(20))
def test_search_keeps_a_passing_rate_below_a_failing_one_whatever_the_noise(seed: int) -> None:
    # Outcomes drawn at random (a noisy machine): the result still names a run that passed and, above it, one
    # that failed, and every bisection probe lies strictly between the bracket it was drawn from.
    rng = random.Random(seed)
    res = goodput.search(lambda r: (rng.random() < 0.5, {}), 4.0)
    runs = res["runs"]
    assert 1 <= len(runs) <= goodput.MAX_RUNS
    passed = [r["rate"] for r in runs if r["ok"]]
    if res["goodput"] is not None:
        assert res["passed_run"]["ok"] and res["goodput"] in passed
    if res["bound"] == "bracketed":
        assert not res["failed_run"]["ok"] and res["goodput"] < res["fails_at"]
        assert all(not r["ok"] for r in runs if res["goodput"] < r["rate"] <= res["fails_at"])
    elif res["bound"] == "at least":
        assert all(r["ok"] for r in runs)
    else:
        assert not passed and res["fails_at"] == min(r["rate"] for r in runs)


def test_goodput_table_shows_the_bracket() -> None:
    run_ok = {"rate": 8.0, "ok": True, "ttft_ms": 250.0, "itl_ms": 20.0, "hit_ratio": 0.5, "errors": 0,
              "requests": 24}
    run_bad = {**run_ok, "rate": 16.0, "ok": False, "ttft_ms": 2500.0}
    block = {"workload": "shared-prefix", "params": {"requests": 24, "working_set_tokens": 5},
             "rate_unit": "requests/s", "fleet": {"workers": 2, "kv_tokens_per_worker": 12288, "kv_fill": 0.8},
             "results": {
                 "a": {"goodput": 8.0, "bound": "bracketed", "fails_at": 16.0, "passed_run": run_ok,
                       "failed_run": run_bad, "runs": [run_ok, run_bad]},
                 "b": {"goodput": 16.0, "bound": "at least", "fails_at": None, "passed_run": run_bad,
                       "failed_run": None, "runs": [run_ok]},
                 "c": {"goodput": None, "bound": "below", "fails_at": 8.0, "passed_run": None, "failed_run": run_ok,
                       "runs": [run_ok]},
                 "d": {"failed": "boom", "runs": []}, "e": {"unavailable": "not installed"}}}
    text = goodput.table(block, {"percentile": 90.0})
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 8 | 8/s: 250.0 / 20.0 ms, hit 0.500, 0/24 errors | 16/s: 2500.0 / 20.0 ms" in rows["a"]
    assert "8 ✓, 16 ✗" in rows["a"] and "| ≥ 16 |" in rows["b"] and "| < 8 |" in rows["c"]
    assert "failed: boom" in rows["d"] and "not available" in rows["e"] and "working_set_tokens" not in text
    assert "TTFT p90 / ITL p90" in rows["contestant"]


# ---- end to end, tiny ----

def _goodput_run(tmp_path: Path, name: str, *slo: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    r = subprocess.run(
        [sys.executable, "-m", "cortex.cli", "bench", "--goodput", "--workload", "shared-prefix", "--requests", "6",
         "--contestant", "round-robin", "--workers", "2", "--max-seconds", "10", "--json", str(out),
         "--report", str(tmp_path / f"{name}.md"), "--work-dir", str(tmp_path / name), *slo],
        cwd=REPO, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| round-robin |" in (tmp_path / f"{name}.md").read_text()
    return json.loads(out.read_text())


@pytest.mark.timeout(200)
def test_goodput_end_to_end(tmp_path: Path) -> None:
    # Every run within SLOs no request can miss: the ladder climbs its 3 runs and reports a lower bound.
    loose = _goodput_run(tmp_path, "loose", "--goodput-runs", "3", "--slo-ttft-ms", "600000", "--slo-itl-ms",
                         "600000")
    block = loose["goodput"]["shared-prefix"]
    res = block["results"]["round-robin"]
    assert [r["rate"] for r in res["runs"]] == [8.0, 16.0, 32.0] and all(r["ok"] for r in res["runs"])
    assert res["bound"] == "at least" and res["goodput"] == 32.0 and res["failed_run"] is None
    assert all(r["requests"] == 6 and r["errors"] == 0 and r["ttft_ms"] > 0 and r["itl_ms"] > 0
               for r in res["runs"])
    assert block["fleet"]["workers"] == 2 and loose["slo"]["ttft_ms"] == 600000 and "records" not in res["runs"][0]
    # An ITL SLO under a microsecond no stream meets (the simulator's decode step is milliseconds): down the
    # ladder, nothing passes.
    tight = _goodput_run(tmp_path, "tight", "--goodput-runs", "2", "--slo-itl-ms", "0.001")
    res = tight["goodput"]["shared-prefix"]["results"]["round-robin"]
    assert [r["rate"] for r in res["runs"]] == [8.0, 4.0] and not any(r["ok"] for r in res["runs"])
    assert res["bound"] == "below" and res["goodput"] is None and res["fails_at"] == 4.0
