"""The figures reported per contestant and workload, computed from the client's records.

* hit ratio: sum of the cached tokens the workers reported (`usage.prompt_tokens_details.cached_tokens`) over
  the sum of prompt tokens, across completed requests that went through the contestant (with --bypass, the
  sessions sent straight to a worker are reported apart, as `bypass_hit_ratio`);
* TTFT and end-to-end latency percentiles (completed requests), in milliseconds;
* ITL (inter-token latency) percentiles across completed requests of each request's mean gap between its
  content chunks after the first (requests with fewer than two chunks have none), in milliseconds;
* completed requests per second of the run's wall time (first send to last completion);
* errors: requests that failed, were cut, or lacked a token or usage;
* load imbalance: each worker's running + waiting count (from its own metrics, sampled every 0.25 s) averaged
  over the run; then the busiest worker's average over the mean of all (1.0 is perfectly even; 4.0 on four
  workers means one worker had it all);
* gateway overhead: median and p90 of TTFT through the gateway minus TTFT straight to the worker it chose,
  at light load (one request at a time, cold prompts of equal length), for a short and a long prompt (a
  gateway that tokenizes and hashes the prompt pays per token);
* send lag (open loop): how late each session's first request left the client after its arrival time, p50 / p99
  / max in ms: a client that cannot keep the workload's rate (a trace replayed faster than this machine builds
  and sends its prompts) shows here, and the report flags it;
* gateway CPU: CPU time (user + system) of the contestant's processes during the run, per request sent (0 for
  round-robin, which has none). On this machine the gateway shares the cores with the simulated workers, so
  a gateway's CPU also slows the simulators' clocks.
"""

from __future__ import annotations

from typing import Any

from cortexbench.client import Record, RunResult


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100.0 * len(s) + 0.5) - 1))
    return s[k]


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 1)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": _ms(percentile(values, q)) for q in (50, 90, 99)}


def _hit(records: list[Record]) -> float | None:
    prompt = sum(r.prompt_tokens for r in records)
    return round(sum(r.cached_tokens for r in records) / prompt, 4) if prompt else None


def summarize(result: RunResult) -> dict[str, Any]:
    finished = [r for r in result.records if r.error is None and r.ttft is not None and r.e2e is not None]
    bypassed = [r for r in finished if r.bypass]
    done = [r for r in finished if not r.bypass]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    ttft = [r.ttft for r in done if r.ttft is not None]
    e2e = [r.e2e for r in done if r.e2e is not None]
    itl = [r.itl for r in done if r.itl is not None]
    imbalance = None
    if result.load_samples:
        ids = list(result.load_samples[0])
        avg = [sum(s.get(i, 0.0) for s in result.load_samples) / len(result.load_samples) for i in ids]
        mean = sum(avg) / len(avg)
        imbalance = round(max(avg) / mean, 2) if mean > 0 else None
    per_worker: dict[str, int] = {}
    for r in done:
        per_worker[r.worker or "?"] = per_worker.get(r.worker or "?", 0) + 1
    routed = [r for r in result.records if not r.bypass]
    lag = [r.lag for r in result.records if r.lag is not None]
    extra: dict[str, Any] = {}
    if bypassed or len(routed) < len(result.records):
        extra = {"bypass_requests": len(result.records) - len(routed), "bypass_hit_ratio": _hit(bypassed)}
    return {
        **extra,
        "requests": len(routed), "completed": len(done), "errors": len(routed) - len(done),
        "error_examples": sorted({r.error for r in result.records if r.error})[:3],
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_ratio": round(cached / prompt, 4) if prompt else None,
        "ttft_ms": _percentiles(ttft),
        "e2e_ms": _percentiles(e2e),
        "itl_ms": _percentiles(itl),
        "rps": round(len(done) / result.wall_s, 2) if result.wall_s > 0 else None,
        "wall_s": round(result.wall_s, 1),
        "imbalance": imbalance,
        "per_worker": dict(sorted(per_worker.items())),
        **({"send_lag_ms": {"p50": _ms(percentile(lag, 50)), "p99": _ms(percentile(lag, 99)), "max": _ms(max(lag))}}
           if lag else {}),
    }


# The figures a multi-seed cell reports as a mean with its spread (half the range over seeds).
_SPREAD_KEYS = ("hit_ratio", "ttft_ms.p50", "ttft_ms.p90", "ttft_ms.p99", "e2e_ms.p50", "e2e_ms.p90",
                "itl_ms.p50", "itl_ms.p90", "gateway_cpu_ms_per_request", "imbalance", "rps")


def _get(d: dict[str, Any], dotted: str) -> Any:
    for k in dotted.split("."):
        d = d.get(k) if isinstance(d, dict) else None  # type: ignore[assignment]
    return d


def combine(per_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One cell over several seeds: the mean of each figure, its spread (half the range: a difference between
    two contestants is a win only when it exceeds both spreads together), counts summed, and every seed's own
    summary under `seeds`. One seed: that summary unchanged, with zero spreads."""
    ok = {s: r for s, r in per_seed.items() if "unavailable" not in r and "failed" not in r}
    if not ok:
        return next(iter(per_seed.values()))
    if len(per_seed) == 1:
        (only,) = ok.values()
        return {**only, "spread": dict.fromkeys(_SPREAD_KEYS, 0.0)}
    base = dict(next(iter(ok.values())))
    spread: dict[str, float | None] = {}
    for key in _SPREAD_KEYS:
        values = [v for v in (_get(r, key) for r in ok.values()) if isinstance(v, int | float)]
        mean = round(sum(values) / len(values), 4) if values else None
        spread[key] = round((max(values) - min(values)) / 2, 4) if values else None
        head, _, leaf = key.partition(".")
        if head not in base:
            continue  # a figure these summaries do not have (ITL in a run saved before it was measured)
        if leaf:
            base[head] = {**base[head], leaf: mean}
        else:
            base[head] = mean
    for key in ("requests", "completed", "errors", "prompt_tokens", "cached_tokens"):
        base[key] = sum(r[key] for r in ok.values())
    base["error_examples"] = sorted({e for r in ok.values() for e in r.get("error_examples", [])})[:3]
    base.pop("records", None)
    base["spread"] = spread
    base["seeds"] = {str(s): r for s, r in per_seed.items()}
    if len(ok) < len(per_seed):
        base["failed_seeds"] = sorted(str(s) for s in per_seed if s not in ok)
    return base


def overhead(pairs: list[tuple[float, float]], words: int) -> dict[str, Any]:
    diffs = [via - direct for via, direct in pairs]
    return {"prompt_words": words, "pairs": len(pairs), "p50_ms": _ms(percentile(diffs, 50)),
            "p90_ms": _ms(percentile(diffs, 90)), "via_p50_ms": _ms(percentile([p[0] for p in pairs], 50)),
            "direct_p50_ms": _ms(percentile([p[1] for p in pairs], 50))}


def records_json(records: list[Record]) -> list[dict[str, Any]]:
    return [{"session": r.session, "turn": r.turn, "sent_s": round(r.sent, 3), "ttft_ms": _ms(r.ttft),
             "e2e_ms": _ms(r.e2e), "itl_ms": None if r.itl is None else round(r.itl * 1000.0, 2),
             **({} if r.lag is None else {"lag_ms": _ms(r.lag)}),
             "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
             "worker": r.worker, "status": r.status, "error": r.error} for r in records]
