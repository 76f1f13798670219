"""`cortex bench --saturation`: the highest request rate each gateway sustains while adding at most 10 ms to the
time to first token at p99.

Simulated workers with zero compute time (no prefill, no decode cost), so the gateway is what saturates. For each
contestant, started once, the open-loop request rate climbs a bounded ladder (10, 25, 50, 100 ... req/s); each rung
sends the same small cold chats (~200 tokens, 4 output tokens) twice at the same Poisson arrival times: straight
to the workers (the client round-robins them) and through the contestant. The *added* TTFT at a rung is a
percentile through the gateway minus the same percentile direct, measured back to back (requests under load
cannot be paired one to one, as the light-load overhead probes are). A contestant's ladder stops at the first
rung whose added p99 exceeds the limit twice in a row (the rung is sent again once before it counts), that has
errors, or where the direct path itself fell behind (the client and the simulators share this machine's cores:
past that point no gateway can be measured, and the last rate under the limit is a lower bound). Bounded: each
rung in requests and seconds, the whole sweep in seconds.
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from cortexbench import client, metrics
from cortexbench.client import Record, RunResult
from cortexbench.contestants import Contestant
from cortexbench.launch import ClusterSpec, Procs, Worker, start_workers
from cortexbench.report import num as _f
from cortexbench.report import run_line
from cortexbench.workloads import Workload, unique

LIMIT_MS = 10.0
RATES = (10.0, 25.0, 50.0, 100.0, 200.0, 400.0, 800.0)
QUICK_RATES = (10.0, 25.0, 50.0, 100.0, 200.0, 400.0)
CONTESTANTS = ("cortex", "smg-cache-aware", "envoy-alone")
PROMPT_WORDS = 200
MAX_TOKENS = 4
WARMUP_S = 0.3
HARNESS_LAG_FACTOR = 2.0
"""The direct path's client sending a tenth of its requests this many times the limit late (p90 of the send lag):
the client, on the same cores, is what saturates (it no longer offers the rate), and the rung measures it, not the
gateway. p90, not p99: one stall of the client's event loop on a loaded machine delays a handful of sends without
changing the rate offered."""
HARNESS = "harness limit"
"""The prefix of a stop reason that is the measuring setup's, not the gateway's."""


@dataclass
class SaturationPlan:
    contestants: list[Contestant]
    rates: tuple[float, ...] = RATES
    rung_seconds: float = 6.0
    """Arrivals per rung last about this long (requests = rate x seconds, within the bounds below)."""
    min_requests: int = 60
    max_requests: int = 3000
    limit_ms: float = LIMIT_MS
    max_seconds: float = 600.0
    """The whole sweep: a contestant's ladder stops (its figure a lower bound) when its share is spent."""
    workers: int = 4
    engine: str = "vllm"
    seed: int = 1
    work_dir: Path | None = None


# ---- the pure part: what one rung measured, when a ladder stops, what it sums up to ----

def added(via: list[float], direct: list[float]) -> dict[str, float | None]:
    """TTFT percentiles (seconds in, ms out) through the gateway and direct, and their differences."""
    out: dict[str, float | None] = {}
    for q in (50, 99):
        v, d = metrics.percentile(via, q), metrics.percentile(direct, q)
        out[f"via_p{q}_ms"] = None if v is None else round(v * 1000, 2)
        out[f"direct_p{q}_ms"] = None if d is None else round(d * 1000, 2)
        out[f"added_p{q}_ms"] = None if v is None or d is None else round((v - d) * 1000, 2)
    return out


def send_lag_ms(records: list[Record], scheduled: dict[int, float], q: float = 90) -> float | None:
    """How late the client sent (percentile q of actual minus scheduled send time): once most sends are late, the
    client itself, not what it measures, is the bottleneck."""
    lags = [r.sent - scheduled[r.session] for r in records if r.session in scheduled]
    p = metrics.percentile(lags, q)
    return None if p is None else round(max(p, 0.0) * 1000, 2)


def stop_reason(row: dict[str, Any], limit_ms: float) -> str | None:
    """Why the ladder ends at this rung, or None when the rung stayed under the limit."""
    if "failed" in row:
        return f"failed: {row['failed']}"
    if row["direct_errors"]:
        return f"{HARNESS}: {row['direct_errors']} errors on the direct path"
    lag = row.get("direct_send_lag_p90_ms")
    if lag is not None and lag > HARNESS_LAG_FACTOR * limit_ms:
        return f"{HARNESS}: the client sent {lag:g} ms late (p90) on the direct path"
    if row["errors"]:
        return f"{row['errors']} errors"
    if row["added_p99_ms"] is None:
        return "no request completed"
    if row["added_p99_ms"] > limit_ms:
        return f"added p99 {row['added_p99_ms']:g} ms > {limit_ms:g} ms"
    return None


