"""`cortex bench`: Cortex against the engines' own routers, round-robin and an oracle, on one simulated cluster.

    cortex bench --workload shared-prefix --quick --json out.json
    cortex bench --report docs/benchmarks.md --img-dir docs/img --json bench.json      # the full run
    cortex bench --saturation --quick --json saturation.json      # highest rate under 10 ms added TTFT p99
    cortex bench --noisy-neighbor --json noisy.json               # a steady tenant's TTFT while another floods
    cortex bench --trace ../shared/traces/conversation_trace.jsonl --trace-start 600 --trace-seconds 90
    cortex bench --goodput --trace perf/traces/mooncake-small.jsonl --contestant cortex   # highest rate in SLO

See docs/benchmarks.md for the workloads, contestants and measures.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from cortexbench import goodput, noisy, report, runner, saturation, slo, trace, trace_lines, trace_weka, workloads
from cortexbench.contestants import BY_NAME, CONTESTANTS
from cortexbench.launch import ClusterSpec

SWEEP_SECONDS = 15.0
# `--workload all`: the original single-gateway four (the scenarios of the fleet matrix are asked for by name).
DEFAULT_WORKLOADS = ("shared-prefix", "multi-turn", "unique", "burst")
SWEEP_CONTESTANTS = ("cortex", "cortex-load-only", "sglang-cache-aware", "round-robin", "oracle")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cortex bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", action="append", choices=[*workloads.BUILDERS, "all"],
                   help="workload to run (repeatable; default 'all': shared-prefix, multi-turn, unique, burst)")
    p.add_argument("--contestant", action="append", choices=[*BY_NAME, *(n for n in noisy.CONTESTANTS
                                                                      if n not in BY_NAME)],
                   help="contestant to measure (repeatable; default all; cortex-no-limits, smg-global-limit and "
                        "cortex-waiting-room are --noisy-neighbor's)")
    p.add_argument("--quick", action="store_true", help="small request counts, no rate sweep (under 3 minutes)")
    p.add_argument("--json", metavar="PATH", help="write every figure (and the command) as JSON")
    p.add_argument("--report", metavar="PATH", help="put the tables between the result markers of this Markdown "
                                                    "file (docs/benchmarks.md)")
    p.add_argument("--report-section", default="results", metavar="NAME",
                   help="the markers to write between: <!-- bench:NAME:start --> ... end (default %(default)s)")
    p.add_argument("--img-dir", metavar="DIR", help="write PNG plots here (needs matplotlib)")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="simulated worker flavour")
    p.add_argument("--workers", type=int, default=None,
                   help="simulated workers (default: what each workload is designed for; 4 for the original four, "
                        "8 for a trace)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV pool per worker in tokens (default: per workload; 12288 for the original four, so the "
                        "shared prefixes do not fit one worker; for a trace 16384 when its longest prompt fits, "
                        "else 262144)")
    p.add_argument("--requests", type=int, help="requests per workload (default: per workload, smaller --quick)")
    p.add_argument("--rate", type=float, help="open-loop arrival rate per second (default: per workload)")
    p.add_argument("--concurrency", type=int, help="closed loop: this many sessions at a time instead of a rate")
    p.add_argument("--replicas", default="1", metavar="N[,N...]",
                   help="start each gateway contestant N times over the same workers; the client spreads requests "
                        "over them round-robin, as an L4 balancer would; a list (1,2,4) runs each (default 1)")
    p.add_argument("--sticky", action="store_true",
                   help="with replicas: keep each session (conversation, trace session) on one replica, as a "
                        "balancer with session affinity would (default: no stickiness)")
    p.add_argument("--bypass", type=float, default=0.0, metavar="FRACTION",
                   help="send this share of sessions straight to a worker, past the gateway, as batch jobs or "
                        "another gateway would (the hit ratio is reported for the rest)")
    p.add_argument("--restart-workers", default="", metavar="KIND@S[:W],...",
                   help="disrupt the fleet mid-run: 'restart' (the worker crashes and comes back empty) or 'flush' "
                        "(it drops its cache) at S seconds, on worker W (default: the next in turn), e.g. "
                        "restart@15,flush@30")
    g = p.add_argument_group("trace replay (--workload trace; docs/benchmarks.md, 'Traces')")
    g.add_argument("--trace", metavar="PATH",
                   help="the 'trace' workload's trace: Mooncake-format JSONL, or a WEKA kv-cache-tester conversation "
                        "(trace_*.json) or a directory of them; told apart by content. Alone (no --workload), it "
                        "runs the trace workload only")
    g.add_argument("--trace-start", default=None, metavar="SECONDS[,SECONDS...]",
                   help="replay from this offset after the trace's first arrival (trace time; default 0); several "
                        "(whole seconds, e.g. 0,600,1200): each window is one seed of the trace workload, and the "
                        "tables show the mean and spread over them")
    g.add_argument("--trace-seconds", type=float, default=None, metavar="SECONDS",
                   help="replay the lines arriving within this many seconds from --trace-start (trace time; "
                        "default: to the end, or --quick's first 40 s of replay)")
    g.add_argument("--time-scale", type=float, default=None, metavar="X",
                   help="multiply the trace's gaps by X (< 1 compresses; --rate overrides it; default 1)")
    g.add_argument("--max-input", type=int, default=None, metavar="TOKENS",
                   help=f"cut longer prompts to their first blocks (default {trace.MAX_INPUT})")
    g.add_argument("--max-idle", type=float, default=None, metavar="SECONDS",
                   help=f"WEKA: cut pauses within a conversation to this (trace time; default "
                        f"{trace_weka.MAX_IDLE_S:g}; inf keeps them)")
    g.add_argument("--conversation-gap", type=float, default=None, metavar="SECONDS",
                   help=f"WEKA: conversation k starts k x this after the first (trace time; default "
                        f"{trace_weka.CONVERSATION_GAP_S:g})")
    p.add_argument("--seed", type=int, default=1, help="workload seed (default %(default)s)")
    p.add_argument("--seeds", metavar="S[,S...]",
                   help="repeat each cell with these seeds and report the mean and spread (overrides --seed)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="no new session after this many seconds of a run (default 120, --quick 40); with "
                        "--saturation, the whole sweep's bound (default 600, --quick 150)")
    p.add_argument("--sweep-rates", default=None,
                   help="comma-separated rates for the TTFT-vs-rate sweep of shared-prefix (default 4,8,16 when "
                        "shared-prefix is run; none with --quick; 'off' to skip)")
    p.add_argument("--overhead-probes", type=int, default=None,
                   help="light-load request pairs per gateway for the overhead figure (default 20, --quick 8)")
    p.add_argument("--work-dir", metavar="DIR", help="keep logs and configs here instead of a temporary directory")
    p.add_argument("--records", action="store_true", help="include every request's record in the JSON")
    g = p.add_argument_group("saturation sweep (--saturation; docs/benchmarks.md, 'Saturation')")
    g.add_argument("--saturation", action="store_true",
                   help="instead of the workloads: per contestant (default cortex, smg-cache-aware, envoy-alone), "
                        "the highest request rate at which the added TTFT p99 stays under --limit-ms, on workers "
                        "with zero compute time (default a few minutes; --quick about two)")
    g.add_argument("--saturation-rates", metavar="R[,R...]",
                   help="the ladder of request rates (default 25,50,100,200,400,800; --quick 25,50,100,200,400)")
    g.add_argument("--rung-seconds", type=float, default=None,
                   help="seconds of arrivals per rung and path (default 6, --quick 2)")
    g.add_argument("--limit-ms", type=float, default=saturation.LIMIT_MS,
                   help="added TTFT p99 a rung may not exceed (default %(default)s)")
    g = p.add_argument_group("noisy neighbour (--noisy-neighbor; docs/tenancy/noisy-neighbor.md)")
    g.add_argument("--noisy-neighbor", action="store_true",
                   help="instead of the workloads: per contestant (default cortex, cortex-no-limits, "
                        "cortex-priority, smg-cache-aware, smg-global-limit) and seed (default 1,2,3), a steady "
                        "tenant's TTFT p50/p90 alone and while another tenant floods, on 2 workers with real compute "
                        "costs (about 9 minutes on 2 cores; --quick: one seed, a 5 s flood, about 4)")
    g.add_argument("--steady-rate", type=float, default=3.0, help="steady tenant's req/s (default %(default)s)")
    g.add_argument("--noisy-rate", type=float, default=40.0, help="noisy tenant's req/s (default %(default)s)")
    g.add_argument("--warmup-seconds", type=float, default=2.0,
                   help="steady tenant alone before the flood, left out of the figures (default %(default)s)")
    g.add_argument("--flood-seconds", type=float, default=None, help="the flood's length (default 10, --quick 5)")
    g.add_argument("--noisy-max-concurrent", type=int, default=noisy.NOISY_MAX_CONCURRENT,
                   help="Cortex's max_concurrent limit on the noisy tenant (default %(default)s)")
    g = p.add_argument_group("goodput (--goodput; docs/benchmarks.md, 'Goodput')")
    g.add_argument("--goodput", action="store_true",
                   help="instead of the tables: per contestant (default " + ", ".join(goodput.CONTESTANTS) + ") and "
                        "workload, the highest arrival rate (the workload's times scaled) at which TTFT and ITL p90 "
                        "stay under the SLOs, by a doubling ladder from the workload's rate, then bisection")
    ttft = g.add_mutually_exclusive_group()
    ttft.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                      help=f"a fixed TTFT SLO for every workload (default: {slo.SLO_TTFT_MS:g} ms for the synthetic "
                           f"workloads, and the relative one for a trace)")
    ttft.add_argument("--slo-ttft-slowdown", type=float, default=None, metavar="X",
                      help=f"a relative TTFT SLO for every workload: TTFT <= X x the request's solo time, its "
                           f"cold prefill alone on an idle simulated worker (default for a trace: "
                           f"{slo.SLO_TTFT_SLOWDOWN:g})")
    g.add_argument("--slo-itl-ms", type=float, default=slo.SLO_ITL_MS,
                   help="inter-token latency SLO in ms (default %(default)s)")
    g.add_argument("--slo-percentile", type=float, default=slo.PERCENTILE,
                   help="the percentile of requests that must meet each SLO (default %(default)s)")
    g.add_argument("--goodput-runs", type=int, default=goodput.MAX_RUNS,
                   help="runs per contestant and workload at most (default %(default)s)")
    p.add_argument("--from-json", metavar="PATH", action="append",
                   help="render the report and plots of saved --json runs instead of running (repeatable: the "
                        "runs' tables are put together)")
    return p


def _ints(spec: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"cortex bench: {what} takes comma-separated integers, not {spec!r}") from None
    if not values:
        raise SystemExit(f"cortex bench: {what} is empty")
    return values


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several saved runs as one report: the first run's header, every run's tables (a later run's table of the
    same name wins), every command."""
    out = dict(runs[0])
    out["workloads"], out["overhead"], out["contestants"] = {}, {}, {}
    for r in runs:
        out["workloads"].update(r["workloads"])
        out["overhead"].update(r.get("overhead") or {})
        out["contestants"].update(r["contestants"])
        out["sweep"] = r.get("sweep") or out.get("sweep")
    out["command"] = "\n".join(r["command"] for r in runs)
    out["elapsed_s"] = round(sum(r.get("elapsed_s") or 0 for r in runs), 1)
    return out


