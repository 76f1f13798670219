"""`cortex bench --noisy-neighbor`: one tenant floods while another sends steady traffic; does the steady tenant's
time to first token stay within 20 % of what it is alone?

Two simulated workers with real compute costs (a 25 ms engine step, prefill per prompt token, at most 4 running
requests each and a bounded engine queue), so a flood queues in the engines and slows every request there. Two
tenants, each with its own API key: `steady` (B) sends an open-loop Poisson stream of streamed chats well below the
fleet's capacity; `noisy` (A) starts after B's warm-up and sends an open-loop stream well above it. Per contestant,
started once, and per seed, B's stream is sent twice with the same prompts at the same arrival times: alone
(`solo`), then with A's flood (`flood`); the engines are drained and their caches emptied before each. B's TTFT
p50/p90 counts the requests B scheduled after its warm-up, i.e. those that met the flood. Bounded: every stream in
seconds, every run's drain in seconds, the whole benchmark in seconds.

Contestants (each one entry of CONTESTANTS): Cortex with a limit on A (`cortex`), the same gateway with none
(`cortex-no-limits`, the problem), Cortex with no limit but the waiting room and B in a higher priority band
(`cortex-priority`), SMG 1.13 cache_aware authenticating both tenants (no per-tenant limit on its HTTP router),
SMG with its global concurrency limit (`smg-global-limit`); `cortex-waiting-room` (A's limit and the room) when
named. The waiting room is set explicitly in every Cortex contestant, so each figure says what one mechanism does.
"""

from __future__ import annotations

import asyncio
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from cortexbench import client, metrics
from cortexbench.client import Record
from cortexbench.launch import (
    ClusterSpec,
    LaunchError,
    Procs,
    Worker,
    chat_ok,
    http,
    reset_caches,
    start_cortex,
    start_smg,
    start_workers,
)
from cortexbench.report import num as _f
from cortexbench.report import run_line
from cortexbench.workloads import Session, unique

STEADY, NOISY = "steady", "noisy"
# Benchmark-only keys: the gateways hold only what they need (Cortex their SHA-256 digests).
KEYS = {STEADY: "sk-bench-steady-tenant", NOISY: "sk-bench-noisy-tenant"}
GOAL = 0.20
"""B's TTFT p90 with A flooding may exceed its solo p90 by at most this share (issue 16)."""

# The engines: a 25 ms step (the decode interval), 0.1 ms per prompt token computed (a ~250-token prompt adds
# 25 ms to its step, as on a GPU where prefill of a short prompt costs about one decode step), 0.5 ms per running
# sequence, at most 4 running requests and 32 waiting per worker (beyond that the engine answers 503, as vLLM's
# --max-num-queued-reqs would). A request of 16 output tokens holds a running slot ~0.45 s: 2 workers x 4 slots
# serve ~17 requests/s.
SIM_ARGS = ("--prefill-ms-per-token", "0.1", "--decode-ms-per-token", "25", "--decode-ms-per-seq", "0.5",
            "--max-running", "4", "--max-queued-requests", "32")
MAX_RUNNING = 4
PROMPT_WORDS = 200
MAX_TOKENS = 16
NOISY_MAX_CONCURRENT = 2
"""Cortex's limit on A: a quarter of the fleet's 8 running slots, one per worker on average. B (mean concurrency
~1.4 at 3 req/s) then finds a free slot whenever it arrives, and each engine step B shares carries at most a
couple of A's sequences. Half the fleet (4) is measured too (`--noisy-max-concurrent 4`): B never queues there
either, but shares every step with more of A's work (docs/tenancy/noisy-neighbor.md)."""


