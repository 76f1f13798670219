"""What gateway replicas tell each other: the prefill work and the requests each has in flight per worker, and the
workers' load readings each took.

Independent replicas over one fleet see the engines alike but each other only through the engines' counts,
read every half second and priced at an average request: on traffic whose prompts span two orders of magnitude
(Mooncake's 1K-121K tokens) a worker busy with another replica's 90K-token prefill looks like one average
request. Peered replicas (`peers` config) publish, every few tens of milliseconds, what their own extproc
processes have queued on each worker (the backlog's milliseconds still to prefill, and the in-flight count);
each replica's ingest writes what its peers said into extra rows of its own boards (cortex/inflight.py), so the
time model reads the fleet's whole backlog as it reads its own processes' (docs/replicas.md).

A worker's load (its engine's `/metrics` or `/v1/loads`) is the same whoever reads it, so peered replicas split
the reading: each worker has one reader among the live replicas (`reader_of`, a rendezvous hash every replica
computes alike), which sends each reading it takes in its next report; the others apply it and stop reading that
worker while such readings keep arriving (`reads_itself`), so N replicas read the fleet once, not N times.

Sans-IO: the message codec, the choice of reader and the table of peers (which board row each peer owns, when it
was last heard) are pure; ingest/peers.py moves the bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec
import numpy as np
import xxhash

from cortex.config import CortexConfig
from cortex.engines.base import RankLoad

VERSION = 1


def board_rows(cfg: CortexConfig) -> int:
    """Rows of each shared board (cortex/inflight.py): one per extproc process, then, when peered, one per peer
    (written by ingest from the peer's reports)."""
    return cfg.extproc.process_count() + (cfg.peers.max_peers if cfg.peers.enabled else 0)


class Reading(msgspec.Struct, frozen=True, array_like=True):
    """One load reading the sender took of a worker (by worker id), as its engine answered it."""

    worker: str
    age_ms: float
    """How long before the report was sent the reading was taken (a duration: hosts' clocks are not comparable)."""
    ranks: dict[int, RankLoad]


class Report(msgspec.Struct, frozen=True, array_like=True):
    """One replica's own work per target (by target id: slots are local to each replica)."""

    v: int
    replica: str
    """The sender's id (`peers.replica_id`): a report from oneself is ignored, a new id takes a free row."""
    seq: int
    targets: dict[str, tuple[float, int]]
    """Target id -> (milliseconds of prefill it sent there that are predicted not done yet, requests in flight)."""
    readings: tuple[Reading, ...] = ()
    """The load readings the sender took since its last report. Last and defaulted, so a report from a replica
    that predates them still decodes (with none), and one that carries them decodes in such a replica too (msgpack
    arrays' extra trailing items are skipped): replicas of both kinds peer during a rolling upgrade."""


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
               inflight: np.ndarray, readings: tuple[Reading, ...] = ()) -> Report:
    """This replica's report from its own processes' rows (never its peers': a report is not relayed) and the
    load readings it took itself since the last one."""
    targets: dict[str, tuple[float, int]] = {}
    for tid, slot in slots.items():
        if 0 <= slot < backlog_ms.size:
            ms, n = float(backlog_ms[slot]), int(inflight[slot])
            if ms > 0.0 or n > 0:
                targets[tid] = (round(ms, 1), n)
    return Report(VERSION, replica, seq, targets, readings)


def reader_of(worker: str, replicas: Iterable[str]) -> str:
    """The replica that reads `worker`'s load for all of them (highest random weight): every replica computes
    the same one from the same ids, and a replica joining or leaving moves only the workers it gains or had."""
    return max(replicas, key=lambda r: (xxhash.xxh3_64_intdigest(f"{r}\x00{worker}".encode()), r))


def reads_itself(me: str, worker: str, peers: Iterable[str], shared_at: float, now: float, patience_s: float) -> bool:
    """Whether this replica reads the worker's load now: it is the worker's reader among itself and its live
    `peers`, or a peer's reading of it last arrived more than `patience_s` ago (the reader died, has not heard of
    this worker, predates shared readings, or its reports are lost: this replica reads it itself, as unpeered)."""
    if now - shared_at > patience_s:
        return True
    return reader_of(worker, [me, *peers]) == me


def patience(every_s: float, interval_s: float) -> float:
    """How long a worker may go without a peer's reading before this replica reads it itself: two of its reads
    at the cadence in force, plus two report intervals (the reader sends a reading with its next report)."""
    return 2.0 * every_s + 2.0 * interval_s


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
