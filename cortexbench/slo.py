"""The service-level objectives `cortex bench --goodput` judges a run by, and whether a run met them.

A request meets the **TTFT SLO** in one of two forms:

* **fixed** (`TtftSlo(ms=X)`): its time to first token is at most X ms, whatever its prompt (DistServe's form,
  one SLO per application). Right when the prompts are of one size class, as in the synthetic workloads.
* **relative** (`TtftSlo(slowdown=X)`): its TTFT is at most X times its **solo time**, the time to first token the
  request would have alone on an idle worker of the fleet with nothing of its prompt cached (the form of SLO
  Etalon/Metron derive from a profiled prefill-time curve, and that the brief of issue 24 attributes to
  Mooncake's arXiv version; see docs/benchmarks.md, "Goodput"). Right for real traces, whose prompts run from
  a few hundred tokens to 130 000: a fixed SLO is then either unreachable for the longest prompts (a cold
  40 000-token prefill takes longer than 2 s) or meaningless for the short ones, while the relative one asks
  the same of every request: not to wait more than X - 1 times its own prefill for the work queued ahead of it.

The solo time comes from a **solo curve**, prompt tokens -> milliseconds. For the benchmark's simulated workers it
is their own timing model (`simulated_solo_ms`: cortexsim/timing.py, `TimingModel.cold_prefill_seconds`, the
prefill of a lone request in chunks of the step budget, with its linear, attention and KV-read terms), so the SLO
names its source and moves with the simulator's constants. For a real fleet the curve has to be measured: one
request at a time on an idle worker, cold, at a few prompt lengths, interpolated (as Etalon's prefill profiler
does); the benchmark does not do that.

The **ITL SLO** is fixed (milliseconds between tokens): decode speed does not depend on the prompt's length to
first order. A run **passes** when at least `percentile` % of the requests sent meet each SLO, a failed request
missing both (DistServe's SLO attainment, checked by the nearest rank: `nearest_rank(v, q) <= slo` exactly when at
least q % of v meet it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from cortexsim.timing import TimingModel

SLO_TTFT_MS = 2000.0
"""Fixed TTFT SLO: 2 s, the upper end of DistServe's chatbot SLOs; the synthetic workloads' prompts (at most
~6 300 tokens) take at most ~0.35 s to prefill cold in the simulator's timing model."""
SLO_TTFT_SLOWDOWN = 5.0
"""Relative TTFT SLO: 5 x the request's solo time, so a request may wait up to four times its own cold prefill
for what is queued ahead of it (a 1 000-token prompt ~0.3 s, a 60 000-token one ~24 s)."""
SLO_ITL_MS = 100.0
"""ITL SLO: 100 ms between tokens (10 tokens a second, faster than reading; DistServe's chatbot TPOT SLO, and
Mooncake's tightest TBT); the simulator's decode step is 7 ms, a step carrying a long prefill chunk ~400 ms."""
PERCENTILE = 90.0
RELATIVE_WORKLOADS = frozenset({"trace"})
"""Workloads whose default TTFT SLO is relative: the traces, whose prompt lengths span two to three orders of
magnitude. The synthetic workloads keep the fixed one (each sends prompts of one size class, so both forms ask the
same, and milliseconds read more plainly)."""

SoloCurve = Callable[[int], float]
"""Prompt tokens -> the request's solo time to first token, in ms."""


@dataclass(frozen=True, slots=True)
class TtftSlo:
    """One of `ms` (fixed) or `slowdown` (relative to the solo curve) is set."""

    ms: float | None = None
    slowdown: float | None = None

    def __post_init__(self) -> None:
        if (self.ms is None) == (self.slowdown is None):
            raise ValueError("a TTFT SLO is either fixed (ms) or relative (slowdown), not both or neither")
        if self.ms is not None and not (self.ms > 0 and math.isfinite(self.ms)):
            raise ValueError(f"the fixed TTFT SLO is a positive number of ms, not {self.ms!r}")
        if self.slowdown is not None and not (self.slowdown >= 1 and math.isfinite(self.slowdown)):
            raise ValueError(f"the TTFT slowdown SLO is a finite multiple >= 1 of the solo time, not {self.slowdown!r}")

    @property
    def relative(self) -> bool:
        return self.slowdown is not None

    def as_json(self) -> dict[str, Any]:
        if self.slowdown is None:
            return {"ms": self.ms}
        return {"slowdown": self.slowdown, "solo": SOLO_SOURCE}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TtftSlo:
        return cls(slowdown=doc["slowdown"]) if doc.get("slowdown") is not None else cls(ms=doc["ms"])

    def describe(self) -> str:
        if self.slowdown is None:
            return f"TTFT ≤ {self.ms:g} ms"
        return f"TTFT ≤ {self.slowdown:g} × the request's solo time"