def _rates(spec: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"cortex bench: --saturation-rates takes comma-separated numbers, not {spec!r}") from None
    if not rates or any(not 0 < r <= 5000 for r in rates) or list(rates) != sorted(set(rates)):
        raise SystemExit("cortex bench: --saturation-rates is a rising list of rates in (0, 5000] per second")
    return rates


def _saturation(args: argparse.Namespace, argv: list[str]) -> int:
    if args.from_json:
        out = json.loads(Path(args.from_json[-1]).read_text())
        # Recomputed from the saved summaries, so a run saved by an older version reads as this one would.
        out["ratios"] = saturation.ratios({n: b["summary"] for n, b in out["saturation"].items() if "summary" in b})
        command = out["command"]
    else:
        names = args.contestant or list(saturation.CONTESTANTS)
        plan = saturation.SaturationPlan(
            contestants=[BY_NAME[n] for n in names],
            rates=_rates(args.saturation_rates) if args.saturation_rates else (
                saturation.QUICK_RATES if args.quick else saturation.RATES),
            rung_seconds=args.rung_seconds or (2.0 if args.quick else 6.0),
            min_requests=40 if args.quick else 60,
            limit_ms=args.limit_ms, max_seconds=args.max_seconds or (150.0 if args.quick else 600.0),
            workers=args.workers or 4, engine=args.engine, seed=args.seed,
            work_dir=Path(args.work_dir) if args.work_dir else None)
        if plan.rung_seconds <= 0 or plan.max_seconds <= 0:
            raise SystemExit("cortex bench: --rung-seconds and --max-seconds are positive")
        out = saturation.run(plan)
        command = "cortex bench " + shlex.join(argv)
        out["command"] = command
    text = saturation.markdown(out, command)
    _emit(args, out, text)
    return 1 if any("failed" in b for b in out["saturation"].values()) else 0


