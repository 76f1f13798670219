"""The Prometheus series every process of a gateway writes to one directory (PROMETHEUS_MULTIPROC_DIR, set by
`cortex run`), read back as one registry: what ingest's and the observer's /metrics serve besides their own; and the
shape a histogram kept by hand (outside prometheus_client's locks) is exported in."""

from __future__ import annotations

import os
from collections.abc import Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector


def shared_registry() -> CollectorRegistry | None:
    """The summed multi-process series, or None outside `cortex run` (no directory set)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry


def cumulative_buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (one per bound, then +Inf) as the cumulative (le, count) pairs Prometheus takes."""
    out, total = [], 0
    for bound, n in zip((*(str(b) for b in bounds), "+Inf"), counts, strict=True):
        total += n
        out.append((bound, float(total)))
    return out