@dataclass
class NoisyPlan:
    contestants: list[NoisyContestant]
    seeds: tuple[int, ...] = (1, 2, 3)
    steady_rate: float = 3.0
    noisy_rate: float = 40.0
    warmup_s: float = 2.0
    """B alone before A starts (its requests are left out of the figures)."""
    flood_s: float = 10.0
    """A floods this long; B goes on for as long."""
    noisy_max_concurrent: int = NOISY_MAX_CONCURRENT
    goal: float = GOAL
    max_seconds: float = 600.0
    drain_s: float = 30.0
    """After the streams end, requests still open this long are cut (counted as errors)."""
    workers: int = 2
    engine: str = "vllm"
    work_dir: Path | None = None


@dataclass(frozen=True)
class NoisyContestant:
    name: str
    what: str
    start: Callable[[Procs, list[Worker], NoisyPlan], str]
    """Start the gateway in front of the workers; return the URL both tenants send to."""
    module: str | None = None
    """Python module that must be importable (an optional install)."""
    limits: Callable[[NoisyPlan], str] = field(default=lambda plan: "none")
    """What limits A, in words, for the report."""

    def unavailable(self) -> str | None:
        import importlib.util

        if self.module is not None and importlib.util.find_spec(self.module) is None:
            return f"{self.module} is not installed (pip install 'cortex-gateway[bench]')"
        return None


# ---- the contestants ----

def cortex_config(noisy_limits: dict[str, Any] | None, waiting_room: bool, steady_priority: int = 0) -> dict[str, Any]:
    """Both tenants by API key (auth required); A's limits, if any; the waiting room on or off explicitly.

    With the waiting room, a worker counts as full at its engine's running limit (the high watermark's default,
    48, is sized for real engines' batches, these run 4) or with anything in its engine queue, so requests wait
    in Cortex, fair by tenant, instead of in the engines' FIFO queues."""
    from extproc.tenants import digest

    noisy: dict[str, Any] = {"id": NOISY, "api_keys": [digest(KEYS[NOISY])]}
    if noisy_limits:
        noisy["limits"] = noisy_limits
    cfg: dict[str, Any] = {"auth": {"required": True},
                           "tenants": [{"id": STEADY, "api_keys": [digest(KEYS[STEADY])], "priority": steady_priority},
                                       noisy],
                           "admission": {"waiting_room": {"enabled": waiting_room}}}
    if waiting_room:
        cfg["admission"]["waiting_room"]["queue_depth"] = 0
        cfg["scheduler"] = {"high_watermark": float(MAX_RUNNING), "low_watermark": float(MAX_RUNNING - 1)}
    return cfg


def _cortex(name: str, limited: bool, waiting_room: bool,
            steady_priority: int = 0) -> Callable[[Procs, list[Worker], NoisyPlan], str]:
    def start(procs: Procs, workers: list[Worker], plan: NoisyPlan) -> str:
        limits = {"max_concurrent": plan.noisy_max_concurrent} if limited else None
        return start_cortex(procs, workers, events=True, name=name,
                            extra_config=cortex_config(limits, waiting_room, steady_priority), api_key=KEYS[STEADY])
    return start


def _smg(name: str, extra: tuple[str, ...]) -> Callable[[Procs, list[Worker], NoisyPlan], str]:
    """SMG cache_aware as in `cortex bench` (launch.smg_argv), with both tenants' keys (`--tenant-api-key`: a request
    without one of them gets 401, as from Cortex with auth required)."""
    keys = tuple(a for t in (STEADY, NOISY) for a in ("--tenant-api-key", f"{t}:{KEYS[t]}"))

    def start(procs: Procs, workers: list[Worker], plan: NoisyPlan) -> str:
        return start_smg(procs, workers, 1, name=name, mesh=False, extra=(*keys, *extra), api_key=KEYS[STEADY])[0]
    return start


SMG_GLOBAL_LIMIT = ("--max-concurrent-requests", str(2 * MAX_RUNNING), "--queue-size", "64",
                    "--queue-timeout-secs", "30")