def _noisy(args: argparse.Namespace, argv: list[str]) -> int:
    if args.from_json:
        out = json.loads(Path(args.from_json[-1]).read_text())
        command = out["command"]
    else:
        names = args.contestant or list(noisy.DEFAULT)
        unknown = [n for n in names if n not in noisy.CONTESTANTS]
        if unknown:
            raise SystemExit(f"cortex bench: --noisy-neighbor contestants are {', '.join(noisy.CONTESTANTS)}, "
                             f"not {', '.join(unknown)}")
        seed_given = any(a == "--seed" or a.startswith("--seed=") for a in argv)
        seeds = _ints(args.seeds, "--seeds") if args.seeds else (args.seed,) if args.quick or seed_given \
            else (1, 2, 3)
        plan = noisy.NoisyPlan(
            contestants=[noisy.CONTESTANTS[n] for n in names], seeds=seeds, steady_rate=args.steady_rate,
            noisy_rate=args.noisy_rate, warmup_s=args.warmup_seconds,
            flood_s=args.flood_seconds or (5.0 if args.quick else 10.0),
            noisy_max_concurrent=args.noisy_max_concurrent, max_seconds=args.max_seconds or 600.0,
            workers=args.workers or 2, engine=args.engine, work_dir=Path(args.work_dir) if args.work_dir else None)
        if min(plan.steady_rate, plan.noisy_rate, plan.flood_s, plan.max_seconds) <= 0 or plan.warmup_s < 0 \
                or plan.noisy_max_concurrent < 1:
            raise SystemExit("cortex bench: the noisy-neighbor rates, seconds and limit are positive")
        if (plan.warmup_s + plan.flood_s) * (plan.steady_rate + plan.noisy_rate) > 20000:
            raise SystemExit("cortex bench: --noisy-neighbor is bounded to 20000 requests a run")
        out = noisy.run(plan)
        command = "cortex bench " + shlex.join(argv)
        out["command"] = command
    text = noisy.markdown(out, command)
    _emit(args, out, text)
    return 1 if any("failed" in b for b in out["noisy"].values()) else 0


