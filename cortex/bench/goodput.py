"""`cortex bench --goodput`: per contestant and workload, the highest arrival rate at which the time to first
token and the inter-token latency both stay under their service-level objectives.

Goodput as DistServe (OSDI'24) and Mooncake (FAST'25) define it: the highest request rate a system serves while a
given percentile of requests meets the TTFT SLO and the ITL (time between tokens) SLO; here the 90th percentile of
both (`--slo-percentile`), a failed or unanswered request counting as missing both. The rate is varied by scaling
the workload's arrival times (`workloads.at_rate`: the same prompts in the same order, closer together or further
apart), starting from the workload's own rate, along a bounded search (`search`): a doubling ladder up from there
while runs pass (or halving down while they fail) until one run passes and one fails, then bisection between the
two, at most `max_runs` runs in all (default 6). Each run is an ordinary benchmark cell (`runner.run_one`: caches
emptied, the contestant started fresh, the workload replayed open loop, bounded by --max-seconds of sends plus a
grace period), so a rate is measured exactly as the main tables measure.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cortex.bench import runner
from cortex.bench.contestants import Contestant
from cortex.bench.launch import ClusterSpec, Procs, start_workers
from cortex.bench.report import cluster_line, run_line
from cortex.bench.report import num as _f
from cortex.bench.workloads import Workload, at_rate

SLO_TTFT_MS = 2000.0
"""TTFT SLO: 2 s, the upper end of DistServe's chatbot SLOs; a cold 30 000-token prompt takes ~1.5 s to prefill
in the simulator's timing model, a real trace's prompt is mostly cached."""
SLO_ITL_MS = 100.0
"""ITL SLO: 100 ms between tokens (10 tokens a second, faster than reading; DistServe's chatbot TPOT SLO, and
Mooncake's tightest TBT); the simulator's decode step is 7 ms, a step carrying a long prefill chunk ~400 ms."""
PERCENTILE = 90.0
MAX_RUNS = 6
FACTOR = 2.0
TOLERANCE = 0.1
"""Bisection stops once the failing rate is within 10 % of the passing one."""
GRACE_S = 30.0
"""A run waits this long after its last send; what is still unanswered then missed its SLOs anyway (a request
within both SLOs is done after TTFT + max_tokens x ITL, 8.4 s at the defaults and 64 tokens)."""
CONTESTANTS = ("cortex", "smg-cache-aware", "sglang-cache-aware", "round-robin")
RATE_UNITS = {"multi-turn": "conversation starts/s", "burst": "groups/s", "agentic": "episodes/s"}
"""What a workload's rate counts (its `--rate`); requests/s for the others."""


def rate_unit(workload: str) -> str:
    return RATE_UNITS.get(workload, "requests/s")


# ---- the pure part: whether a run met the SLOs, and the search over rates ----

def nearest_rank(values: list[float], q: float) -> float | None:
    """The smallest value with at least q % of `values` at or below it (of ten values, p90 is the ninth); None
    for none. So `nearest_rank(v, q) <= slo` exactly when at least q % of v meet the SLO: DistServe's SLO
    attainment."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s) / 100.0) - 1))]


def verdict(records: list[dict[str, Any]], ttft_ms: float, itl_ms: float, percentile: float = PERCENTILE
            ) -> dict[str, Any]:
    """Did a run meet both SLOs? `records` as `metrics.records_json` gives them. The TTFT percentile is over
    every request sent, a failed one counted as infinitely late; the ITL percentile over the requests that
    streamed two tokens or more, and the failed ones (infinitely slow). Both must be within their SLOs: at least
    `percentile` % of the requests met each. A run with no request fails."""
    inf = math.inf
    ttft = [r["ttft_ms"] if r["error"] is None and r["ttft_ms"] is not None else inf for r in records]
    itl = [inf if r["error"] is not None else r["itl_ms"] for r in records
           if r["error"] is not None or r.get("itl_ms") is not None]
    t, i = nearest_rank(ttft, percentile), nearest_rank(itl, percentile)
    ok = bool(records) and t is not None and t <= ttft_ms and (i is None or i <= itl_ms)

    def shown(v: float | None) -> float | None:
        return None if v is None or math.isinf(v) else round(v, 1)

    return {"ok": ok, "ttft_ms": shown(t), "itl_ms": shown(i), "requests": len(records),
            "errors": sum(r["error"] is not None for r in records),
            "ttft_within_slo": round(sum(x <= ttft_ms for x in ttft) / len(ttft), 3) if ttft else None}


def _round(rate: float) -> float:
    return float(f"{rate:.4g}")


def search(measure: Callable[[float], tuple[bool, dict[str, Any]]], start: float, *, max_runs: int = MAX_RUNS,
           factor: float = FACTOR, tolerance: float = TOLERANCE) -> dict[str, Any]:
    """The highest rate at which `measure(rate)` passes, assuming passing is monotone (true below some rate,
    false above). A ladder from `start`: up by `factor` while runs pass, down by it while they fail, until one
    rate passed and one failed; then bisection (arithmetic midpoints) while the failing rate is more than
    `tolerance` above the passing one; never more than `max_runs` calls.

    Returns `goodput` (the highest rate that passed below the lowest that failed, None when none passed),
    `bound`: "bracketed" (a pass at `goodput` and a fail at `fails_at`), "at least" (nothing failed: the ladder
    ran out of runs), "below" (nothing passed: the goodput is under `fails_at`, the lowest rate tried); the
    bracketing runs `passed_run` and `failed_run`; and every run in order (`runs`: rate, ok and what `measure` said)."""
    if start <= 0 or max_runs < 1 or factor <= 1:
        raise ValueError("search: start > 0, max_runs >= 1, factor > 1")
    runs: list[dict[str, Any]] = []
    lo: dict[str, Any] | None = None
    hi: dict[str, Any] | None = None

    def run(rate: float) -> bool:
        ok, detail = measure(rate)
        runs.append({"rate": rate, **detail, "ok": bool(ok)})
        return bool(ok)

    rate = _round(start)
    while len(runs) < max_runs:
        if run(rate):
            lo = runs[-1]
            if hi is not None:
                break
            rate = _round(rate * factor)
        else:
            hi = runs[-1]
            if lo is not None:
                break
            rate = _round(rate / factor)
    while len(runs) < max_runs and lo is not None and hi is not None and hi["rate"] > lo["rate"] * (1 + tolerance):
        mid = _round((lo["rate"] + hi["rate"]) / 2)
        if not lo["rate"] < mid < hi["rate"]:
            break
        if run(mid):
            lo = runs[-1]
        else:
            hi = runs[-1]
    bound = "bracketed" if lo is not None and hi is not None else "at least" if lo is not None else "below"
    return {"goodput": lo["rate"] if lo else None, "bound": bound, "fails_at": hi["rate"] if hi else None,
            "passed_run": lo, "failed_run": hi, "runs": runs}


# ---- running it ----

class _Failed(Exception):
    def __init__(self, summary: dict[str, Any]) -> None:
        super().__init__(summary.get("failed") or summary.get("unavailable"))
        self.summary = summary


def _run_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """What a search run keeps of a cell's summary (beside the verdict)."""
    return {"hit_ratio": summary["hit_ratio"], "completed": summary["completed"], "rps": summary["rps"],
            "wall_s": summary["wall_s"], "ttft_ms_completed": summary["ttft_ms"], "itl_ms_completed": summary["itl_ms"],
            "gateway_cpu_ms_per_request": summary["gateway_cpu_ms_per_request"],
            "error_examples": summary["error_examples"]}


def run(plan: runner.Plan, *, ttft_ms: float = SLO_TTFT_MS, itl_ms: float = SLO_ITL_MS,
        percentile: float = PERCENTILE, max_runs: int = MAX_RUNS, keep_records: bool = False,
        log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """The goodput of every contestant of `plan` on each of its workloads (the first seed's build), each search
    on its workload's fleet. `plan` gives the runs' bounds (max_seconds, grace_s) and routing (replicas[0],
    sticky); it must ask for records (keep_records), which each verdict reads; they are dropped from the result
    unless `keep_records`."""
    started = time.monotonic()
    out: dict[str, Any] = {
        **runner.run_head(plan.cluster), "mode": {"goodput": True},
        "slo": {"ttft_ms": ttft_ms, "itl_ms": itl_ms, "percentile": percentile, "max_runs": max_runs,
                "max_seconds": plan.max_seconds, "grace_s": plan.grace_s},
        "contestants": {c.name: c.what for c in plan.contestants}, "goodput": {}}
    replicas = plan.replicas[0]
    with tempfile.TemporaryDirectory(prefix="cortex-goodput-") as tmp:
        root = plan.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        fleets: dict[ClusterSpec, list[Workload]] = {}
        for built in plan.workloads:
            fleets.setdefault(runner.fleet_of(built[0], plan), []).append(built[0])
        for spec, group in fleets.items():
            with Procs(root) as cluster_procs:
                workers = start_workers(cluster_procs, spec)
                for w in group:
                    key = runner.label(w.name, replicas, plan)
                    log(f"goodput {key}: {w.requests} requests from {w.params.get('rate')} {rate_unit(w.name)}")
                    results: dict[str, Any] = {}
                    for c in plan.contestants:
                        results[c.name] = _search_one(c, w, workers, cluster_procs, root, plan, replicas, ttft_ms,
                                                      itl_ms, percentile, max_runs, keep_records, log)
                    ws = int(w.params.get("working_set_tokens") or 0)
                    out["goodput"][key] = {
                        "workload": w.name, "params": w.params, "rate_unit": rate_unit(w.name),
                        "replicas": replicas, "sticky": plan.sticky,
                        "fleet": {"workers": spec.workers, "kv_tokens_per_worker": spec.kv_tokens,
                                  "working_set_tokens": ws, "kv_fill": round(ws / (spec.workers * spec.kv_tokens), 2),
                                  **({"max_model_len": spec.max_model_len} if spec.max_model_len else {})},
                        "results": results}
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    return out


def _search_one(c: Contestant, w: Workload, workers: list[Any], cluster: Procs, root: Path, plan: runner.Plan,
                replicas: int, ttft_ms: float, itl_ms: float, percentile: float, max_runs: int, keep_records: bool,
                log: Callable[[str], None]) -> dict[str, Any]:
    reason = c.unavailable()
    if reason is not None:
        log(f"  {c.name}: not available: {reason}")
        return {"unavailable": reason}
    done: list[dict[str, Any]] = []

    def measure(rate: float) -> tuple[bool, dict[str, Any]]:
        log(f"  {c.name} at {rate:g} {rate_unit(w.name)} ...")
        summary = runner.run_one(c, at_rate(w, rate), workers, cluster, root, plan, replicas, {"overhead": {}}, log)
        if "failed" in summary or "unavailable" in summary:
            raise _Failed(summary)
        records = summary.pop("records")
        v = verdict(records, ttft_ms, itl_ms, percentile)
        detail = {**{k: x for k, x in v.items() if k != "ok"}, **_run_figures(summary)}
        if keep_records:
            detail["records"] = records
        log(f"  {c.name} at {rate:g}: TTFT p{percentile:g} {v['ttft_ms']} ms, ITL p{percentile:g} {v['itl_ms']} ms, "
            f"{v['errors']}/{v['requests']} errors: {'within' if v['ok'] else 'over'} the SLOs")
        done.append({"rate": rate, **detail, "ok": v["ok"]})
        return v["ok"], detail

    try:
        return search(measure, float(w.params["rate"]), max_runs=max_runs)
    except _Failed as exc:
        log(f"  {c.name}: FAILED: {exc}")
        return {"failed": str(exc), "runs": done}


# ---- the report ----

def _run_cell(r: dict[str, Any] | None) -> str:
    if not r:
        return "–"
    return (f"{r['rate']:g}/s: {_f(r['ttft_ms'])} / {_f(r['itl_ms'])} ms, hit {_f(r['hit_ratio'], 3)}, "
            f"{r['errors']}/{r['requests']} errors")


def _goodput_cell(res: dict[str, Any]) -> str:
    if res["bound"] == "below":
        return f"< {res['fails_at']:g}"
    return ("≥ " if res["bound"] == "at least" else "") + f"{res['goodput']:g}"


def table(block: dict[str, Any], slo: dict[str, Any]) -> str:
    q = slo["percentile"]
    lines = [f"| contestant | goodput ({block['rate_unit']}) | passes at: TTFT p{q:g} / ITL p{q:g} | "
             f"fails at: TTFT p{q:g} / ITL p{q:g} | runs (rate, ✓ within / ✗ over) |", "|---|---|---|---|---|"]
    for cname, res in block["results"].items():
        if "unavailable" in res:
            lines.append(f"| {cname} | not available: {res['unavailable']} | | | |")
            continue
        runs = ", ".join(f"{r['rate']:g} {'✓' if r['ok'] else '✗'}" for r in res.get("runs", []))
        if "failed" in res:
            lines.append(f"| {cname} | failed: {res['failed'][:120]} | | | {runs} |")
            continue
        lines.append(f"| {cname} | {_goodput_cell(res)} | {_run_cell(res['passed_run'])} | "
                     f"{_run_cell(res['failed_run'])} | {runs} |")
    params = ", ".join(f"{k}={v}" for k, v in block["params"].items()
                       if k not in ("working_set_tokens", "prompt_tokens"))
    f = block["fleet"]
    return (f"**{block['workload']}** ({params}); fleet {f['workers']} workers × {f['kv_tokens_per_worker']} KV "
            f"tokens ({_f(f['kv_fill'], 2)} × filled by the working set); rate = its --rate, in "
            f"{block['rate_unit']}; times in ms\n\n" + "\n".join(lines) + "\n")


def markdown(out: dict[str, Any], command: str) -> str:
    slo = out["slo"]
    q = slo["percentile"]
    head = run_line(out) + cluster_line(out, list(out["goodput"].values()))
    parts = [f"Command: `{command}`\n",
             head + f" SLOs: TTFT p{q:g} ≤ {slo['ttft_ms']:g} ms and ITL p{q:g} ≤ {slo['itl_ms']:g} ms, a failed "
             f"request missing both; at most {slo['max_runs']} runs per contestant, each of at most "
             f"{slo['max_seconds']:g} s of sends (+ {slo['grace_s']:g} s to finish). Goodput: the highest rate "
             f"that passed below the lowest that failed; ≥ when nothing failed, < when nothing passed.\n"]
    for block in out["goodput"].values():
        parts.append(table(block, slo))
    return "\n".join(parts)
