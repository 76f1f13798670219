"""The figures reported per contestant and workload, computed from the client's records.

* hit ratio: sum of the cached tokens the workers reported (`usage.prompt_tokens_details.cached_tokens`) over
  the sum of prompt tokens, across completed requests;
* TTFT and end-to-end latency percentiles (completed requests), in milliseconds;
* completed requests per second of the run's wall time (first send to last completion);
* errors: requests that failed, were cut, or lacked a token or usage;
* load imbalance: each worker's running + waiting count (from its own metrics, sampled every 0.25 s) averaged
  over the run; then the busiest worker's average over the mean of all (1.0 is perfectly even; 4.0 on four
  workers means one worker had it all);
* gateway overhead: median and p90 of TTFT through the gateway minus TTFT straight to the worker it chose,
  at light load (one request at a time, cold prompts of equal length), for a short and a long prompt (a
  gateway that tokenizes and hashes the prompt pays per token);
* gateway CPU: CPU time (user + system) of the contestant's processes during the run, per request sent (0 for
  round-robin, which has none). On this machine the gateway shares the cores with the simulated workers, so
  a gateway's CPU also slows the simulators' clocks.
"""

from __future__ import annotations

from typing import Any

from cortex.bench.client import Record, RunResult


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


def summarize(result: RunResult) -> dict[str, Any]:
    done = [r for r in result.records if r.error is None and r.ttft is not None and r.e2e is not None]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    ttft = [r.ttft for r in done if r.ttft is not None]
    e2e = [r.e2e for r in done if r.e2e is not None]
    imbalance = None
    if result.load_samples:
        ids = list(result.load_samples[0])
        avg = [sum(s.get(i, 0.0) for s in result.load_samples) / len(result.load_samples) for i in ids]
        mean = sum(avg) / len(avg)
        imbalance = round(max(avg) / mean, 2) if mean > 0 else None
    per_worker: dict[str, int] = {}
    for r in done:
        per_worker[r.worker or "?"] = per_worker.get(r.worker or "?", 0) + 1
    return {
        "requests": len(result.records), "completed": len(done), "errors": len(result.records) - len(done),
        "error_examples": sorted({r.error for r in result.records if r.error})[:3],
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_ratio": round(cached / prompt, 4) if prompt else None,
        "ttft_ms": _percentiles(ttft),
        "e2e_ms": _percentiles(e2e),
        "rps": round(len(done) / result.wall_s, 2) if result.wall_s > 0 else None,
        "wall_s": round(result.wall_s, 1),
        "imbalance": imbalance,
        "per_worker": dict(sorted(per_worker.items())),
    }


def overhead(pairs: list[tuple[float, float]], words: int) -> dict[str, Any]:
    diffs = [via - direct for via, direct in pairs]
    return {"prompt_words": words, "pairs": len(pairs), "p50_ms": _ms(percentile(diffs, 50)),
            "p90_ms": _ms(percentile(diffs, 90)), "via_p50_ms": _ms(percentile([p[0] for p in pairs], 50)),
            "direct_p50_ms": _ms(percentile([p[1] for p in pairs], 50))}


def records_json(records: list[Record]) -> list[dict[str, Any]]:
    return [{"session": r.session, "turn": r.turn, "sent_s": round(r.sent, 3), "ttft_ms": _ms(r.ttft),
             "e2e_ms": _ms(r.e2e), "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
             "worker": r.worker, "status": r.status, "error": r.error} for r in records]
