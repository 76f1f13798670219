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
grace period), so a rate is measured exactly as the main tables measure. The SLOs, fixed or relative to each
request's solo time, and the verdict on a run are in `cortexbench.slo`.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cortexbench import runner
from cortexbench.contestants import Contestant
from cortexbench.launch import ClusterSpec, Procs, start_workers
from cortexbench.report import cluster_line, run_line
from cortexbench.report import num as _f
from cortexbench.slo import PERCENTILE, SLO_ITL_MS, SoloCurve, TtftSlo, default_ttft, simulated_solo_ms, verdict
from cortexbench.workloads import Workload, at_rate

MAX_RUNS = 6
FACTOR = 2.0
TOLERANCE = 0.1
"""Bisection stops once the failing rate is within 10 % of the passing one."""
GRACE_S = 30.0
"""A run waits at least this long after its last send; what is still unanswered then missed its SLOs anyway (a
request within both SLOs is done after TTFT + max_tokens x ITL, 8.4 s at the defaults and 64 tokens). Under a
relative TTFT SLO the wait is what the workload's longest prompt may take within it, if longer (`grace_s`)."""
CONTESTANTS = ("cortex", "smg-cache-aware", "sglang-cache-aware", "round-robin")
RATE_UNITS = {"multi-turn": "conversation starts/s", "burst": "groups/s", "agentic": "episodes/s"}
"""What a workload's rate counts (its `--rate`); requests/s for the others."""


def rate_unit(workload: str) -> str:
    return RATE_UNITS.get(workload, "requests/s")


# ---- the pure part: the search over rates (whether a run met the SLOs: cortexbench.slo) ----

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


