"""The circuit breakers' states as files: each extproc process writes its own on every transition, ingest reads them
all for `/cortex/workers` and the status page (extproc/breaker.py keeps the state; docs/reliability.md).

One JSON file per process index under `<runtime>/breakers/`, replaced by rename, holding the wall-clock time it was
written and, per worker address, the process's breaker (only workers with something to say: open, half-open, or
closed with failures counted). An OPEN entry carries how long it had left: once that time is past, the process
admits trials at its next request, so the reader shows it half-open.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_SEVERITY = {"closed": 0, "half_open": 1, "open": 2}


def path(runtime: Path, index: int) -> Path:
    return runtime / "breakers" / f"{index}.json"


def write(file: Path, snapshot: Mapping[str, Mapping[str, object]]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".breakers.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"at": time.time(), "workers": snapshot}, f)
        os.replace(tmp, file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read(runtime: Path, processes: int, now: float | None = None) -> dict[str, dict[str, Any]]:
    """Per worker address, the worst breaker over the extproc processes 0..processes-1: {state, processes: {index:
    state}}. Missing or unreadable files count as all closed (a process that never saw a failure writes none)."""
    now = time.time() if now is None else now
    out: dict[str, dict[str, Any]] = {}
    for index in range(processes):
        try:
            doc = json.loads(path(runtime, index).read_text())
            at = float(doc["at"])
            workers = doc["workers"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(workers, dict):
            continue
        for address, b in workers.items():
            if not isinstance(b, dict) or b.get("state") not in _SEVERITY:
                continue
            state = str(b["state"])
            left = b.get("half_open_in_s")
            if state == "open" and isinstance(left, int | float) and now >= at + left:
                state = "half_open"
            entry = out.setdefault(str(address), {"state": "closed", "processes": {}})
            entry["processes"][str(index)] = state
            if _SEVERITY[state] > _SEVERITY[entry["state"]]:
                entry["state"] = state
    return out
