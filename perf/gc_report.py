"""Full garbage collections (generation 2) of a Cortex process between two /metrics scrapes, for the perf scripts:
how many, their mean, and the bucket the longest fell in (cortex/gc_pauses.py exports the histogram)."""

from __future__ import annotations

import re


def full_collections(text: str, process: str) -> dict[str, float]:
    """`process` (ingest or extproc)'s generation-2 series from a /metrics body: count, sum, cumulative buckets."""
    out: dict[str, float] = {}
    pat = re.compile(rf'cortex_{process}_gc_pause_seconds_(count|sum|bucket)'
                     rf'\{{generation="2"(?:,le="([^"]+)")?\}} (\S+)')
    for m in pat.finditer(text):
        out[m[2] if m[1] == "bucket" else m[1]] = float(m[3])
    return out


def summary(before: dict[str, float], after: dict[str, float]) -> str:
    """'n full collections, mean x ms, longest <= y ms' over the window between the two scrapes."""
    n = after.get("count", 0.0) - before.get("count", 0.0)
    if n <= 0:
        return "no full collection"
    mean_ms = (after.get("sum", 0.0) - before.get("sum", 0.0)) / n * 1000
    bounds = sorted((float(k), after[k] - before.get(k, 0.0)) for k in after if k not in ("count", "sum"))
    longest = next((b for b, cum in bounds if cum >= n), float("inf"))
    return f"{n:.0f} full collections, mean {mean_ms:.1f} ms, longest <= {longest * 1000:g} ms"
