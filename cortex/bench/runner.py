"""One benchmark run: start the workers once, then for every workload and contestant empty the caches, start
the contestant, measure its gateway overhead (once per contestant), replay the workload, stop it; optionally
sweep the request rate of one workload. Returns every figure as one JSON-ready dict."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

from cortex.bench import client, metrics
from cortex.bench.contestants import Contestant
from cortex.bench.launch import ClusterSpec, Procs, Worker, reset_caches, start_workers
from cortex.bench.workloads import Workload

# Prompt sizes (words, about one token each) of the light-load overhead probes.
OVERHEAD_PROMPTS = {"short": 200, "long": 2000}


@dataclass
class Plan:
    cluster: ClusterSpec
    workloads: list[Workload]
    contestants: list[Contestant]
    concurrency: int | None = None
    max_seconds: float = 120.0
    overhead_probes: int = 20
    sweep: list[Workload] = field(default_factory=list)
    """The same workload at several rates (TTFT vs request rate)."""
    sweep_contestants: list[Contestant] = field(default_factory=list)
    work_dir: Path | None = None
    keep_records: bool = False
    replicas: int = 1
    """Independent copies of each gateway contestant; the client spreads requests over them."""


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}


def _measure(contestant: Contestant, workload: Workload, workers: list[Worker], root: Path, plan: Plan,
             probe: bool, log: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    reset_caches(workers)
    with Procs(root) as procs:
        targets = contestant.start(procs, workers, plan.replicas if contestant.replicable else 1)
        over = None
        if probe and contestant.gateway and plan.overhead_probes > 0:
            over = {}
            for size, words in OVERHEAD_PROMPTS.items():
                pairs = uvloop.run(client.light_probe(targets[0], workers, plan.overhead_probes, words))
                over[size] = metrics.overhead(pairs, words)
                log(f"    overhead ({size} prompt) p50 {over[size]['p50_ms']} ms over {over[size]['pairs']} pairs")
            reset_caches(workers)
        before = procs.cpu_seconds()
        result = uvloop.run(client.run(workload, targets, workers, concurrency=plan.concurrency,
                                       max_seconds=plan.max_seconds))
        after = procs.cpu_seconds()
    summary = metrics.summarize(result)
    n = max(len(result.records), 1)
    parts = {k: round(1000.0 * (v - before.get(k, 0.0)) / n, 2) for k, v in after.items()}
    summary["gateway_cpu_ms_per_request"] = round(sum(parts.values()), 2)
    summary["gateway_cpu_ms_per_request_by_part"] = parts
    if plan.keep_records:
        summary["records"] = metrics.records_json(result.records)
    return summary, over


def run(plan: Plan, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict[str, Any]:
    started = time.monotonic()
    out: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "machine": machine(),
        "cluster": {"workers": plan.cluster.workers, "engine": plan.cluster.engine,
                    "kv_tokens_per_worker": plan.cluster.kv_tokens},
        "mode": {"concurrency": plan.concurrency} if plan.concurrency else {"open_loop": True},
        "contestants": {c.name: c.what for c in plan.contestants},
        "workloads": {}, "overhead": {}, "sweep": None,
    }
    with tempfile.TemporaryDirectory(prefix="cortex-bench-") as tmp:
        root = plan.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        with Procs(root) as cluster_procs:
            workers = start_workers(cluster_procs, plan.cluster)
            for workload in plan.workloads:
                log(f"workload {workload.name}: {workload.requests} requests, {workload.params}")
                results: dict[str, Any] = {}
                for c in plan.contestants:
                    results[c.name] = _one(c, workload, workers, root, plan, out, log)
                out["workloads"][workload.name] = {"params": workload.params, "results": results}
            if plan.sweep:
                sweep: dict[str, Any] = {"workload": plan.sweep[0].name,
                                         "rates": [w.params["rate"] for w in plan.sweep], "results": {}}
                for c in plan.sweep_contestants:
                    rows = []
                    for workload in plan.sweep:
                        log(f"sweep {workload.name} at {workload.params['rate']}/s")
                        rows.append({"rate": workload.params["rate"], **_one(c, workload, workers, root, plan, out,
                                                                              log)})
                    sweep["results"][c.name] = rows
                out["sweep"] = sweep
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    return out


def _one(c: Contestant, workload: Workload, workers: list[Worker], root: Path, plan: Plan, out: dict[str, Any],
         log: Callable[[str], None]) -> dict[str, Any]:
    reason = c.unavailable()
    if reason is not None:
        log(f"  {c.name}: not available: {reason}")
        return {"unavailable": reason}
    log(f"  {c.name} ...")
    t = time.monotonic()
    try:
        summary, over = _measure(c, workload, workers, root, plan, c.name not in out["overhead"], log)
    except Exception as exc:  # one contestant failing must not lose the others' figures
        log(f"  {c.name}: FAILED: {exc}")
        return {"failed": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-1500:]}
    if over is not None:
        out["overhead"][c.name] = over
    log(f"  {c.name}: hit {summary['hit_ratio']} ttft p50/p90 {summary['ttft_ms']['p50']}/"
        f"{summary['ttft_ms']['p90']} ms, {summary['completed']}/{summary['requests']} ok, "
        f"imbalance {summary['imbalance']} ({time.monotonic() - t:.0f} s)")
    return summary
