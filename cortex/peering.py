"""What gateway replicas tell each other: the prefill work and the requests each has in flight per worker.

Independent replicas over one fleet see the engines alike but each other only through the engines' counts,
read every half second and priced at an average request: on traffic whose prompts span two orders of magnitude
(Mooncake's 1K-121K tokens) a worker busy with another replica's 90K-token prefill looks like one average
request. Peered replicas (`peers` config) publish, every few tens of milliseconds, what their own extproc
processes have queued on each worker (the backlog's milliseconds still to prefill, and the in-flight count);
each replica's ingest writes what its peers said into extra rows of its own boards (cortex/inflight.py), so the
time model reads the fleet's whole backlog as it reads its own processes' (docs/replicas.md).

Sans-IO: the message codec and the table of peers (which board row each peer owns, when it was last heard) are
pure; ingest/peers.py moves the bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
import numpy as np

from cortex.config import CortexConfig

VERSION = 1


def board_rows(cfg: CortexConfig) -> int:
    """Rows of each shared board (cortex/inflight.py): one per extproc process, then, when peered, one per peer
    (written by ingest from the peer's reports)."""
    return cfg.extproc.process_count() + (cfg.peers.max_peers if cfg.peers.enabled else 0)


class Report(msgspec.Struct, frozen=True, array_like=True):
    """One replica's own work per target (by target id: slots are local to each replica)."""

    v: int
    replica: str
    """The sender's id (`peers.replica_id`): a report from oneself is ignored, a new id takes a free row."""
    seq: int
    targets: dict[str, tuple[float, int]]
    """Target id -> (milliseconds of prefill it sent there that are predicted not done yet, requests in flight)."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Report)


def encode(report: Report) -> bytes:
    return _encoder.encode(report)


def decode(data: bytes) -> Report | None:
    """The report, or None for bytes that are not one of this version (a peer of another version is ignored,
    never trusted half-read)."""
    try:
        report = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return report if report.v == VERSION else None


def own_report(replica: str, seq: int, slots: Mapping[str, int], backlog_ms: np.ndarray,
               inflight: np.ndarray) -> Report:
    """This replica's report from its own processes' rows (never its peers': a report is not relayed)."""
    targets: dict[str, tuple[float, int]] = {}
    for tid, slot in slots.items():
        if 0 <= slot < backlog_ms.size:
            ms, n = float(backlog_ms[slot]), int(inflight[slot])
            if ms > 0.0 or n > 0:
                targets[tid] = (round(ms, 1), n)
    return Report(VERSION, replica, seq, targets)


def rows_of(report: Report, slots: Mapping[str, int], width: int, now: float) -> tuple[np.ndarray, np.ndarray]:
    """A peer's report as one backlog row (when its work is predicted done, on this host's monotonic clock:
    `now` plus what it said was left; the time in transit is not known and not charged) and one in-flight row.
    Targets this replica does not know are dropped."""
    done = np.zeros(width, dtype=np.float64)
    inflight = np.zeros(width, dtype=np.int64)
    for tid, (ms, n) in report.targets.items():
        slot = slots.get(tid)
        if slot is not None and 0 <= slot < width:
            done[slot] = now + max(ms, 0.0) / 1000.0 if ms > 0 else 0.0
            inflight[slot] = max(n, 0)
    return done, inflight


@dataclass(slots=True)
class PeerTable:
    """Which board row each peer owns and when it was last heard. A peer silent for `stale_after_s` loses its row
    (its rows are cleared: a dead replica's requests ended with it, and its backlog is no longer being sent)."""

    me: str
    rows: int
    stale_after_s: float
    owner: dict[str, int] = field(default_factory=dict)
    heard: dict[str, float] = field(default_factory=dict)
    last_seq: dict[str, int] = field(default_factory=dict)

    def receive(self, report: Report, now: float) -> int | None:
        """The row to write `report` into; None: from this replica itself, an older message than one already
        applied, or no row free (more peers than `peers.max_peers`)."""
        if report.replica == self.me:
            return None
        row = self.owner.get(report.replica)
        if row is None:
            free = sorted(set(range(self.rows)) - set(self.owner.values()))
            if not free:
                return None
            row = self.owner[report.replica] = free[0]
        elif report.seq <= self.last_seq.get(report.replica, -1) and report.seq != 0:
            return None  # reordered (a restarted peer starts again from 0 and is taken)
        self.heard[report.replica] = now
        self.last_seq[report.replica] = report.seq
        return row

    def expire(self, now: float) -> list[int]:
        """Rows of peers silent for too long, freed: the caller clears them."""
        gone = [p for p, t in self.heard.items() if now - t > self.stale_after_s]
        rows = []
        for p in gone:
            rows.append(self.owner.pop(p))
            self.heard.pop(p)
            self.last_seq.pop(p, None)
        return rows

    def live(self) -> dict[str, int]:
        return dict(self.owner)
