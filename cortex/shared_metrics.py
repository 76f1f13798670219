"""The Prometheus series every process of a gateway writes to one directory (PROMETHEUS_MULTIPROC_DIR, set by
`cortex run`), read back as one registry: what ingest's and the observer's /metrics serve besides their own."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector


def shared_registry() -> CollectorRegistry | None:
    """The summed multi-process series, or None outside `cortex run` (no directory set)."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry
