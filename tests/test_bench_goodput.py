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

from cortexbench import goodput, slo
from cortexbench.workloads import Workload
from cortexsim.timing import TimingModel

REPO = Path(__file__).resolve().parents[1]


# ---- whether a run met the SLOs ----

def _json(ttft_ms: float | None, itl_ms: float | None, error: str | None = None) -> dict[str, Any]:
    return {"ttft_ms": ttft_ms, "itl_ms": itl_ms, "error": error}


def test_nearest_rank_is_exact_at_whole_ranks() -> None:
    assert slo.nearest_rank(list(range(1, 11)), 90) == 9 and slo.nearest_rank(list(range(1, 11)), 91) == 10
    assert slo.nearest_rank([3.0, 1.0, 2.0], 50) == 2.0 and slo.nearest_rank([], 90) is None
    assert slo.nearest_rank(list(range(1, 101)), 99) == 99 and slo.nearest_rank([5.0], 0) == 5.0


FIXED = slo.TtftSlo(ms=2000)


def test_verdict_counts_failures_as_missing_both_slos() -> None:
    nine_fast = [_json(100.0, 10.0)] * 9
    assert slo.verdict([*nine_fast, _json(5000.0, 10.0)], FIXED, 50)["ok"]  # p90 of 10: the 9th, 100 ms
    v = slo.verdict([*nine_fast[:8], _json(5000.0, 10.0), _json(6000.0, 10.0)], FIXED, 50)
    assert not v["ok"] and v["ttft_ms"] == 5000.0 and v["ttft_within_slo"] == 0.8
    failed = slo.verdict([*nine_fast[:8], _json(None, None, "boom"), _json(None, None, "cut")], FIXED, 50)
    assert not failed["ok"] and failed["ttft_ms"] is None and failed["itl_ms"] is None and failed["errors"] == 2
    assert slo.verdict([*nine_fast, _json(None, None, "boom")], FIXED, 50)["ok"]  # one in ten may fail
    slow_tokens = slo.verdict([_json(100.0, 10.0)] * 8 + [_json(100.0, 80.0)] * 2, FIXED, 50)
    assert not slow_tokens["ok"] and slow_tokens["itl_ms"] == 80.0
    # One-token answers have no ITL: the TTFT alone decides; no request at all fails.
    assert slo.verdict([_json(100.0, None)] * 3, FIXED, 50) == {
        "ok": True, "ttft_ms": 100.0, "itl_ms": None, "requests": 3, "errors": 0, "ttft_within_slo": 1.0}
    assert not slo.verdict([], FIXED, 50)["ok"]
    assert slo.verdict([_json(100.0, 10.0)] * 5 + [_json(3000.0, 10.0)] * 5, FIXED, 50, percentile=50)["ok"]


# ---- the relative TTFT SLO: a multiple of each request's solo time ----

def _rec(ttft_ms: float | None, prompt_tokens: int, itl_ms: float | None = 10.0,
         error: str | None = None) -> dict[str, Any]:
    return {"ttft_ms": ttft_ms, "itl_ms": itl_ms, "error": error, "prompt_tokens": prompt_tokens}


def _linear(n: int) -> float:
    """A toy solo curve: 0.1 ms a token (1 000 tokens: 100 ms; 50 000: 5 s)."""
    return 0.1 * n


def test_relative_ttft_slo_judges_each_request_against_its_own_solo_time() -> None:
    five = slo.TtftSlo(slowdown=5)
    # The same 3 s TTFT: within the SLO for a 50 000-token prompt (0.6 x its 5 s solo), 30 x over for a 1 000-token
    # one; a fixed 2 s SLO would say the opposite of the first.
    assert slo.ttft_slowdowns([_rec(3000.0, 50000), _rec(3000.0, 1000)], _linear) == [0.6, 30.0]
    long_ok = [_rec(3000.0, 50000)] * 9 + [_rec(3000.0, 1000)]
    v = slo.verdict(long_ok, five, 50, solo_ms=_linear)
    assert v["ok"] and v["ttft_slowdown"] == 0.6 and v["ttft_ms"] == 3000.0 and v["ttft_within_slo"] == 0.9
    assert not slo.verdict(long_ok, FIXED, 50)["ok"]  # the fixed SLO fails every one of them
    # Two short prompts behind long prefills: 2 in 10 over 5 x, p90 is the 9th ratio (30 x).
    v = slo.verdict([_rec(3000.0, 50000)] * 8 + [_rec(3000.0, 1000)] * 2, five, 50, solo_ms=_linear)
    assert not v["ok"] and v["ttft_slowdown"] == 30.0 and v["ttft_within_slo"] == 0.8
    # Exactly X times the solo time meets it; a failure (or a completion the worker counted no prompt for) is
    # infinitely slow; the ITL SLO still applies.
    assert slo.verdict([_rec(500.0, 1000)] * 10, five, 50, solo_ms=_linear)["ok"]
    v = slo.verdict([_rec(100.0, 1000)] * 8 + [_rec(None, 0, None, "boom"), _rec(100.0, 0)], five, 50,
                    solo_ms=_linear)
    assert not v["ok"] and v["ttft_slowdown"] is None and v["errors"] == 1
    assert not slo.verdict([_rec(100.0, 1000, 80.0)] * 10, five, 50, solo_ms=_linear)["ok"]
    with pytest.raises(ValueError, match="solo curve"):
        slo.verdict(long_ok, five, 50)


def test_the_simulated_solo_curve_is_the_simulators_cold_prefill() -> None:
    solo = slo.simulated_solo_ms()
    model = TimingModel()
    for n in (1, 500, 8192, 8193, 60000, 131072):
        assert solo(n) == pytest.approx(1000.0 * model.cold_prefill_seconds(n))
    # Chunks of the 8 192-token step budget, each a step of its own, attention growing with context: superlinear.
    assert solo(8193) - solo(8192) >= model.decode_ms_per_token and solo(60000) > 2 * solo(30000)
    assert 4000 < solo(60000) < 5000 and 45 < solo(1000) < 60  # ~4.7 s and ~52 ms with the sourced defaults
    assert slo.simulated_solo_ms(TimingModel(prefill_ms_per_token=1.0))(1000) > 1000
    with pytest.raises(ValueError, match="zero-compute"):
        slo.simulated_solo_ms(TimingModel(prefill_ms_per_token=0, decode_ms_per_token=0, decode_ms_per_seq=0,
                                          attention_ms_per_ktoken2=0, kv_read_ms_per_ktoken=0))


def test_ttft_slo_forms_and_defaults() -> None:
    assert slo.default_ttft("trace") == slo.TtftSlo(slowdown=slo.SLO_TTFT_SLOWDOWN)
    assert slo.default_ttft("shared-prefix") == slo.default_ttft("agentic") == slo.TtftSlo(ms=slo.SLO_TTFT_MS)
    rel = slo.TtftSlo(slowdown=5)
    assert rel.relative and not FIXED.relative and slo.TtftSlo.from_json(rel.as_json()) == rel
    assert slo.TtftSlo.from_json(FIXED.as_json()) == FIXED and "timing.py" in rel.as_json()["solo"]
    assert rel.describe() == "TTFT ≤ 5 × the request's solo time" and FIXED.describe() == "TTFT ≤ 2000 ms"
    for bad in ({}, {"ms": 1, "slowdown": 2}, {"ms": 0}, {"slowdown": 0.5}, {"slowdown": math.inf}):
        with pytest.raises(ValueError):
            slo.TtftSlo(**bad)