"""SMG's only limit that applies to HTTP workers: one token bucket for all callers, sized to the fleet's running
slots, with its FIFO queue (its per-tenant rate limiter is wired into the gRPC router only)."""

CONTESTANTS: dict[str, NoisyContestant] = {c.name: c for c in (
    NoisyContestant("cortex", "Cortex, both tenants by API key, A limited to `max_concurrent` requests in flight "
                    "(429 beyond), waiting room off", _cortex("cortex", limited=True, waiting_room=False),
                    limits=lambda plan: f"max_concurrent {plan.noisy_max_concurrent} (per tenant)"),
    NoisyContestant("cortex-no-limits", "the same Cortex, no limit on either tenant, waiting room off: the problem",
                    _cortex("cortex-no-limits", limited=False, waiting_room=False)),
    NoisyContestant("smg-cache-aware", "SMG 1.13 --policy cache_aware, defaults, both tenants by --tenant-api-key "
                    "(no per-tenant limit applies to HTTP workers)", _smg("smg-cache-aware", ()), module="smg"),
    NoisyContestant("smg-global-limit", "SMG 1.13 cache_aware with its global limit: " + " ".join(SMG_GLOBAL_LIMIT),
                    _smg("smg-global-limit", SMG_GLOBAL_LIMIT), module="smg",
                    limits=lambda plan: f"all callers: {SMG_GLOBAL_LIMIT[1]} concurrent + FIFO queue"),
    NoisyContestant("cortex-waiting-room", "Cortex with A's limit and the waiting room on (fair by tenant weight "
                    "when every worker is full)", _cortex("cortex-waiting-room", limited=True, waiting_room=True),
                    limits=lambda plan: f"max_concurrent {plan.noisy_max_concurrent} + waiting room"),
    NoisyContestant("cortex-priority", "Cortex, no limit on A; the waiting room on (a worker is full at its engine's "
                    "running limit) with B in a higher priority band, so B is released first",
                    _cortex("cortex-priority", limited=False, waiting_room=True, steady_priority=10),
                    limits=lambda plan: "none; B in priority band 10, A in 0 (waiting room)"),
)}
DEFAULT = ("cortex", "cortex-no-limits", "cortex-priority", "smg-cache-aware", "smg-global-limit")


# ---- the pure part: the streams, what a run measured, what the runs sum up to ----

def streams(plan: NoisyPlan, seed: int) -> tuple[tuple[Session, ...], tuple[Session, ...]]:
    """B's sessions over warm-up + flood, A's over the flood (its starts shifted past B's warm-up); Poisson
    arrivals, unique prompts (nothing to gain from a cache), each stream cut at its window's end."""
    span = plan.warmup_s + plan.flood_s

    def stream(tenant: str, rate: float, window: float, s: int, offset: float) -> tuple[Session, ...]:
        n = math.ceil(rate * window * 1.5) + 10  # more than the window can hold; cut below
        w = unique(requests=n, rate=rate, seed=s, prompt_words=PROMPT_WORDS, max_tokens=MAX_TOKENS)
        return tuple(Session(x.id, x.start + offset, f"{tenant} {x.system}", x.turns, x.max_tokens)
                     for x in w.sessions if x.start < window)

    return (stream(STEADY, plan.steady_rate, span, seed * 1000, 0.0),
            stream(NOISY, plan.noisy_rate, plan.flood_s, seed * 1000 + 1, plan.warmup_s))


def steady_figures(records: list[Record], starts: dict[int, float], warmup_s: float) -> dict[str, Any]:
    """B's requests scheduled after the warm-up: TTFT percentiles of those that completed, errors of all."""
    measured = [r for r in records if starts[r.session] >= warmup_s]
    ttfts = [r.ttft for r in measured if r.error is None and r.ttft is not None]
    p50, p90 = metrics.percentile(ttfts, 50), metrics.percentile(ttfts, 90)
    return {"sent": len(records), "measured": len(measured), "completed": len(ttfts),
            "errors": sum(r.error is not None for r in measured),
            "ttft_p50_ms": None if p50 is None else round(p50 * 1000, 1),
            "ttft_p90_ms": None if p90 is None else round(p90 * 1000, 1),
            "ttfts_ms": [round(t * 1000, 2) for t in ttfts]}