def _trace_params(args: argparse.Namespace) -> dict[str, Any]:
    """The trace workload's own arguments given on the command line (its defaults stand for the rest). The fleet
    options go in too: the workload is built for the fleet it will run on (its workers' context length is that
    fleet's KV pool)."""
    starts = _starts(args)
    given = {"trace_start_s": starts[0] if len(starts) == 1 else None, "trace_seconds": args.trace_seconds,
             "time_scale": args.time_scale, "max_input": args.max_input, "max_idle_s": args.max_idle,
             "conversation_gap_s": args.conversation_gap, "workers": args.workers, "kv_tokens": args.kv_tokens}
    return {k: v for k, v in given.items() if v is not None}


def _names(args: argparse.Namespace) -> list[str]:
    names = args.workload or (["trace"] if args.trace else ["all"])
    if "all" in names:
        names = list(DEFAULT_WORKLOADS)
    if "trace" in names and not args.trace:
        raise SystemExit("cortex bench: the trace workload needs --trace PATH (e.g. perf/traces/mooncake-small.jsonl, "
                         "../shared/traces/conversation_trace.jsonl or ../shared/traces/kv-cache-tester)")
    window = [f"--{k.replace('_', '-')}" for k in ("trace_start", "trace_seconds", "time_scale", "max_input",
                                                   "max_idle", "conversation_gap") if getattr(args, k) is not None]
    if window and "trace" not in names:
        raise SystemExit(f"cortex bench: {', '.join(window)} apply to the trace workload only (--workload trace)")
    return names


