"""A target's KV-event subscription as /ready and the status page show it. Its own module so that both readiness.py
and service.py use it without importing each other (docs/architecture.md "Layers": no import circles)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ingest.sync import SyncState

if TYPE_CHECKING:
    from ingest.workers import Target

_SUBSCRIPTION = {SyncState.CONNECTING: "connecting", SyncState.SYNCING: "replaying", SyncState.READY: "live",
                 SyncState.STALE: "stale"}


def subscription(t: Target) -> dict[str, Any]:
    """A target's KV-event subscription: off (no endpoint), connecting, replaying, live or stale."""
    if not t.worker.events_usable:
        return {"state": "off", "reason": t.worker.events_reason}
    sync = t.events.sync
    diagnosis = t.events.diagnosis
    return {"state": _SUBSCRIPTION[sync.state], "reason": diagnosis[1] if diagnosis is not None else sync.reason,
            **({"diagnosis": diagnosis[0]} if diagnosis is not None else {}),
            "endpoint": t.endpoint(t.worker.cfg.kv_events), "replay": t.endpoint(t.worker.cfg.kv_replay)}