def noisy_figures(records: list[Record]) -> dict[str, Any]:
    """What happened to A's flood: admitted (answered), refused by the gateway's limit (429), refused or cut
    elsewhere (an engine's 503 past its queue, a gateway's queue timeout, the run's time bound)."""
    return {"sent": len(records), "admitted": sum(r.error is None for r in records),
            "refused_429": sum(r.status == 429 for r in records),
            "other_errors": sum(r.error is not None and r.status != 429 for r in records)}


def summarize(runs: list[dict[str, Any]], goal: float) -> dict[str, Any]:
    """B's TTFT p50/p90 alone and with A, pooled over the seeds (every measured request of every seed), the ratio
    of the p90s, each seed's ratio, A's counts summed, and whether the goal holds: p90 with A at most (1 + goal) x
    solo, and no request of B failed because of A."""
    def pooled(phase: str) -> list[float]:
        return [t for r in runs if r["phase"] == phase for t in r[STEADY]["ttfts_ms"]]

    solo, flood = pooled("solo"), pooled("flood")
    out: dict[str, Any] = {"seeds": sorted({r["seed"] for r in runs})}
    for phase, values in (("solo", solo), ("flood", flood)):
        for q in (50, 90):
            p = metrics.percentile(values, q)
            out[f"{phase}_p{q}_ms"] = None if p is None else round(p, 1)
        out[f"{phase}_n"] = len(values)
        out[f"{phase}_errors"] = sum(r[STEADY]["errors"] for r in runs if r["phase"] == phase)
    s, f = out["solo_p90_ms"], out["flood_p90_ms"]
    out["ratio_p90"] = round(f / s, 2) if s and f is not None else None
    by_seed: dict[int, dict[str, Any]] = {}
    for r in runs:
        by_seed.setdefault(r["seed"], {})[r["phase"]] = r[STEADY]["ttft_p90_ms"]
    out["seed_ratios_p90"] = [round(v["flood"] / v["solo"], 2) for v in by_seed.values()
                              if v.get("solo") and v.get("flood") is not None]
    floods = [r[NOISY] for r in runs if r["phase"] == "flood"]
    out["noisy"] = {k: sum(x[k] for x in floods) for k in ("sent", "admitted", "refused_429", "other_errors")}
    out["goal_met"] = (out["ratio_p90"] is not None and out["ratio_p90"] <= 1.0 + goal
                       and out["flood_errors"] == 0)
    return out


# ---- running it ----

async def _tenant(http_session: aiohttp.ClientSession, url: str, sessions: tuple[Session, ...], out: list[Record],
                  t0: float, until: float) -> list[asyncio.Task[str]]:
    tasks: list[asyncio.Task[str]] = []
    for s in sessions:
        delay = s.start - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        if time.monotonic() - t0 > until:
            break
        rec = Record(s.id, 0, 0.0)
        out.append(rec)
        tasks.append(asyncio.create_task(client.one(http_session, url, s.messages([], 0), s.max_tokens, rec, t0)))
    return tasks


