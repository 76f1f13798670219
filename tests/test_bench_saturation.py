"""`cortex bench --saturation`: the ladder's rules with vectors (what a rung adds, when a ladder stops, what it sums
up to, the ratios, the report), and one short real run of Cortex and Envoy alone on simulated workers.

The run asserts that every rung produced its figures, not how fast anything was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cortexbench import saturation
from cortexbench.client import Record
from cortexbench.contestants import BY_NAME, CONTESTANTS
from cortexbench.launch import Worker, envoy_alone_config

REPO = Path(__file__).resolve().parent.parent


def row(rate: float, added_p99: float | None, *, errors: int = 0, direct_errors: int = 0, lag: float = 1.0,
        **extra: Any) -> dict[str, Any]:
    return {"rate": rate, "requests": 100, "added_p99_ms": added_p99, "errors": errors,
            "direct_errors": direct_errors, "direct_send_lag_p90_ms": lag, **extra}


def test_added_is_a_percentile_through_the_gateway_minus_the_same_percentile_direct() -> None:
    direct = [0.002] * 199 + [0.010]
    via = [0.003] * 199 + [0.030]
    a = saturation.added(via, direct)
    assert a["added_p50_ms"] == 1.0 and a["added_p99_ms"] == 1.0  # nearest rank: one in 200 is above the p99
    assert saturation.added([*via[:99], 0.030], [*direct[:99], 0.010])["added_p99_ms"] == 20.0  # 1 in 100: p99
    assert (a["via_p50_ms"], a["direct_p50_ms"]) == (3.0, 2.0)
    assert saturation.added([0.005] * 50 + [0.040] * 2, [0.002] * 52)["added_p99_ms"] == 38.0
    assert saturation.added([], [0.002])["added_p99_ms"] is None


def test_send_lag_is_how_late_the_client_sent() -> None:
    recs = [Record(i, 0, sent=i * 0.01 + (0.5 if i < 5 else 0.001)) for i in range(100)]
    scheduled = {i: i * 0.01 for i in range(100)}
    assert saturation.send_lag_ms(recs, scheduled) == 1.0  # five stalled sends in 100 do not move the p90
    assert saturation.send_lag_ms(recs, scheduled, 99) == 500.0
    late = [Record(i, 0, sent=i * 0.01 + 0.03) for i in range(100)]  # every send late: the client is behind
    assert saturation.send_lag_ms(late, scheduled) == 30.0
    assert saturation.send_lag_ms([Record(7, 0, sent=1.0)], {}) is None  # warm-up records are not scheduled


def test_stop_rule() -> None:
    limit = 10.0
    assert saturation.stop_reason(row(25, 9.99), limit) is None
    assert saturation.stop_reason(row(25, -4.0), limit) is None  # noise below the baseline is under the limit
    assert saturation.stop_reason(row(25, 10.5), limit) == "added p99 10.5 ms > 10 ms"
    assert saturation.stop_reason(row(25, 2.0, errors=3), limit) == "3 errors"
    assert saturation.stop_reason(row(25, None), limit) == "no request completed"
    # The direct path failing or the client falling behind its schedule is the harness's limit, whatever the
    # gateway did; a client late by less than twice the limit is not.
    direct = saturation.stop_reason(row(25, 50.0, direct_errors=1), limit)
    assert direct is not None and direct.startswith(saturation.HARNESS)
    lagging = saturation.stop_reason(row(25, 50.0, lag=25.0), limit)
    assert lagging is not None and lagging.startswith(saturation.HARNESS)
    assert saturation.stop_reason(row(25, 5.0, lag=15.0), limit) is None
    assert saturation.stop_reason({"rate": 25, "failed": "LaunchError: x"}, limit) == "failed: LaunchError: x"
    # Only a latency breach is sent again, once.
    assert saturation.should_confirm(row(25, 12.0), limit)
    assert not saturation.should_confirm(row(25, 12.0, repeat=True), limit)
    assert saturation.should_confirm(row(25, 1.0, lag=25.0), limit)
    assert not saturation.should_confirm(row(25, 1.0, direct_errors=2), limit)
    assert not saturation.should_confirm(row(25, 2.0, errors=1), limit)
    assert not saturation.should_confirm(row(25, 2.0), limit)


@pytest.mark.parametrize(("rows", "expected"), [
    # Broke the limit at 100 (twice): 50 is the figure, exact.
    ([row(10, 1), row(25, 2), row(50, 4), row(100, 12, superseded=True), row(100, 14, repeat=True)],
     {"max_rate": 50, "stopped_at": 100, "stopped_by": "added p99 14 ms > 10 ms", "lower_bound": False}),
    # A breach the repeat did not confirm is ignored: the ladder went on.
    ([row(10, 1), row(25, 12, superseded=True), row(25, 3, repeat=True), row(50, 11, superseded=True),
      row(50, 20, repeat=True)],
     {"max_rate": 25, "stopped_at": 50, "stopped_by": "added p99 20 ms > 10 ms", "lower_bound": False}),
    # Never broke it: the top of the ladder, a lower bound.
    ([row(10, 1), row(25, 2)], {"max_rate": 25, "stopped_at": None, "stopped_by": "top of the ladder",
                                "lower_bound": True}),
    # Broke it at the first rung: no rate qualifies.
    ([row(10, 30, superseded=True), row(10, 31, repeat=True)],
     {"max_rate": None, "stopped_at": 10, "stopped_by": "added p99 31 ms > 10 ms", "lower_bound": False}),
    # The harness gave out first: a lower bound.
    ([row(10, 1), row(25, 2, lag=40.0)],
     {"max_rate": 10, "stopped_at": 25, "stopped_by": "harness limit: the client sent 40 ms late (p90) on the "
                                                      "direct path", "lower_bound": True}),
    # The sweep's time bound ended the ladder: a lower bound.
    ([row(10, 1), {"rate": 25, "time_bound": "time bound (150 s for the sweep)"}],
     {"max_rate": 10, "stopped_at": 25, "stopped_by": "time bound (150 s for the sweep)", "lower_bound": True}),
    ([row(10, 1), row(25, 2, errors=2)], {"max_rate": 10, "stopped_at": 25, "stopped_by": "2 errors",
                                          "lower_bound": False}),
])
def test_summary(rows: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    assert saturation.summarize(rows, 10.0) == expected


def test_ratios_say_when_a_side_is_only_a_bound() -> None:
    s: dict[str, dict[str, Any]] = {"cortex": {"max_rate": 100, "lower_bound": False},
                                    "smg-cache-aware": {"max_rate": 400, "lower_bound": False},
                                    "envoy-alone": {"max_rate": 800, "lower_bound": True},
                                    "other": {"max_rate": None, "lower_bound": False}}
    assert saturation.ratios(s) == {"cortex/smg-cache-aware": {"value": 0.25, "exact": True, "bound": "="},
                                    "cortex/envoy-alone": {"value": 0.12, "exact": False, "bound": "≤"},
                                    "cortex/other": {"value": None, "exact": False, "bound": None}}
    s["cortex"]["lower_bound"] = True
    assert saturation.ratios(s)["cortex/smg-cache-aware"]["bound"] == "≥"
    assert saturation.ratios(s)["cortex/envoy-alone"]["bound"] == "?"
    assert saturation.ratios({"envoy-alone": {"max_rate": 800, "lower_bound": True}}) == {}
    # Cortex broke the limit at the first rung (10/s): below 10 over the other's figure.
    first: dict[str, dict[str, Any]] = {"cortex": {"max_rate": None, "stopped_at": 10, "lower_bound": False},
                                        "smg-cache-aware": {"max_rate": 200, "lower_bound": True}}
    assert saturation.ratios(first) == {"cortex/smg-cache-aware": {"value": 0.05, "exact": False, "bound": "<"}}


def test_markdown_shows_the_figure_the_rows_and_the_ratios() -> None:
    rung = {"rate": 50.0, "requests": 115, "achieved_rps": 45.7, "added_p50_ms": 0.4, "added_p99_ms": 3.2,
            "via_p50_ms": 3.0, "via_p99_ms": 9.0, "direct_p50_ms": 2.6, "direct_p99_ms": 5.8, "errors": 0,
            "gateway_cpu_ms_per_request": 0.61}
    out = {"machine": {"cpus": 2, "cpu_model": "X", "platform": "L", "python": "3.11", "loadavg_at_start": [1, 1, 1]},
           "cluster": {"workers": 4, "engine": "vllm"}, "started": "t", "elapsed_s": 60.0,
           "params": {"limit_ms": 10.0, "prompt_words": 200, "max_tokens": 4, "rung_seconds": 2.0,
                      "min_requests": 40},
           "saturation": {
               "cortex": {"rows": [{**rung, "rate": 10.0}, {**rung, "added_p99_ms": 12.0, "superseded": True},
                                   {**rung, "added_p99_ms": 13.0, "repeat": True}],
                          "summary": {"max_rate": 10.0, "stopped_at": 50.0, "stopped_by": "added p99 13 ms > 10 ms",
                                      "lower_bound": False}},
               "envoy-alone": {"rows": [rung], "summary": {"max_rate": 50.0, "stopped_at": None,
                                                           "stopped_by": "top of the ladder", "lower_bound": True}},
               "smg-cache-aware": {"unavailable": "smg is not installed"}},
           "ratios": {"cortex/envoy-alone": {"value": 0.2, "exact": False, "bound": "≤"}}}
    text = saturation.markdown(out, "cortex bench --saturation")
    assert "| cortex | 10 | added p99 13 ms > 10 ms at 50/s |" in text
    assert "| envoy-alone | ≥ 50 | top of the ladder |" in text
    assert "| smg-cache-aware | – | smg is not installed |" in text
    assert "cortex/envoy-alone ≤ 0.20 (a bound" in text
    assert "| 50 (broke the limit; sent again) | 45.7 | 0.4 | 12.0 |" in text
    assert "| 50 (again) | 45.7 | 0.4 | 13.0 | 3.0 / 9.0 | 2.6 / 5.8 | 0/115 | 0.61 |" in text


def test_envoy_alone_is_a_static_least_request_pool_without_ext_proc() -> None:
    workers = [Worker(f"sim-{i}", f"http://127.0.0.1:{9000 + i}", "tcp://127.0.0.1:1", "vllm") for i in range(3)]
    cfg = envoy_alone_config(workers, 8000, 8001)
    (cluster,) = cfg["static_resources"]["clusters"]
    assert cluster["lb_policy"] == "LEAST_REQUEST"
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [9000, 9001, 9002]
    text = json.dumps(cfg)
    assert "ext_proc" not in text and "0.0.0.0" not in text  # loopback only
    # Not one of the default contestants (the usual `cortex bench` runs stay as they were), but runnable by name.
    assert "envoy-alone" in BY_NAME and "envoy-alone" not in {c.name for c in CONTESTANTS}


def test_a_bad_ladder_is_refused() -> None:
    r = subprocess.run([sys.executable, "-m", "cortexctl.cli", "bench", "--saturation", "--saturation-rates", "50,25"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "rising list" in r.stderr


@pytest.mark.timeout(150)
def test_saturation_quick_runs_cortex_and_envoy_alone(tmp_path: Path) -> None:
    """Two rungs each; a limit no rung can break on this machine, so both rungs always run."""
    out = tmp_path / "out.json"
    r = subprocess.run(
        [sys.executable, "-m", "cortexctl.cli", "bench", "--saturation", "--quick", "--saturation-rates", "20,40",
         "--rung-seconds", "1", "--limit-ms", "5000", "--workers", "2", "--contestant", "cortex",
         "--contestant", "envoy-alone", "--json", str(out), "--work-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=140)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["mode"] == "saturation" and figures["cluster"]["workers"] == 2
    assert set(figures["saturation"]) == {"cortex", "envoy-alone"}
    for name, block in figures["saturation"].items():
        rows = block["rows"]
        assert [x["rate"] for x in rows] == [20.0, 40.0], (name, rows)
        for x in rows:
            assert x["errors"] == 0 and x["direct_errors"] == 0, (name, x)
            assert x["via_p99_ms"] >= x["via_p50_ms"] > 0 and x["direct_p99_ms"] >= x["direct_p50_ms"] > 0
            assert x["added_p99_ms"] == pytest.approx(x["via_p99_ms"] - x["direct_p99_ms"], abs=0.02)
            # Envoy alone may spend less than one clock tick on a rung's few dozen requests; Cortex cannot.
            assert x["gateway_cpu_ms_per_request"] > 0 if name == "cortex" else x["gateway_cpu_ms_per_request"] >= 0
        assert block["summary"] == {"max_rate": 40.0, "stopped_at": None, "stopped_by": "top of the ladder",
                                    "lower_bound": True}
    # Every Cortex process is counted; Envoy alone is one Envoy.
    assert {"envoy", "extproc", "ingest"} <= set(figures["saturation"]["cortex"]["rows"][-1][
        "gateway_cpu_ms_per_request_by_part"])
    assert set(figures["saturation"]["envoy-alone"]["rows"][-1]["gateway_cpu_ms_per_request_by_part"]) == {"envoy"}
    assert figures["ratios"]["cortex/envoy-alone"] == {"value": 1.0, "exact": False, "bound": "?"}
    assert "| cortex | ≥ 40 | top of the ladder |" in r.stdout
