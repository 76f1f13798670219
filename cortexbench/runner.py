"""One benchmark run: for each fleet a set of workloads needs, start the workers; then for every workload,
replica count, contestant and seed, empty the caches, start the contestant (as N replicas when asked), measure
its gateway overhead (once per contestant), replay the workload (with any disruptions: workers restarting or
flushing mid-run, a share of sessions bypassing the gateway), stop it; optionally sweep the request rate of one
workload. Returns every figure as one JSON-ready dict."""

from __future__ import annotations

import dataclasses
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

from cortexbench import client, metrics
from cortexbench.contestants import Contestant
from cortexbench.launch import ClusterSpec, Procs, Worker, flush_worker, reset_caches, restart_worker, start_workers
from cortexbench.workloads import Workload

# Prompt sizes (words, about one token each) of the light-load overhead probes.
OVERHEAD_PROMPTS = {"short": 200, "long": 2000}
DISRUPTIONS = ("restart", "flush")


@dataclass(frozen=True, slots=True)
class Disruption:
    """At `at` seconds into a run, a worker crashes and restarts (`restart`) or drops its cache (`flush`)."""

    kind: str
    at: float
    worker: int | None = None
    """Index into the fleet; None: the i-th disruption of a run hits worker i mod N."""

    def label(self) -> str:
        return f"{self.kind}@{self.at:g}" + ("" if self.worker is None else f":{self.worker + 1}")


def parse_disruptions(spec: str) -> list[Disruption]:
    """`restart@15,flush@30:2` -> restart worker 1 (the rotation's first) at 15 s, flush sim-2 at 30 s."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        try:
            kind, rest = item.split("@", 1)
            when, _, which = rest.partition(":")
            d = Disruption(kind, float(when), int(which) - 1 if which else None)
        except ValueError:
            raise ValueError(f"--restart-workers: {item!r} is not KIND@SECONDS[:WORKER] "
                             f"(e.g. restart@15,flush@30:2)") from None
        if d.kind not in DISRUPTIONS or d.at < 0 or (d.worker is not None and d.worker < 0):
            raise ValueError(f"--restart-workers: {item!r}: KIND is one of {', '.join(DISRUPTIONS)}, SECONDS >= 0, "
                             f"WORKER counts from 1")
        out.append(d)
    return out


@dataclass
class Plan:
    cluster: ClusterSpec
    workloads: list[list[Workload]]
    """Each entry: one workload, built once per seed (the same parameters, different draws)."""
    contestants: list[Contestant]
    concurrency: int | None = None
    max_seconds: float = 120.0
    overhead_probes: int = 20
    sweep: list[Workload] = field(default_factory=list)
    """The same workload at several rates (TTFT vs request rate)."""
    sweep_contestants: list[Contestant] = field(default_factory=list)
    work_dir: Path | None = None
    keep_records: bool = False
    replicas: tuple[int, ...] = (1,)
    """Run every workload with each of these numbers of independent gateway replicas."""
    sticky: bool = False
    bypass: float = 0.0
    disruptions: list[Disruption] = field(default_factory=list)
    override_workers: int | None = None
    """--workers: every workload runs on this many workers, whatever it is designed for."""
    override_kv_tokens: int | None = None
    """--kv-tokens: every workload's workers have this KV pool, whatever it is designed for."""
    grace_s: float = 60.0
    """After the last send, how long a run waits for what is still running (then counted as errors)."""


def run_head(spec: ClusterSpec, **cluster: Any) -> dict[str, Any]:
    """What every mode's JSON opens with: when, on what machine, on which simulated fleet (plus `cluster`)."""
    return {"started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "machine": machine(),
            "cluster": {"workers": spec.workers, "engine": spec.engine, "kv_tokens_per_worker": spec.kv_tokens,
                        **cluster}}