async def _send(url: str, steady: tuple[Session, ...], noisy: tuple[Session, ...], workers: list[Worker],
                plan: NoisyPlan) -> tuple[list[Record], list[Record], list[dict[str, float]]]:
    """Both tenants' open-loop streams at once, each over its own connections with its own key; the peak engine
    load (running + waiting over the fleet, sampled every 0.25 s) shows whether the flood queued."""
    span = plan.warmup_s + plan.flood_s
    recs: dict[str, list[Record]] = {STEADY: [], NOISY: []}
    samples: list[dict[str, float]] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=span + plan.drain_s)
    sessions = {t: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                         headers={"authorization": f"Bearer {KEYS[t]}"}) for t in (STEADY, NOISY)}
    try:
        sampler = asyncio.create_task(client._sample_loads(sessions[STEADY], workers, samples, 0.25))
        t0 = time.monotonic()
        sent = await asyncio.gather(_tenant(sessions[STEADY], url, steady, recs[STEADY], t0, span + 1.0),
                                    _tenant(sessions[NOISY], url, noisy, recs[NOISY], t0, span + 1.0))
        tasks = [t for ts in sent for t in ts]
        left = max(span - (time.monotonic() - t0), 0.0) + plan.drain_s
        _, pending = await asyncio.wait(tasks, timeout=left) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    finally:
        for s in sessions.values():
            await s.close()
    for rec in (*recs[STEADY], *recs[NOISY]):
        if rec.e2e is None and rec.error is None:
            rec.error = "cancelled at the time bound"
    return recs[STEADY], recs[NOISY], samples


def _engine_load(w: Worker) -> float:
    status, text = http("GET", f"{w.url}/metrics")
    return client._load_of(text, w.engine) if status == 200 and isinstance(text, str) else math.inf


def wait_idle(workers: list[Worker], timeout: float = 60.0) -> None:
    """Until no engine runs or queues anything (a gateway may still be sending a cut run's last requests)."""
    deadline = time.monotonic() + timeout
    while any(_engine_load(w) > 0 for w in workers):
        if time.monotonic() > deadline:
            raise LaunchError(f"the engines still had work {timeout:.0f} s after the run")
        time.sleep(0.2)


def wait_serving(url: str, timeout: float = 90.0) -> float:
    """Seconds until a chat of B's passes through the gateway again. A flood can leave a gateway refusing everyone
    after it ends (SMG's circuit breakers open on the engines' 503s and stay open for a while); the next run
    starts only once it serves, and the wait is reported."""
    started = time.monotonic()
    while not chat_ok(url, KEYS[STEADY]):
        if time.monotonic() - started > timeout:
            raise LaunchError(f"the gateway did not serve a request for {timeout:.0f} s after the previous run")
        time.sleep(0.5)
    return round(time.monotonic() - started, 1)


def run_once(url: str, workers: list[Worker], plan: NoisyPlan, seed: int, phase: str) -> dict[str, Any]:
    steady, noisy = streams(plan, seed)
    recovery = wait_serving(url)
    wait_idle(workers)
    reset_caches(workers)  # B's prompts are the same in both phases: neither may find the other's cache
    b, a, samples = uvloop.run(_send(url, steady, noisy if phase == "flood" else (), workers, plan))
    starts = {s.id: s.start for s in steady}
    peak = max((sum(x.values()) for x in samples), default=0.0)
    # B's errors of every kind (a 429 to B is a finding); A's 429s are the limit working, not an example.
    errors = sorted({r.error for r in (*b, *(x for x in a if x.status != 429)) if r.error})
    return {"seed": seed, "phase": phase, STEADY: steady_figures(b, starts, plan.warmup_s),
            NOISY: noisy_figures(a), "engine_load_peak": peak, "gateway_recovery_s": recovery,
            "error_examples": [e[:160] for e in errors[:3]],
            # For reading a slow request after the fact: where each of B's went and what every engine held.
            "steady_requests": [[round(starts[r.session], 3), round(r.sent, 3), None if r.ttft is None else
                                 round(r.ttft * 1000, 1), r.worker, r.status] for r in b],
            "engine_load_samples": [[round(x.get(w.id, -1.0)) for w in workers] for x in samples]}


def _run_seconds(plan: NoisyPlan) -> float:
    """A generous guess at one run's length (streams, drain of what the engines hold, the idle wait)."""
    return plan.warmup_s + plan.flood_s + 10.0