def _starts(args: argparse.Namespace) -> tuple[float, ...]:
    """The --trace-start windows: none given, one offset, or several (each a whole number of seconds, all
    different, as each names its seed)."""
    if args.trace_start is None:
        return ()
    try:
        starts = tuple(float(x) for x in str(args.trace_start).split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"cortex bench: --trace-start takes seconds, or comma-separated seconds, not "
                         f"{args.trace_start!r}") from None
    if not starts or any(not 0 <= s < float("inf") for s in starts):
        raise SystemExit("cortex bench: --trace-start is one or more offsets >= 0 seconds")
    if len(starts) > 1 and (any(s != int(s) for s in starts) or len(set(starts)) < len(starts)):
        raise SystemExit("cortex bench: several --trace-start windows are whole, different numbers of seconds "
                         "(each names its seed)")
    return starts


def _build(args: argparse.Namespace, names: list[str], seeds: tuple[int, ...]) -> list[list[workloads.Workload]]:
    """Each workload built once per seed; the trace workload, given several --trace-start windows, once per window
    instead, each window its seed (named by its start in seconds), all on the fleet the largest needs."""
    tp = _trace_params(args)
    starts = _starts(args)

    def one(n: str, seed: int, params: dict[str, Any]) -> workloads.Workload:
        return workloads.build(n, quick=args.quick, seed=seed, requests=args.requests, rate=args.rate,
                               trace_path=args.trace, trace_params=params)

    try:
        out = []
        for n in names:
            if n == "trace" and len(starts) > 1:
                windows = [one(n, int(s), {**tp, "trace_start_s": s}) for s in starts]
                out.append(trace.same_fleet(windows))
            else:
                out.append([one(n, seed, tp) for seed in seeds])
        return out
    except trace_lines.TraceError as exc:
        raise SystemExit(f"cortex bench: {exc}") from None



def _emit(args: argparse.Namespace, out: dict[str, Any], text: str) -> None:
    """A sweep's outputs: its Markdown into --report's section, its figures to --json (unless re-rendered from
    JSON), and the Markdown on stdout."""
    if args.report:
        report.write_markdown(Path(args.report), text, args.report_section)
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(text)

