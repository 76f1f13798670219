"""gRPC's C-core settings for Cortex's processes, fixed before any of them first imports grpc.

grpcio (1.85) moves every message of a stream between its EventEngine threads, its completion-queue poller
thread and the asyncio loop. On extproc's per-request stream (three messages each way, docs/performance.md
"The floor") that hand-off is most of the cost: turning the EventEngine listener, endpoints and callback queue
off (grpcio's own experiment switches, read once from `GRPC_EXPERIMENTS` when grpc initialises) cut a do-nothing
ext_proc server's CPU per request by 10-30 % (`perf/extproc_floor.py`) and extproc's in a gateway by 7-12 %
(`perf/grpc_runtime_ab.py`), with the same answers (docs/performance.md, "gRPC's I/O path"). A `GRPC_EXPERIMENTS`
the operator set, even empty, is kept.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

ENV = "GRPC_EXPERIMENTS"
LEGACY_IO = "-event_engine_listener,-event_engine_for_all_other_endpoints,-event_engine_callback_cq"
"""The experiments switched off. grpc logs "Unknown experiment" once at start for a name it no longer has and
goes on with its default, so a grpcio that dropped one still runs (with the default's cost)."""


def configure(environ: MutableMapping[str, str] | None = None) -> bool:
    """Sets Cortex's default unless the operator chose; True when the process's grpc will run with it. Must run
    before grpc is imported here: the C core reads the variable once, at its first initialisation. The children
    `cortex run` starts inherit it with the rest of the environment."""
    env = os.environ if environ is None else environ
    env.setdefault(ENV, LEGACY_IO)
    return env[ENV] == LEGACY_IO and "grpc" not in sys.modules