def _log_run(name: str, r: dict[str, Any], log: Callable[[str], None]) -> None:
    b, a = r[STEADY], r[NOISY]
    log(f"  {name} seed {r['seed']} {r['phase']}: B TTFT p50/p90 {b['ttft_p50_ms']}/{b['ttft_p90_ms']} ms "
        f"({b['completed']}/{b['measured']}, errors {b['errors']}); A sent {a['sent']}, admitted {a['admitted']}, "
        f"429 {a['refused_429']}, other errors {a['other_errors']}; engine load peak {r['engine_load_peak']:g}"
        + (f"; waited {r['gateway_recovery_s']:g} s for the gateway to serve again" if r['gateway_recovery_s'] >= 1
           else ""))


def _contestant(c: NoisyContestant, workers: list[Worker], root: Path, plan: NoisyPlan, until: float,
                log: Callable[[str], None]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    cut = None
    with Procs(root) as procs:
        url = c.start(procs, workers, plan)
        for seed in plan.seeds:
            # Solo then flood, per seed: the pair is measured close together, under the same machine load.
            if time.monotonic() + 2 * _run_seconds(plan) > until:
                cut = f"time bound ({plan.max_seconds:g} s): seeds from {seed} not run"
                log(f"  {c.name}: {cut}")
                break
            for phase in ("solo", "flood"):
                r = run_once(url, workers, plan, seed, phase)
                _log_run(c.name, r, log)
                runs.append(r)
    block: dict[str, Any] = {"what": c.what, "limits": c.limits(plan), "runs": runs,
                             "summary": summarize(runs, plan.goal) if runs else None}
    if cut:
        block["time_bound"] = cut
    return block


def run(plan: NoisyPlan, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
        ) -> dict[str, Any]:
    from cortexbench.runner import run_head

    started = time.monotonic()
    spec = ClusterSpec(workers=plan.workers, engine=plan.engine, sim_extra=SIM_ARGS)
    out: dict[str, Any] = {
        "mode": "noisy-neighbor", **run_head(spec, sim_args=list(SIM_ARGS)),
        "params": {"seeds": list(plan.seeds), "steady_rate": plan.steady_rate, "noisy_rate": plan.noisy_rate,
                   "warmup_s": plan.warmup_s, "flood_s": plan.flood_s, "prompt_words": PROMPT_WORDS,
                   "max_tokens": MAX_TOKENS, "noisy_max_concurrent": plan.noisy_max_concurrent, "goal": plan.goal,
                   "max_seconds": plan.max_seconds},
        "contestants": {c.name: c.what for c in plan.contestants}, "noisy": {},
    }
    with tempfile.TemporaryDirectory(prefix="cortex-noisy-") as tmp:
        root = plan.work_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        with Procs(root) as cluster:
            workers = start_workers(cluster, spec)
            for k, c in enumerate(plan.contestants):
                reason = c.unavailable()
                if reason is not None:
                    log(f"{c.name}: not available: {reason}")
                    out["noisy"][c.name] = {"what": c.what, "unavailable": reason}
                    continue
                # An equal share of what remains, so a slow first contestant cannot starve the rest.
                left = plan.max_seconds - (time.monotonic() - started)
                until = time.monotonic() + left / (len(plan.contestants) - k)
                log(f"{c.name}: seeds {', '.join(map(str, plan.seeds))}")
                try:
                    out["noisy"][c.name] = _contestant(c, workers, root, plan, until, log)
                except Exception as exc:  # one contestant failing must not lose the others' figures
                    log(f"{c.name}: FAILED: {exc}")
                    out["noisy"][c.name] = {"what": c.what, "failed": f"{type(exc).__name__}: {exc}"[:500],
                                            "trace": traceback.format_exc()[-1500:]}
                    continue
                s = out["noisy"][c.name]["summary"]
                if s:
                    log(f"{c.name}: B TTFT p90 solo {s['solo_p90_ms']} ms, with A {s['flood_p90_ms']} ms, ratio "
                        f"{s['ratio_p90']}: goal {'met' if s['goal_met'] else 'NOT met'}")
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    return out


# ---- the report ----

def markdown(out: dict[str, Any], command: str) -> str:
    c, p = out["cluster"], out["params"]
    goal = p["goal"]
    parts = [f"Command: `{command}`\n",
             run_line(out) +
             f"{c['workers']} simulated {c['engine']} workers (`{' '.join(c['sim_args'])}`). Tenant B (steady): "
             f"{_f(p['steady_rate'])} req/s for {_f(p['warmup_s'] + p['flood_s'])} s, the first {_f(p['warmup_s'])} s "
             f"left out; tenant A (noisy): {_f(p['noisy_rate'])} req/s for {_f(p['flood_s'])} s from then; ~"
             f"{p['prompt_words']}-word unique prompts, {p['max_tokens']} output tokens, streamed, each tenant "
             f"with its own API key. Seeds {', '.join(map(str, p['seeds']))}; B's TTFT pooled over them. Goal: "
             f"B's p90 with A ≤ {1 + goal:.2f} × solo, and no request of B failed.\n"]
    lines = ["| contestant | A limited by | B TTFT p50 / p90 solo (ms) | B TTFT p50 / p90 with A (ms) | p90 ratio "
             "(per seed) | B errors with A | A sent / admitted / 429 / other errors | goal (≤ "
             f"+{goal * 100:.0f} %) |", "|---|---|---|---|---|---|---|---|"]
    for name, block in out["noisy"].items():
        s = block.get("summary")
        if not s:
            why = block.get("unavailable") or block.get("failed") or block.get("time_bound") or "no run"
            lines.append(f"| {name} | – | {why[:120]} |" + " |" * 5)
            continue
        a = s["noisy"]
        seeds = ", ".join(_f(x, 2) for x in s["seed_ratios_p90"])
        verdict = ("met" if s["goal_met"] else "**not met**" + (
            f" (+{(s['ratio_p90'] - 1) * 100:.0f} %)" if s["ratio_p90"] is not None else ""))
        lines.append(f"| {name} | {block.get('limits', 'none')} | {_f(s['solo_p50_ms'])} / {_f(s['solo_p90_ms'])} | "
                     f"{_f(s['flood_p50_ms'])} / {_f(s['flood_p90_ms'])} | {_f(s['ratio_p90'], 2)} ({seeds}) | "
                     f"{s['flood_errors']}/{s['flood_n'] + s['flood_errors']} | {a['sent']} / {a['admitted']} / "
                     f"{a['refused_429']} / {a['other_errors']} | {verdict} |")
    parts.append("**Noisy neighbour**\n\n" + "\n".join(lines) + "\n")
    rows = ["| contestant | seed | phase | B TTFT p50 / p90 (ms) | B completed / measured | A admitted / 429 / other "
            "| engine load peak | gateway serving again after (s) |", "|---|---|---|---|---|---|---|---|"]
    for name, block in out["noisy"].items():
        for r in block.get("runs", ()):
            b, a = r[STEADY], r[NOISY]
            rows.append(f"| {name} | {r['seed']} | {r['phase']} | {_f(b['ttft_p50_ms'])} / {_f(b['ttft_p90_ms'])} | "
                        f"{b['completed']} / {b['measured']} | {a['admitted']} / {a['refused_429']} / "
                        f"{a['other_errors']} | {_f(r['engine_load_peak'], 0)} | {_f(r.get('gateway_recovery_s'))} |")
    parts.append("Every run (engine load peak: running + waiting requests over the fleet, sampled every 0.25 s; the "
                 f"fleet runs {c['workers'] * MAX_RUNNING} at once. Before each run the harness waits until a chat "
                 "passes through the gateway again, then until the engines are idle)\n\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)