def test_grace_covers_what_the_longest_prompt_may_take_within_a_relative_slo() -> None:
    w = Workload("trace", (), {"longest_prompt_tokens": 50000, "max_tokens": 64})
    fixed = goodput.Judge(FIXED, 100.0, 90.0, None)
    assert goodput.grace_s(w, fixed) == goodput.GRACE_S
    # 5 x 5 s for the longest prompt's first token, 64 gaps of 100 ms, a second of slack.
    assert goodput.grace_s(w, goodput.Judge(slo.TtftSlo(slowdown=5), 100.0, 90.0, _linear)) == 25 + 6.4 + 1
    short = Workload("trace", (), {"longest_prompt_tokens": 1000, "max_tokens": 64})
    assert goodput.grace_s(short, goodput.Judge(slo.TtftSlo(slowdown=5), 100.0, 90.0, _linear)) == goodput.GRACE_S


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
    block: dict[str, Any] = {
        "workload": "shared-prefix", "params": {"requests": 24, "working_set_tokens": 5},
        "rate_unit": "requests/s", "fleet": {"workers": 2, "kv_tokens_per_worker": 12288, "kv_fill": 0.8},
        "results": {
            "a": {"goodput": 8.0, "bound": "bracketed", "fails_at": 16.0, "passed_run": run_ok,
                  "failed_run": run_bad, "runs": [run_ok, run_bad]},
            "b": {"goodput": 16.0, "bound": "at least", "fails_at": None, "passed_run": run_bad,
                  "failed_run": None, "runs": [run_ok]},
            "c": {"goodput": None, "bound": "below", "fails_at": 8.0, "passed_run": None, "failed_run": run_ok,
                  "runs": [run_ok]},
            "d": {"failed": "boom", "runs": []}, "e": {"unavailable": "not installed"}}}
    # A run saved before SLOs were per workload: its blocks name none, the run's one fixed SLO holds.
    text = goodput.table(block, {"percentile": 90.0, "ttft_ms": 2000.0})
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 8 | 8/s: 250.0 ms / 20.0 ms, hit 0.500, 0/24 errors | 16/s: 2500.0 ms / 20.0 ms" in rows["a"]
    assert "8 ✓, 16 ✗" in rows["a"] and "| ≥ 16 |" in rows["b"] and "| < 8 |" in rows["c"]
    assert "failed: boom" in rows["d"] and "not available" in rows["e"] and "working_set_tokens" not in text
    assert "TTFT p90 / ITL p90" in rows["contestant"] and "TTFT SLO: TTFT ≤ 2000 ms" in text
    # A relative SLO: the runs show TTFT over solo time, the header what the solo curve asked.
    rel = {**block, "replicas": 4, "ttft_slo": {"slowdown": 5.0, "solo": "x"}, "grace_s": 73.9,
           "solo_ms": {"1000": 56.0, "100000": 9620.0},
           "results": {"a": {**block["results"]["a"], "passed_run": {**run_ok, "ttft_slowdown": 3.25},
                             "failed_run": {**run_bad, "ttft_slowdown": 12.0}}}}
    text = goodput.table(rel, {"percentile": 90.0, "ttft": "per workload", "grace_s": 30.0})
    assert "each run waits up to 73.9 s after its last send" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 8 | 8/s: 3.25× / 20.0 ms, hit 0.500, 0/24 errors | 16/s: 12.00× / 20.0 ms" in rows["a"]
    assert "TTFT/solo p90 / ITL p90" in rows["contestant"] and text.startswith("**shared-prefix, 4 replicas**")
    assert "TTFT ≤ 5 × the request's solo time (cold prefill alone" in text and "1K tokens 56.0 ms" in text


def test_goodput_runs_merge_into_one_report() -> None:
    head = {"started": "t", "machine": {"cpus": 2, "cpu_model": "", "platform": "p", "python": "3",
                                        "loadavg_at_start": [1.0]},
            "cluster": {"workers": 8, "engine": "vllm", "kv_tokens_per_worker": 262144},
            "slo": {"ttft": "per workload", "itl_ms": 100.0, "percentile": 90.0, "max_runs": 4, "max_seconds": 60.0,
                    "grace_s": 30.0}}
    one = {**head, "command": "cortex bench --goodput --replicas 1", "elapsed_s": 10.0, "contestants": {"a": "A"},
           "goodput": {"trace": {"x": 1}}}
    four = {**head, "command": "cortex bench --goodput --replicas 4", "elapsed_s": 20.0, "contestants": {"b": "B"},
            "goodput": {"trace, 4 replicas": {"x": 4}}}
    merged = goodput.merge([one, four])
    assert list(merged["goodput"]) == ["trace", "trace, 4 replicas"] and merged["elapsed_s"] == 30.0
    assert merged["contestants"] == {"a": "A", "b": "B"} and merged["command"].splitlines() == [
        one["command"], four["command"]]


