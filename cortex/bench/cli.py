"""`cortex bench`: Cortex against the engines' own routers, round-robin and an oracle, on one simulated cluster.

    cortex bench --workload shared-prefix --quick --json out.json
    cortex bench --report docs/benchmarks.md --img-dir docs/img --json bench.json      # the full run

See docs/benchmarks.md for the workloads, contestants and measures.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from cortex.bench import report, runner, workloads
from cortex.bench.contestants import BY_NAME, CONTESTANTS
from cortex.bench.launch import ClusterSpec

SWEEP_SECONDS = 15.0
SWEEP_CONTESTANTS = ("cortex", "cortex-load-only", "sglang-cache-aware", "round-robin", "oracle")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cortex bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", action="append", choices=[*workloads.BUILDERS, "all"],
                   help="workload to run (repeatable; default all four)")
    p.add_argument("--contestant", action="append", choices=list(BY_NAME),
                   help="contestant to measure (repeatable; default all)")
    p.add_argument("--quick", action="store_true", help="small request counts, no rate sweep (under 3 minutes)")
    p.add_argument("--json", metavar="PATH", help="write every figure (and the command) as JSON")
    p.add_argument("--report", metavar="PATH", help="put the tables between the result markers of this Markdown "
                                                    "file (docs/benchmarks.md)")
    p.add_argument("--img-dir", metavar="DIR", help="write PNG plots here (needs matplotlib)")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="simulated worker flavour")
    p.add_argument("--workers", type=int, default=4, help="simulated workers (default %(default)s)")
    p.add_argument("--kv-tokens", type=int, default=12288,
                   help="KV pool per worker in tokens (default %(default)s: the shared prefixes do not fit one)")
    p.add_argument("--requests", type=int, help="requests per workload (default: per workload, smaller --quick)")
    p.add_argument("--rate", type=float, help="open-loop arrival rate per second (default: per workload)")
    p.add_argument("--concurrency", type=int, help="closed loop: this many sessions at a time instead of a rate")
    p.add_argument("--replicas", type=int, default=1,
                   help="start each gateway contestant this many times over the same workers; the client "
                        "spreads requests over them round-robin, as an L4 balancer would (default %(default)s)")
    p.add_argument("--seed", type=int, default=1, help="workload seed (default %(default)s)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="no new session after this many seconds of a run (default 120, --quick 40)")
    p.add_argument("--sweep-rates", default=None,
                   help="comma-separated rates for the TTFT-vs-rate sweep of shared-prefix (default 4,8,16; "
                        "none with --quick; 'off' to skip)")
    p.add_argument("--overhead-probes", type=int, default=None,
                   help="light-load request pairs per gateway for the overhead figure (default 20, --quick 8)")
    p.add_argument("--work-dir", metavar="DIR", help="keep logs and configs here instead of a temporary directory")
    p.add_argument("--records", action="store_true", help="include every request's record in the JSON")
    p.add_argument("--from-json", metavar="PATH", help="render the report and plots of a saved --json run "
                                                       "instead of running")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    names = args.workload or ["all"]
    if "all" in names:
        names = list(workloads.BUILDERS)
    built = [workloads.build(n, quick=args.quick, seed=args.seed, requests=args.requests, rate=args.rate)
             for n in names]
    contestants = [BY_NAME[n] for n in args.contestant] if args.contestant else list(CONTESTANTS)
    sweep_spec = args.sweep_rates or ("off" if args.quick else "4,8,16")
    # Each sweep point lasts about SWEEP_SECONDS of arrivals, so a high rate does not take longer than a low one.
    sweep = [] if sweep_spec == "off" else [
        workloads.build("shared-prefix", quick=args.quick, seed=args.seed,
                        requests=args.requests or max(8, round(float(r) * SWEEP_SECONDS)), rate=float(r))
        for r in sweep_spec.split(",")]
    plan = runner.Plan(
        cluster=ClusterSpec(workers=args.workers, engine=args.engine, kv_tokens=args.kv_tokens),
        workloads=built, contestants=contestants, concurrency=args.concurrency,
        max_seconds=args.max_seconds or (40.0 if args.quick else 120.0),
        overhead_probes=args.overhead_probes if args.overhead_probes is not None else (8 if args.quick else 20),
        sweep=sweep, sweep_contestants=[c for c in contestants if c.name in SWEEP_CONTESTANTS],
        work_dir=Path(args.work_dir) if args.work_dir else None, keep_records=args.records,
        replicas=args.replicas)
    if args.from_json:
        out = json.loads(Path(args.from_json).read_text())
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
        report.write_markdown(doc, text)
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(text)
    return 0 if all("failed" not in r for b in out["workloads"].values() for r in b["results"].values()) else 1