def default_ttft(workload: str) -> TtftSlo:
    """The TTFT SLO a workload is judged by when none is given: relative for the traces, fixed for the others."""
    return TtftSlo(slowdown=SLO_TTFT_SLOWDOWN) if workload in RELATIVE_WORKLOADS else TtftSlo(ms=SLO_TTFT_MS)


SOLO_SOURCE = "cortexsim/timing.py: TimingModel.cold_prefill_seconds, the simulated workers' default timing"


def simulated_solo_ms(timing: TimingModel | None = None) -> SoloCurve:
    """The solo curve of the benchmark's simulated workers: a lone cold prefill of n prompt tokens in their timing
    model (their defaults unless `timing` is given), in ms. Raises ValueError for a model in which prefill costs
    nothing (zero-compute workers), against which no relative SLO means anything."""
    model = timing or TimingModel()
    if model.cold_prefill_seconds(1) <= 0:
        raise ValueError("a relative TTFT SLO needs workers whose prefill takes time (not zero-compute ones)")

    @functools.lru_cache(maxsize=65536)
    def solo_ms(prompt_tokens: int) -> float:
        return 1000.0 * model.cold_prefill_seconds(max(int(prompt_tokens), 1))

    return solo_ms


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The smallest value with at least q % of `values` at or below it (of ten values, p90 is the ninth); None
    for none. So `nearest_rank(v, q) <= slo` exactly when at least q % of v meet the SLO."""
    s = sorted(values)
    if not s:
        return None
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s) / 100.0) - 1))]


def ttft_slowdowns(records: list[dict[str, Any]], solo_ms: SoloCurve) -> list[float]:
    """Each request's TTFT over its solo time (its prompt as the worker counted it, chat template included); a
    failed or unanswered request is infinitely slow."""
    return [math.inf if r["error"] is not None or r["ttft_ms"] is None or not r.get("prompt_tokens")
            else r["ttft_ms"] / solo_ms(r["prompt_tokens"]) for r in records]


def _shown(v: float | None, digits: int = 1) -> float | None:
    return None if v is None or math.isinf(v) else round(v, digits)


def verdict(records: list[dict[str, Any]], ttft: TtftSlo, itl_ms: float, percentile: float = PERCENTILE,
            solo_ms: SoloCurve | None = None) -> dict[str, Any]:
    """Did a run meet both SLOs? `records` as `metrics.records_json` gives them; `solo_ms` is needed for a
    relative TTFT SLO. The TTFT percentile is over every request sent, a failed one infinitely late (for a
    relative SLO, that of each request's TTFT over its solo time: `ttft_slowdown`; `ttft_ms` is then the plain
    TTFT percentile, shown for reference); the ITL percentile over the requests that streamed two tokens or more,
    and the failed ones (infinitely slow). Both must be within their SLOs: at least `percentile` % of the requests
    met each. A run with no request fails."""
    inf = math.inf
    ttft_values = [r["ttft_ms"] if r["error"] is None and r["ttft_ms"] is not None else inf for r in records]
    itl = [inf if r["error"] is not None else r["itl_ms"] for r in records
           if r["error"] is not None or r.get("itl_ms") is not None]
    t, i = nearest_rank(ttft_values, percentile), nearest_rank(itl, percentile)
    out: dict[str, Any] = {}
    if ttft.slowdown is None:
        assert ttft.ms is not None
        ttft_ok = t is not None and t <= ttft.ms
        within = [x <= ttft.ms for x in ttft_values]
    else:
        if solo_ms is None:
            raise ValueError("a relative TTFT SLO needs the solo curve (solo_ms)")
        ratios = ttft_slowdowns(records, solo_ms)
        slow = nearest_rank(ratios, percentile)
        ttft_ok = slow is not None and slow <= ttft.slowdown
        within = [x <= ttft.slowdown for x in ratios]
        out["ttft_slowdown"] = _shown(slow, 2)
    ok = bool(records) and ttft_ok and (i is None or i <= itl_ms)
    return {"ok": ok, "ttft_ms": _shown(t), **out, "itl_ms": _shown(i), "requests": len(records),
            "errors": sum(r["error"] is not None for r in records),
            "ttft_within_slo": round(sum(within) / len(within), 3) if within else None}