# ---- end to end, tiny ----

def _goodput_run(tmp_path: Path, name: str, *slo: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    r = subprocess.run(
        [sys.executable, "-m", "cortexctl.cli", "bench", "--goodput", "--workload", "shared-prefix", "--requests", "6",
         "--contestant", "round-robin", "--workers", "2", "--max-seconds", "10", "--json", str(out),
         "--report", str(tmp_path / f"{name}.md"), "--work-dir", str(tmp_path / name), *slo],
        cwd=REPO, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| round-robin |" in (tmp_path / f"{name}.md").read_text()
    return json.loads(out.read_text())


@pytest.mark.timeout(200)
def test_goodput_end_to_end(tmp_path: Path) -> None:
    # Every run within SLOs no request can miss (a relative TTFT SLO of 10^5 x each request's solo time): the
    # ladder climbs its 3 runs and reports a lower bound.
    loose = _goodput_run(tmp_path, "loose", "--goodput-runs", "3", "--slo-ttft-slowdown", "100000",
                         "--slo-itl-ms", "600000")
    block = loose["goodput"]["shared-prefix"]
    res = block["results"]["round-robin"]
    assert [r["rate"] for r in res["runs"]] == [8.0, 16.0, 32.0] and all(r["ok"] for r in res["runs"])
    assert res["bound"] == "at least" and res["goodput"] == 32.0 and res["failed_run"] is None
    assert all(r["requests"] == 6 and r["errors"] == 0 and r["ttft_ms"] > 0 and r["itl_ms"] > 0
               and r["ttft_slowdown"] > 0 and r["ttft_within_slo"] == 1.0 for r in res["runs"])
    assert block["fleet"]["workers"] == 2 and "records" not in res["runs"][0]
    assert loose["slo"]["ttft"]["slowdown"] == 100000 and block["ttft_slo"]["slowdown"] == 100000
    assert set(block["solo_ms"]) == {"1000", "10000", "30000", "100000"}
    # An ITL SLO under a microsecond no stream meets (the simulator's decode step is milliseconds): down the
    # ladder, nothing passes. No TTFT SLO given: shared-prefix is judged by the fixed default.
    tight = _goodput_run(tmp_path, "tight", "--goodput-runs", "2", "--slo-itl-ms", "0.001")
    block = tight["goodput"]["shared-prefix"]
    res = block["results"]["round-robin"]
    assert [r["rate"] for r in res["runs"]] == [8.0, 4.0] and not any(r["ok"] for r in res["runs"])
    assert res["bound"] == "below" and res["goodput"] is None and res["fails_at"] == 4.0
    assert block["ttft_slo"] == {"ms": slo.SLO_TTFT_MS} and tight["slo"]["ttft"] == "per workload"


@pytest.mark.parametrize(("argv", "says"), [
    (["--slo-ttft-slowdown", "0.5"], "multiple >= 1"),
    (["--slo-ttft-ms", "-1"], "positive number of ms"),
    (["--trace", "perf/traces/mooncake-small.jsonl", "--trace-start", "0,30"], "one --trace-start window"),
    (["--seeds", "1,2"], "no --bypass, --restart-workers or --seeds"),
])
def test_goodput_refuses_what_it_cannot_judge(argv: list[str], says: str) -> None:
    from cortexbench import cli

    with pytest.raises(SystemExit, match=says):
        cli.main(["--goodput", *argv])


def test_goodput_takes_one_ttft_slo_form() -> None:
    r = subprocess.run([sys.executable, "-m", "cortexctl.cli", "bench", "--goodput", "--slo-ttft-ms", "1",
                        "--slo-ttft-slowdown", "2"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