def finish(out: dict[str, Any], started: float) -> None:
    """What every mode's JSON closes with: how long it took, and the load average then (the machine is shared:
    a figure is read beside the load it was measured under)."""
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    out["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]


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


def fleet_of(workload: Workload, plan: Plan) -> ClusterSpec:
    """The fleet a workload runs on: the one it is designed for (the plan's cluster where it names none), each
    figure overridden by the plan's when given (--workers, --kv-tokens); with the context length it needs (at
    most the KV pool)."""
    spec = ClusterSpec(workers=plan.override_workers or workload.workers or plan.cluster.workers,
                       engine=plan.cluster.engine,
                       kv_tokens=plan.override_kv_tokens or workload.kv_tokens or plan.cluster.kv_tokens)
    if workload.max_model_len is None:
        return spec
    return dataclasses.replace(spec, max_model_len=min(workload.max_model_len, spec.kv_tokens))


def _disrupt(d: Disruption, i: int, procs: Procs, workers: list[Worker], log: list[dict[str, Any]]
             ) -> tuple[float, Callable[[], None]]:
    w = workers[(d.worker if d.worker is not None else i) % len(workers)]

    def act() -> None:
        t = time.monotonic()
        if d.kind == "restart":
            restart_worker(procs, w)
            ok = True
        else:
            ok = flush_worker(w)
        log.append({"kind": d.kind, "at_s": d.at, "worker": w.id, "ok": ok,
                    "took_s": round(time.monotonic() - t, 2)})

    return d.at, act


def _measure(contestant: Contestant, workload: Workload, workers: list[Worker], cluster: Procs, root: Path,
             plan: Plan, replicas: int, probe: bool, log: Callable[[str], None]
             ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    reset_caches(workers)
    disrupted: list[dict[str, Any]] = []
    with Procs(root) as procs:
        targets = contestant.start(procs, workers, replicas if contestant.replicable else 1)
        over = None
        if probe and contestant.gateway and plan.overhead_probes > 0:
            over = {}
            for size, words in OVERHEAD_PROMPTS.items():
                pairs = uvloop.run(client.light_probe(targets[0], workers, plan.overhead_probes, words))
                over[size] = metrics.overhead(pairs, words)
                log(f"    overhead ({size} prompt) p50 {over[size]['p50_ms']} ms over {over[size]['pairs']} pairs")
            reset_caches(workers)
        routing = client.Routing(targets, sticky=plan.sticky and contestant.gateway,
                                 bypass=plan.bypass if contestant.gateway else 0.0,
                                 seed=int(workload.params.get("seed", 0)))
        schedule = [_disrupt(d, i, cluster, workers, disrupted) for i, d in enumerate(plan.disruptions)]
        before, fleet_before = procs.cpu_seconds(), sum(cluster.cpu_seconds().values())
        result = uvloop.run(client.run(workload, routing, workers, concurrency=plan.concurrency,
                                       max_seconds=plan.max_seconds, grace_s=plan.grace_s, schedule=schedule))
        after, fleet_after = procs.cpu_seconds(), sum(cluster.cpu_seconds().values())
    ran = {(d["kind"], d["at_s"]) for d in disrupted}
    disrupted += [{"kind": d.kind, "at_s": d.at, "worker": None, "ok": None, "took_s": None}
                  for d in plan.disruptions if (d.kind, d.at) not in ran]  # the run ended before its time
    summary = metrics.summarize(result)
    n = max(len(result.records), 1)
    parts = {k: round(1000.0 * (v - before.get(k, 0.0)) / n, 2) for k, v in after.items()}
    summary["gateway_cpu_ms_per_request"] = round(sum(parts.values()), 2)
    summary["gateway_cpu_ms_per_request_by_part"] = parts
    # What the simulated workers cost this machine (a restart loses the crashed process's count: a floor).
    summary["workers_cpu_cores"] = round(max(fleet_after - fleet_before, 0.0) / max(result.wall_s, 1e-9), 3)
    if disrupted:
        summary["disruptions"] = disrupted
    if plan.keep_records:
        summary["records"] = metrics.records_json(result.records)
    return summary, over


PER_SEED_PARAMS = ("trace_start_s", "requests", "rate", "replay_s", "sessions", "longest_prompt_tokens",
                   "working_set_tokens", "prompt_tokens")
"""Parameters a cell's table lists per seed when its seeds differ in them (a trace's windows, which are its
seeds); the rest are the first seed's."""


def cell_params(built: list[Workload]) -> dict[str, Any]:
    """The parameters a cell's table states: the first seed's, the seeds, and for `PER_SEED_PARAMS` that differ
    between seeds (a trace replayed in several windows), the value of each, in seed order."""
    params = {**built[0].params, "seeds": [w.params.get("seed") for w in built]}
    for k in PER_SEED_PARAMS:
        values = [w.params.get(k) for w in built]
        if k in params and len(set(map(repr, values))) > 1:
            params[k] = values
    return params


def title(w: Workload) -> str:
    """The name a workload's tables go by: its own, and for a trace, the file (or WEKA directory) it replays, so
    the tables of two traces in one report (the shipped one, Mooncake's, WEKA's) never share a key or a goal."""
    trace = w.params.get("trace")
    return f"{w.name} ({Path(str(trace)).stem})" if w.name == "trace" and trace else w.name


def label(name: str, replicas: int, plan: Plan) -> str:
    """The key of one table: the workload and what was done to it."""
    parts = [name]
    if plan.disruptions:
        parts.append("restarts " + ",".join(d.label() for d in plan.disruptions))
    if plan.bypass:
        parts.append(f"bypass {plan.bypass:.0%}")
    if replicas > 1:
        parts.append(f"{replicas} replicas" + (", sticky" if plan.sticky else ""))
    return ", ".join(parts)


def run(plan: Plan, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict[str, Any]:
    started = time.monotonic()
    out: dict[str, Any] = {
        **run_head(plan.cluster),
        "mode": {"concurrency": plan.concurrency} if plan.concurrency else {"open_loop": True},
        "contestants": {c.name: c.what for c in plan.contestants},
        "workloads": {}, "overhead": {}, "sweep": None,
    }
    with tempfile.TemporaryDirectory(prefix="cortex-bench-") as tmp:
        root = plan.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        fleets: dict[ClusterSpec, list[list[Workload]]] = {}
        for built in plan.workloads:
            fleets.setdefault(fleet_of(built[0], plan), []).append(built)
        for spec, group in fleets.items():
            with Procs(root) as cluster_procs:
                workers = start_workers(cluster_procs, spec)
                for built in group:
                    first = built[0]
                    fleet_kv = spec.workers * spec.kv_tokens
                    # The fleet's fill by the largest seed's working set (a trace's windows differ widely).
                    ws = max(int(w.params.get("working_set_tokens") or 0) for w in built)
                    for replicas in plan.replicas:
                        key = label(title(first), replicas, plan)
                        log(f"workload {key}: {first.requests} requests x {len(built)} seed(s), {first.params}")
                        results: dict[str, Any] = {}
                        for c in plan.contestants:
                            per_seed = {int(w.params.get("seed", 0)): run_one(c, w, workers, cluster_procs, root,
                                                                               plan, replicas, out, log)
                                        for w in built}
                            results[c.name] = metrics.combine(per_seed)
                        out["workloads"][key] = {
                            "workload": title(first), "params": cell_params(built),
                            "replicas": replicas, "sticky": plan.sticky, "bypass": plan.bypass,
                            "disruptions": [d.label() for d in plan.disruptions],
                            "fleet": {"workers": spec.workers, "kv_tokens_per_worker": spec.kv_tokens,
                                      "working_set_tokens": ws, "kv_fill": round(ws / fleet_kv, 2),
                                      **({"max_model_len": spec.max_model_len} if spec.max_model_len else {})},
                            "results": results}
                if plan.sweep and spec == fleet_of(plan.sweep[0], plan):
                    out["sweep"] = _sweep(plan, workers, cluster_procs, root, out, log)
    finish(out, started)
    return out


def _sweep(plan: Plan, workers: list[Worker], cluster: Procs, root: Path, out: dict[str, Any],
           log: Callable[[str], None]) -> dict[str, Any]:
    sweep: dict[str, Any] = {"workload": plan.sweep[0].name, "rates": [w.params["rate"] for w in plan.sweep],
                             "results": {}}
    for c in plan.sweep_contestants:
        rows = []
        for workload in plan.sweep:
            log(f"sweep {workload.name} at {workload.params['rate']}/s")
            rows.append({"rate": workload.params["rate"],
                         **run_one(c, workload, workers, cluster, root, plan, 1, out, log)})
        sweep["results"][c.name] = rows
    return sweep


def run_one(c: Contestant, workload: Workload, workers: list[Worker], cluster: Procs, root: Path, plan: Plan,
            replicas: int, out: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """One cell: the contestant started fresh on emptied caches, the workload replayed through it, stopped; its
    summary, or why it is unavailable or failed. Measures the gateway overhead first when `out["overhead"]` has
    none for it yet (and the plan asks for probes)."""
    reason = c.unavailable()
    if reason is not None:
        log(f"  {c.name}: not available: {reason}")
        return {"unavailable": reason}
    log(f"  {c.name} (seed {workload.params.get('seed')}) ...")
    t = time.monotonic()
    try:
        summary, over = _measure(c, workload, workers, cluster, root, plan, replicas,
                                 c.name not in out["overhead"], log)
    except Exception as exc:  # one contestant failing must not lose the others' figures
        log(f"  {c.name}: FAILED: {exc}")
        return {"failed": f"{type(exc).__name__}: {exc}"[:500], "trace": traceback.format_exc()[-1500:]}
    if over is not None:
        out["overhead"][c.name] = over
    log(f"  {c.name}: hit {summary['hit_ratio']} ttft p50/p90 {summary['ttft_ms']['p50']}/"
        f"{summary['ttft_ms']['p90']} ms, {summary['completed']}/{summary['requests']} ok, "
        f"imbalance {summary['imbalance']}, cpu {summary['gateway_cpu_ms_per_request']} ms/req "
        f"({time.monotonic() - t:.0f} s)")
    return summary