def should_confirm(row: dict[str, Any], limit_ms: float) -> bool:
    """A rung that broke the latency limit, or where the client fell behind, is sent again once before the ladder
    stops on it (both can be one moment's load on a shared machine); errors are never sent again."""
    reason = stop_reason(row, limit_ms)
    return (reason is not None and reason.startswith(("added p99", f"{HARNESS}: the client"))
            and not row.get("repeat"))


def summarize(rows: list[dict[str, Any]], limit_ms: float) -> dict[str, Any]:
    """The highest rate before the first rung that broke the rule, what broke it, and whether the figure is
    only a lower bound (the ladder ran out, the time bound hit, or the harness, not the gateway, gave out)."""
    best: float | None = None
    for row in rows:
        if row.get("superseded"):
            continue
        reason = row.get("time_bound") or stop_reason(row, limit_ms)
        if reason is not None:
            return {"max_rate": best, "stopped_at": row["rate"], "stopped_by": reason,
                    "lower_bound": reason.startswith(HARNESS) or bool(row.get("time_bound"))}
        best = row["rate"]
    return {"max_rate": best, "stopped_at": None, "stopped_by": "top of the ladder", "lower_bound": True}


def ratios(summaries: dict[str, dict[str, Any]], base: str = "cortex") -> dict[str, dict[str, Any]]:
    """base's highest rate over each other contestant's. `bound`: "=" when both figures are exact, "≥" or "≤"
    when one is a lower bound (the ratio is then a bound itself), "?" when both are, "<" when base broke the rule
    at its first rung (the ratio is below that rate over the other's figure)."""
    out: dict[str, dict[str, Any]] = {}
    if base not in summaries:
        return out
    b = summaries[base]
    for name, s in summaries.items():
        if name == base:
            continue
        x, y = b.get("max_rate"), s.get("max_rate")
        value = round(x / y, 2) if x and y else None
        lo_x, lo_y = b.get("lower_bound", True), s.get("lower_bound", True)
        # base's figure only a lower bound: the ratio is too; the other's only: the ratio is an upper bound.
        bound = None if value is None else "=" if not lo_x and not lo_y else "≥" if not lo_y else "≤" if not lo_x \
            else "?"
        if x is None and b.get("stopped_at") and y:
            # base broke the rule at the ladder's first rung: below that rate, whatever the other's figure.
            value, bound = round(b["stopped_at"] / y, 3), "<"
        out[f"{base}/{name}"] = {"value": value, "exact": bound == "=", "bound": bound}
    return out


# ---- running it ----

def warmup_count(rate: float) -> int:
    """Requests sent first at each rung and left out of its figures: a fresh client's first sends pay for its
    connections and a cold event loop (tens of ms here), on both paths alike, which is not the gateway's cost."""
    return max(5, round(rate * WARMUP_S))


def _workload(rate: float, plan: SaturationPlan, rung: int) -> Workload:
    n = max(plan.min_requests, min(plan.max_requests, round(rate * plan.rung_seconds)))
    return unique(requests=n + warmup_count(rate), rate=rate, seed=plan.seed * 1000 + rung,
                  prompt_words=PROMPT_WORDS, max_tokens=MAX_TOKENS)


def _send(workload: Workload, targets: list[str], workers: list[Worker], plan: SaturationPlan) -> RunResult:
    # No new request after 1.5 x the rung's planned span; a gateway that holds requests longer than 10 s past that
    # has long broken the limit, so the rest are cut and counted as errors.
    span = workload.sessions[-1].start
    return uvloop.run(client.run(workload, client.Routing(targets), workers, max_seconds=1.5 * span + 1.0,
                                 grace_s=10.0, sample_interval=1.0))


def _ttfts(result: RunResult, warmup: int) -> tuple[list[float], int]:
    """TTFTs of the measured requests; errors of all, warm-up included (an error is never noise)."""
    ok = [r.ttft for r in result.records if r.error is None and r.ttft is not None and r.session >= warmup]
    return ok, sum(r.error is not None for r in result.records)