def _goodput(args: argparse.Namespace, argv: list[str]) -> int:
    if args.from_json:
        out = goodput.merge([json.loads(Path(p).read_text()) for p in args.from_json])
        command = out["command"]
    else:
        if args.concurrency:
            raise SystemExit("cortex bench: --goodput scales open-loop arrival times; --concurrency does not apply")
        if args.bypass or args.restart_workers or args.seeds or "," in args.replicas or len(_starts(args)) > 1:
            raise SystemExit("cortex bench: --goodput takes one --replicas count and one --trace-start window, no "
                             "--bypass, --restart-workers or --seeds")
        try:
            ttft = (slo.TtftSlo(ms=args.slo_ttft_ms) if args.slo_ttft_ms is not None
                    else slo.TtftSlo(slowdown=args.slo_ttft_slowdown) if args.slo_ttft_slowdown is not None else None)
        except ValueError as exc:
            raise SystemExit(f"cortex bench: {exc}") from None
        if args.slo_itl_ms <= 0 or not 0 < args.slo_percentile <= 100 or not 1 <= args.goodput_runs <= 12:
            raise SystemExit("cortex bench: --slo-itl-ms is positive, --slo-percentile in (0, 100], --goodput-runs "
                             "1-12")
        replicas = _ints(args.replicas, "--replicas")
        names = args.contestant or list(goodput.CONTESTANTS)
        plan = runner.Plan(
            cluster=ClusterSpec(workers=args.workers or 4, engine=args.engine, kv_tokens=args.kv_tokens or 12288),
            override_workers=args.workers, override_kv_tokens=args.kv_tokens,
            workloads=_build(args, _names(args), (args.seed,)), contestants=[BY_NAME[n] for n in names],
            max_seconds=args.max_seconds or (40.0 if args.quick else 120.0), overhead_probes=0,
            work_dir=Path(args.work_dir) if args.work_dir else None, keep_records=True, replicas=replicas,
            sticky=args.sticky, grace_s=goodput.GRACE_S)
        out = goodput.run(plan, ttft=ttft, itl_ms=args.slo_itl_ms, percentile=args.slo_percentile,
                          max_runs=args.goodput_runs, keep_records=args.records)
        command = "cortex bench " + shlex.join(argv)
        out["command"] = command
    text = goodput.markdown(out, command)
    _emit(args, out, text)
    return 1 if any("failed" in r for b in out["goodput"].values() for r in b["results"].values()) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.noisy_neighbor:
        return _noisy(args, argv)
    if args.contestant and any(n not in BY_NAME for n in args.contestant):
        raise SystemExit("cortex bench: cortex-no-limits, smg-global-limit and cortex-waiting-room run only with "
                         "--noisy-neighbor")
    if args.saturation:
        return _saturation(args, argv)
    if args.goodput:
        return _goodput(args, argv)
    names = _names(args)
    if not 0.0 <= args.bypass < 1.0:
        raise SystemExit("cortex bench: --bypass is a fraction in [0, 1)")
    try:
        disruptions = runner.parse_disruptions(args.restart_workers)
    except ValueError as exc:
        raise SystemExit(f"cortex bench: {exc}") from None
    replicas = _ints(args.replicas, "--replicas")
    if any(not 1 <= r <= 16 for r in replicas):
        raise SystemExit("cortex bench: --replicas counts from 1 to 16")
    seeds = _ints(args.seeds, "--seeds") if args.seeds else (args.seed,)
    built = [] if args.from_json else _build(args, names, seeds)
    contestants = [BY_NAME[n] for n in args.contestant] if args.contestant else list(CONTESTANTS)
    # The sweep goes with the shared-prefix tables (a trace replay or a newer scenario alone runs none by default).
    sweep_spec = args.sweep_rates or ("off" if args.quick or "shared-prefix" not in names else "4,8,16")
    # Each sweep point lasts about SWEEP_SECONDS of arrivals, so a high rate does not take longer than a low one.
    sweep = [] if sweep_spec == "off" else [
        workloads.build("shared-prefix", quick=args.quick, seed=seeds[0],
                        requests=args.requests or max(8, round(float(r) * SWEEP_SECONDS)), rate=float(r))
        for r in sweep_spec.split(",")]
    plan = runner.Plan(
        cluster=ClusterSpec(workers=args.workers or 4, engine=args.engine, kv_tokens=args.kv_tokens or 12288),
        override_workers=args.workers, override_kv_tokens=args.kv_tokens,
        workloads=built, contestants=contestants, concurrency=args.concurrency,
        max_seconds=args.max_seconds or (40.0 if args.quick else 120.0),
        overhead_probes=args.overhead_probes if args.overhead_probes is not None else (8 if args.quick else 20),
        sweep=sweep, sweep_contestants=[c for c in contestants if c.name in SWEEP_CONTESTANTS],
        work_dir=Path(args.work_dir) if args.work_dir else None, keep_records=args.records,
        replicas=replicas, sticky=args.sticky, bypass=args.bypass, disruptions=disruptions)
    if args.from_json:
        out = merge([json.loads(Path(p).read_text()) for p in args.from_json])
        command = out["command"]
    else:
        out = runner.run(plan)
        command = "cortex bench " + shlex.join(argv)
        out["command"] = command
    images: list[Path] = []
    if args.img_dir:
        images = report.plots(out, Path(args.img_dir))
    doc = Path(args.report) if args.report else None
    text = report.markdown(out, command, images, rel_to=doc.parent if doc else None)
    if doc is not None:
        report.write_markdown(doc, text, args.report_section)
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(text)
    failed = any("failed" in r or r.get("failed_seeds")
                 for b in out["workloads"].values() for r in b["results"].values())
    return 1 if failed else 0