def run(plan: runner.Plan, *, ttft: TtftSlo | None = None, itl_ms: float = SLO_ITL_MS,
        percentile: float = PERCENTILE, max_runs: int = MAX_RUNS, keep_records: bool = False,
        log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """The goodput of every contestant of `plan` on each of its workloads (the first seed's build), each search
    on its workload's fleet. `ttft`: the TTFT SLO of every workload; None gives each workload its default
    (`slo.default_ttft`: relative for a trace, 2 s for the others). A relative SLO's solo curve is the fleet's own
    timing model (`slo.simulated_solo_ms`). `plan` gives the runs' bounds (max_seconds, grace_s) and routing
    (replicas[0], sticky); it must ask for records (keep_records), which each verdict reads; they are dropped
    from the result unless `keep_records`."""
    started = time.monotonic()
    out: dict[str, Any] = {
        **runner.run_head(plan.cluster), "mode": {"goodput": True},
        "slo": {**({"ttft": ttft.as_json()} if ttft else {"ttft": "per workload"}),
                **({"ttft_ms": ttft.ms} if ttft and ttft.ms is not None else {}),
                "itl_ms": itl_ms, "percentile": percentile, "max_runs": max_runs,
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
                    key = runner.label(runner.title(w), replicas, plan)
                    w_slo = ttft or default_ttft(w.name)
                    solo = simulated_solo_ms() if w_slo.relative else None
                    log(f"goodput {key}: {w.requests} requests from {w.params.get('rate')} {rate_unit(w.name)}, "
                        f"{w_slo.describe()}")
                    judge = Judge(w_slo, itl_ms, percentile, solo)
                    w_plan = dataclasses.replace(plan, grace_s=max(plan.grace_s, grace_s(w, judge)))
                    results: dict[str, Any] = {}
                    for c in plan.contestants:
                        results[c.name] = _search_one(c, w, workers, cluster_procs, root, w_plan, replicas, judge,
                                                      max_runs, keep_records, log)
                    ws = int(w.params.get("working_set_tokens") or 0)
                    out["goodput"][key] = {
                        "workload": runner.title(w), "params": w.params, "rate_unit": rate_unit(w.name),
                        "replicas": replicas, "sticky": plan.sticky, "ttft_slo": w_slo.as_json(),
                        "grace_s": w_plan.grace_s,
                        **({"solo_ms": solo_points(solo)} if solo else {}),
                        "fleet": {"workers": spec.workers, "kv_tokens_per_worker": spec.kv_tokens,
                                  "working_set_tokens": ws, "kv_fill": round(ws / (spec.workers * spec.kv_tokens), 2),
                                  **({"max_model_len": spec.max_model_len} if spec.max_model_len else {})},
                        "results": results}
    runner.finish(out, started)
    return out


def grace_s(w: Workload, judge: Judge) -> float:
    """How long a run of `w` waits after its last send: GRACE_S, or under a relative TTFT SLO the time its longest
    prompt may take within both SLOs (its allowed TTFT plus max_tokens gaps at the ITL SLO), if longer, so a long
    request sent last is not cut while it can still meet them."""
    if judge.solo_ms is None or judge.ttft.slowdown is None:
        return GRACE_S
    longest = int(w.params.get("longest_prompt_tokens") or 0)
    max_tokens = int(w.params.get("max_tokens") or 0)
    within = judge.ttft.slowdown * judge.solo_ms(longest) / 1000.0 + max_tokens * judge.itl_ms / 1000.0
    return max(GRACE_S, round(within + 1.0, 1))


SOLO_POINTS = (1000, 10000, 30000, 100000)
"""Prompt lengths at which a report shows the solo curve, so a reader sees what a relative SLO asked."""


def solo_points(solo: SoloCurve) -> dict[str, float]:
    return {str(n): round(solo(n), 1) for n in SOLO_POINTS}


@dataclass(frozen=True, slots=True)
class Judge:
    """The SLOs one workload's runs are judged by."""

    ttft: TtftSlo
    itl_ms: float
    percentile: float
    solo_ms: SoloCurve | None

    def __call__(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        return verdict(records, self.ttft, self.itl_ms, self.percentile, self.solo_ms)


def _ttft_shown(v: dict[str, Any]) -> str:
    return f"{v['ttft_slowdown']}× solo" if "ttft_slowdown" in v else f"{v['ttft_ms']} ms"


def _search_one(c: Contestant, w: Workload, workers: list[Any], cluster: Procs, root: Path, plan: runner.Plan,
                replicas: int, judge: Judge, max_runs: int, keep_records: bool,
                log: Callable[[str], None]) -> dict[str, Any]:
    reason = c.unavailable()
    if reason is not None:
        log(f"  {c.name}: not available: {reason}")
        return {"unavailable": reason}
    done: list[dict[str, Any]] = []
    q = judge.percentile

    def measure(rate: float) -> tuple[bool, dict[str, Any]]:
        log(f"  {c.name} at {rate:g} {rate_unit(w.name)} ...")
        summary = runner.run_one(c, at_rate(w, rate), workers, cluster, root, plan, replicas, {"overhead": {}}, log)
        if "failed" in summary or "unavailable" in summary:
            raise _Failed(summary)
        records = summary.pop("records")
        v = judge(records)
        detail = {**{k: x for k, x in v.items() if k != "ok"}, **_run_figures(summary)}
        if keep_records:
            detail["records"] = records
        log(f"  {c.name} at {rate:g}: TTFT p{q:g} {_ttft_shown(v)}, ITL p{q:g} {v['itl_ms']} ms, "
            f"{v['errors']}/{v['requests']} errors: {'within' if v['ok'] else 'over'} the SLOs")
        done.append({"rate": rate, **detail, "ok": v["ok"]})
        return v["ok"], detail

    try:
        return search(measure, float(w.params["rate"]), max_runs=max_runs)
    except _Failed as exc:
        log(f"  {c.name}: FAILED: {exc}")
        return {"failed": str(exc), "runs": done}


# ---- the report ----

def _block_ttft(block: dict[str, Any], slo: dict[str, Any]) -> TtftSlo:
    """A block's TTFT SLO (a run saved before SLOs were per workload has one fixed SLO for the run)."""
    return TtftSlo.from_json(block["ttft_slo"]) if "ttft_slo" in block else TtftSlo(ms=slo["ttft_ms"])


def _run_cell(r: dict[str, Any] | None, relative: bool) -> str:
    if not r:
        return "–"
    ttft = f"{_f(r.get('ttft_slowdown'), 2)}×" if relative else f"{_f(r['ttft_ms'])} ms"
    return (f"{r['rate']:g}/s: {ttft} / {_f(r['itl_ms'])} ms, hit {_f(r['hit_ratio'], 3)}, "
            f"{r['errors']}/{r['requests']} errors")


def _goodput_cell(res: dict[str, Any]) -> str:
    if res["bound"] == "below":
        return f"< {res['fails_at']:g}"
    return ("≥ " if res["bound"] == "at least" else "") + f"{res['goodput']:g}"


def table(block: dict[str, Any], slo: dict[str, Any]) -> str:
    q = slo["percentile"]
    ttft = _block_ttft(block, slo)
    what = f"TTFT/solo p{q:g} / ITL p{q:g}" if ttft.relative else f"TTFT p{q:g} / ITL p{q:g}"
    lines = [f"| contestant | goodput ({block['rate_unit']}) | passes at: {what} | fails at: {what} | "
             f"runs (rate, ✓ within / ✗ over) |", "|---|---|---|---|---|"]
    for cname, res in block["results"].items():
        if "unavailable" in res:
            lines.append(f"| {cname} | not available: {res['unavailable']} | | | |")
            continue
        runs = ", ".join(f"{r['rate']:g} {'✓' if r['ok'] else '✗'}" for r in res.get("runs", []))
        if "failed" in res:
            lines.append(f"| {cname} | failed: {res['failed'][:120]} | | | {runs} |")
            continue
        lines.append(f"| {cname} | {_goodput_cell(res)} | {_run_cell(res['passed_run'], ttft.relative)} | "
                     f"{_run_cell(res['failed_run'], ttft.relative)} | {runs} |")
    params = ", ".join(f"{k}={v}" for k, v in block["params"].items()
                       if k not in ("working_set_tokens", "prompt_tokens"))
    f = block["fleet"]
    slo_line = f"TTFT SLO: {ttft.describe()}"
    if block.get("grace_s") and block["grace_s"] != slo.get("grace_s"):
        slo_line = f"each run waits up to {block['grace_s']:g} s after its last send; " + slo_line
    if ttft.relative and block.get("solo_ms"):
        slo_line += (" (cold prefill alone in the simulated workers' timing model: " + ", ".join(
            f"{int(n) // 1000}K tokens {_f(ms)} ms" for n, ms in block["solo_ms"].items()) + ")")
    title = block["workload"] + (f", {block['replicas']} replicas" if block.get("replicas", 1) > 1 else "")
    return (f"**{title}** ({params}); fleet {f['workers']} workers × {f['kv_tokens_per_worker']} KV "
            f"tokens ({_f(f['kv_fill'], 2)} × filled by the working set); rate = its --rate, in "
            f"{block['rate_unit']}; {slo_line}; times in ms\n\n" + "\n".join(lines) + "\n")


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several saved goodput runs as one report (one replica count each, say): the first run's header, every
    run's blocks (a later block of the same name wins), every command."""
    out = dict(runs[0])
    out["goodput"] = {k: b for r in runs for k, b in r["goodput"].items()}
    out["contestants"] = {k: v for r in runs for k, v in r["contestants"].items()}
    out["command"] = "\n".join(r["command"] for r in runs)
    out["elapsed_s"] = round(sum(r.get("elapsed_s") or 0 for r in runs), 1)
    return out


def markdown(out: dict[str, Any], command: str) -> str:
    slo = out["slo"]
    q = slo["percentile"]
    head = run_line(out) + cluster_line(out, list(out["goodput"].values()))
    commands = "\n".join(f"`{c}`" for c in command.splitlines())
    given = slo.get("ttft")
    ttft_text = (f"TTFT p{q:g} ≤ {slo['ttft_ms']:g} ms" if given is None  # a run saved before per-workload SLOs
                 else f"{TtftSlo.from_json(given).describe()} for {q:g} % of the requests" if isinstance(given, dict)
                 else f"each workload's TTFT SLO (below) for {q:g} % of the requests")
    parts = [f"Command: {commands}\n",
             head + f" SLOs: {ttft_text} and ITL p{q:g} ≤ {slo['itl_ms']:g} ms, a failed "
             f"request missing both; at most {slo['max_runs']} runs per contestant, each of at most "
             f"{slo['max_seconds']:g} s of sends (+ at least {slo['grace_s']:g} s to finish). Goodput: the highest "
             f"rate that passed below the lowest that failed; ≥ when nothing failed, < when nothing passed.\n"]
    for block in out["goodput"].values():
        parts.append(table(block, slo))
    return "\n".join(parts)