def rung(rate: float, i: int, target: str, procs: Procs, workers: list[Worker], plan: SaturationPlan
         ) -> dict[str, Any]:
    workload = _workload(rate, plan, i)
    warmup = warmup_count(rate)
    scheduled = {s.id: s.start for s in workload.sessions if s.id >= warmup}
    direct = _send(workload, [w.url for w in workers], workers, plan)
    before = procs.cpu_seconds()
    via = _send(workload, [target], workers, plan)
    after = procs.cpu_seconds()
    via_ttft, errors = _ttfts(via, warmup)
    direct_ttft, direct_errors = _ttfts(direct, warmup)
    n = max(len(via.records), 1)
    parts = {k: round(1000.0 * (v - before.get(k, 0.0)) / n, 3) for k, v in after.items()}
    return {
        "rate": rate, "requests": len(workload.sessions), "warmup": warmup,
        "achieved_rps": round(len(via_ttft) / via.wall_s, 1) if via.wall_s > 0 else None,
        "direct_achieved_rps": round(len(direct_ttft) / direct.wall_s, 1) if direct.wall_s > 0 else None,
        **added(via_ttft, direct_ttft),
        "errors": errors, "direct_errors": direct_errors,
        "error_examples": sorted({r.error for r in via.records + direct.records if r.error})[:3],
        "send_lag_p90_ms": send_lag_ms(via.records, scheduled),
        "direct_send_lag_p90_ms": send_lag_ms(direct.records, scheduled),
        "gateway_cpu_ms_per_request": round(sum(parts.values()), 3),
        "gateway_cpu_ms_per_request_by_part": parts,
    }


def _fits(rate: float, plan: SaturationPlan, until: float) -> bool:
    """Whether a rung (both paths' arrivals, plus a drain each) can end before `until`."""
    n = max(plan.min_requests, min(plan.max_requests, round(rate * plan.rung_seconds))) + warmup_count(rate)
    return time.monotonic() + 2 * (n / rate + 2.0) <= until


def _log_row(name: str, row: dict[str, Any], reason: str | None, log: Callable[[str], None]) -> None:
    if "failed" in row:
        log(f"  {name} {row['rate']:g}/s: {row['failed']}")
        return
    log(f"  {name} {row['rate']:g}/s{' (again)' if row.get('repeat') else ''}: achieved {row['achieved_rps']}/s, "
        f"added p50/p99 {row['added_p50_ms']}/{row['added_p99_ms']} ms (via p99 {row['via_p99_ms']}, direct p99 "
        f"{row['direct_p99_ms']}), errors {row['errors']}, cpu {row['gateway_cpu_ms_per_request']} ms/req"
        + (f" -> stop: {reason}" if reason else ""))


