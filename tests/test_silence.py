"""ingest.silence: when a worker counts as a silent publisher (vectors)."""

from __future__ import annotations

import pytest

from ingest.silence import FLOWING, SILENT, WAITING, Observation, stored_a_block, verdict

BOUND = 10.0


def obs(**kw: object) -> Observation:
    base: dict[str, object] = {"now": 100.0, "healthy": True, "connected": False, "link_since": 0.0,
                               "last_batch_at": 0.0, "work_at": 0.0, "bound_s": BOUND}
    return Observation(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("o", "status", "needle"), [
    # Idle engines publish nothing by design: no work seen, never silent, connected or not.
    (obs(), WAITING, ""),
    (obs(connected=True, link_since=1.0), WAITING, ""),
    # Wrong port / firewall: it served (work seen at t=50) and nothing ever accepted the connection.
    (obs(work_at=50.0), SILENT, "has not accepted a connection for 100s"),
    # ... but only once both the work and the unconnected period are older than the bound.
    (obs(work_at=95.0), WAITING, ""),
    (obs(work_at=90.0), SILENT, "wrong kv_events port"),
    (obs(work_at=50.0, link_since=95.0), WAITING, ""),  # just lost: ZMQ reconnects within 100 ms
    # A dead worker is down, not silent.
    (obs(work_at=50.0, healthy=False), WAITING, ""),
    # Connected, served, and not one batch on this connection: events off or a topic mismatch.
    (obs(connected=True, link_since=10.0, work_at=20.0), SILENT, "no KV-event batch in the 90s"),
    (obs(connected=True, link_since=10.0, work_at=95.0), WAITING, ""),
    # A batch on the current connection: flowing, whatever the work since (a fully cached prompt stores
    # nothing, so later quiet proves nothing).
    (obs(connected=True, link_since=10.0, last_batch_at=11.0, work_at=20.0), FLOWING, ""),
    # A batch from an earlier connection does not count for the current one.
    (obs(connected=True, link_since=10.0, last_batch_at=5.0, work_at=20.0), SILENT, "since ingest connected"),
    # Batches once flowed, then the connection dropped and never came back while the worker kept serving.
    (obs(connected=False, link_since=30.0, last_batch_at=29.0, work_at=40.0), SILENT, "70s"),
    (obs(connected=False, link_since=30.0, last_batch_at=29.0, work_at=0.0), WAITING, ""),
], ids=["idle", "idle-connected", "wrong-port", "work-too-recent", "at-bound", "link-just-lost", "unhealthy",
        "connected-no-batch", "connected-work-recent", "flowing", "old-link-batch", "lost-link", "lost-link-idle"])
def test_verdict(o: Observation, status: str, needle: str) -> None:
    got, reason = verdict(o)
    assert got == status
    assert needle in reason
    assert bool(reason) == (status == SILENT)


@pytest.mark.parametrize(("uncached", "finished", "active", "page", "stored"), [
    (0.0, 0.0, 0.0, 16, False),       # nothing computed
    (10.0, 1.0, 0.0, 16, False),      # one ten-token warm-up request: a partial block, never stored
    (15.0, 1.0, 0.0, 16, False),
    (16.0, 1.0, 0.0, 16, True),       # one whole block computed from a block boundary: stored
    (30.0, 2.0, 0.0, 16, False),      # two requests of up to 15 each could make 30
    (31.0, 2.0, 0.0, 16, True),       # ... not 31: one of them computed a whole block
    (30.0, 1.0, 1.0, 16, False),      # a request still running (or waiting) may be the other contributor
    (1.0, 0.0, 1.0, 1, True),         # page size 1 (SGLang's default): any computed token is a block
    (900.0, 50.0, 10.0, 16, False),   # sixty short requests of 15 tokens: a readiness probe's traffic
])
def test_stored_a_block(uncached: float, finished: float, active: float, page: int, stored: bool) -> None:
    assert stored_a_block(uncached, finished, active, page) is stored