def _ladder(c: Contestant, workers: list[Worker], root: Path, plan: SaturationPlan, until: float,
            log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with Procs(root) as procs:
        target = c.start(procs, workers, 1)[0]
        for i, rate in enumerate(plan.rates):
            # A rung sends twice for about rung_seconds each, plus the drain: do not start one that cannot end in time.
            if not _fits(rate, plan, until):
                rows.append({"rate": rate, "time_bound": f"time bound ({plan.max_seconds:g} s for the sweep)"})
                log(f"  {c.name}: {rate:g}/s not started: time bound")
                break
            try:
                row = rung(rate, i, target, procs, workers, plan)
            except Exception as exc:  # this rung's failure is the contestant's figure, not the sweep's end
                row = {"rate": rate, "failed": f"{type(exc).__name__}: {exc}"[:300],
                       "trace": traceback.format_exc()[-1500:]}
            rows.append(row)
            reason = stop_reason(row, plan.limit_ms)
            _log_row(c.name, row, reason, log)
            if reason is not None and should_confirm(row, plan.limit_ms) and _fits(rate, plan, until):
                # One late request on a shared machine decides a p99 of a few hundred: a breach counts only when
                # the same rung, sent again, breaks the rule too.
                row["superseded"] = True
                again = rung(rate, i, target, procs, workers, plan)
                again["repeat"] = True
                rows.append(again)
                reason = stop_reason(again, plan.limit_ms)
                _log_row(c.name, again, reason, log)
            if reason is not None:
                break
    return rows


def run(plan: SaturationPlan, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
        ) -> dict[str, Any]:
    from cortexbench.runner import run_head

    started = time.monotonic()
    spec = ClusterSpec(workers=plan.workers, engine=plan.engine, zero_compute=True)
    out: dict[str, Any] = {
        "mode": "saturation", **run_head(spec, compute="zero (no prefill or decode time)"),
        "params": {"rates": list(plan.rates), "rung_seconds": plan.rung_seconds, "min_requests": plan.min_requests,
                   "max_requests": plan.max_requests, "limit_ms": plan.limit_ms, "prompt_words": PROMPT_WORDS,
                   "max_tokens": MAX_TOKENS, "seed": plan.seed, "max_seconds": plan.max_seconds},
        "contestants": {c.name: c.what for c in plan.contestants}, "saturation": {},
    }
    with tempfile.TemporaryDirectory(prefix="cortex-saturation-") as tmp:
        root = plan.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        with Procs(root) as cluster:
            workers = start_workers(cluster, spec)
            for k, c in enumerate(plan.contestants):
                reason = c.unavailable()
                if reason is not None:
                    log(f"{c.name}: not available: {reason}")
                    out["saturation"][c.name] = {"unavailable": reason}
                    continue
                # Each contestant gets an equal share of what remains, so a slow first one cannot starve the rest.
                left = plan.max_seconds - (time.monotonic() - started)
                until = time.monotonic() + left / (len(plan.contestants) - k)
                log(f"{c.name}: ladder {', '.join(f'{r:g}' for r in plan.rates)} req/s")
                try:
                    rows = _ladder(c, workers, root, plan, until, log)
                except Exception as exc:  # a contestant that does not start must not lose the others' figures
                    log(f"{c.name}: FAILED: {exc}")
                    out["saturation"][c.name] = {"failed": f"{type(exc).__name__}: {exc}"[:500],
                                                 "trace": traceback.format_exc()[-1500:]}
                    continue
                summary = summarize(rows, plan.limit_ms)
                log(f"{c.name}: highest rate under {plan.limit_ms:g} ms added p99: {summary['max_rate']} req/s "
                    f"({summary['stopped_by']})")
                out["saturation"][c.name] = {"rows": rows, "summary": summary}
    out["ratios"] = ratios({n: b["summary"] for n, b in out["saturation"].items() if "summary" in b})
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    return out


# ---- the report ----

def markdown(out: dict[str, Any], command: str) -> str:
    c, p = out["cluster"], out["params"]
    limit = p["limit_ms"]
    parts = [f"Command: `{command}`\n",
             run_line(out) +
             f"{c['workers']} simulated {c['engine']} workers with zero compute time; each rung sends ~"
             f"{p['prompt_words']}-token cold chats ({p['max_tokens']} output tokens) for ~{_f(p['rung_seconds'])} s "
             f"(at least {p['min_requests']} requests), first straight to the workers, then through the "
             f"contestant, at the same Poisson arrival times. Added = the percentile through the contestant minus "
             f"the same percentile direct.\n"]
    lines = [f"| contestant | highest rate with added TTFT p99 ≤ {limit:g} ms (req/s) | stopped by |", "|---|---|---|"]
    for name, block in out["saturation"].items():
        if "summary" not in block:
            lines.append(f"| {name} | – | {block.get('unavailable') or block.get('failed', '')[:120]} |")
            continue
        s = block["summary"]
        figure = _f(s["max_rate"], 0) if s["max_rate"] is not None else f"< {_f(s['stopped_at'], 0)}"
        at = f" at {_f(s['stopped_at'], 0)}/s" if s["stopped_at"] else ""
        lines.append(f"| {name} | {'≥ ' if s['lower_bound'] and s['max_rate'] is not None else ''}{figure} | "
                     f"{s['stopped_by']}{at} |")
    parts.append("**Saturation**\n\n" + "\n".join(lines) + "\n")
    if out.get("ratios"):
        shown = {"=": "", "≥": "≥ ", "≤": "≤ ", "?": "~", "<": "< ", None: ""}
        parts.append("Ratios of the highest rates: " + "; ".join(
            f"{k} {shown[v.get('bound')]}{_f(v['value'], 2)}" + (
                "" if v.get("exact") or v["value"] is None else " (broke the limit at the first rung)"
                if v.get("bound") == "<" else " (a bound: one side did not saturate)")
            for k, v in out["ratios"].items()) + "\n")
    for name, block in out["saturation"].items():
        if "rows" not in block:
            continue
        rows = ["| offered req/s | achieved req/s | added p50 | added p99 | via p50 / p99 | direct p50 / p99 | "
                "errors | gateway CPU ms/req |", "|---|---|---|---|---|---|---|---|"]
        for r in block["rows"]:
            if "failed" in r or "time_bound" in r:
                rows.append(f"| {_f(r['rate'], 0)} | {r.get('failed') or r.get('time_bound')} |" + " |" * 6)
                continue
            mark = " (broke the limit; sent again)" if r.get("superseded") else " (again)" if r.get("repeat") else ""
            rows.append(f"| {_f(r['rate'], 0)}{mark} | {_f(r['achieved_rps'])} | {_f(r['added_p50_ms'])} | "
                        f"{_f(r['added_p99_ms'])} | {_f(r['via_p50_ms'])} / {_f(r['via_p99_ms'])} | "
                        f"{_f(r['direct_p50_ms'])} / {_f(r['direct_p99_ms'])} | {r['errors']}/{r['requests']} | "
                        f"{_f(r['gateway_cpu_ms_per_request'], 2)} |")
        parts.append(f"**{name}** (TTFT in ms)\n\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)
