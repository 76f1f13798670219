"""Load readings taken less often from workers this replica sends requests to (issue 28): ingest reads such a worker
every `ingest.routed_load_poll_interval_s`, and extproc fills in between readings with the change in this replica's
own in-flight count there (cluster_view.derived_load). Pure rules with vectors, and the candidates built from them:
a worker whose load is derived between readings still goes hot and cool on time, and other replicas' traffic stays
as the reading said until the next one, within the reading's age bound. And a peer's reading (cortex/peering.py),
applied in place of one this replica would have taken."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from cortex import peering
from cortex.config import CortexConfig, IngestConfig, SchedulerConfig
from cortex.contract import LoadReading, load_max_age_s
from cortex.engines import RankLoad
from cortex.inflight import BacklogBoard, InflightBoard
from extproc import candidates
from extproc.cluster_view import TargetInfo, derived_load, derived_waiting, engine_load_of
from extproc.policies import Ttft
from extproc.policies.base import Facts
from extproc.predictions import Predictions
from ingest.probe_loops import ProbeLoops
from ingest.workers import Target, load_poll_interval
from tests.test_contract import config, ingest_target


@pytest.mark.parametrize(("reading", "at_read", "now", "expected"), [
    (None, 3.0, 5.0, None),     # no reading (unknown or too old): still unknown, whatever this replica has in flight
    (10.0, None, 5.0, 10.0),    # a reading that does not say this replica's share then: taken as it is
    (10.0, 4.0, 4.0, 10.0),     # nothing changed here since the reading
    (10.0, 4.0, 9.0, 15.0),     # five more of ours since: seen at once
    (10.0, 4.0, 0.0, 6.0),      # ours all ended: the others' six remain
    (2.0, 4.0, 3.0, 3.0),       # two of ours were still on their way to the engine at the reading: others >= 0
    (0.0, 0.0, 2.0, 2.0),
])
def test_derived_load(reading: float | None, at_read: float | None, now: float, expected: float | None) -> None:
    assert derived_load(reading, at_read, now) == expected


@pytest.mark.parametrize(("waiting", "reading", "at_read", "expected"), [
    (3.0, None, 2.0, 3.0),     # no reading: as it is
    (3.0, 5.0, None, 3.0),     # a reading that does not say this replica's share then: as it is
    (1.0, 1.0, 1.0, 0.0),      # the one waiting request was ours (nothing ran): none of the others' waits
    (2.0, 4.0, 2.0, 2.0),      # two ran, two of ours in flight: ours may all have been running, theirs waiting
    (3.0, 4.0, 3.0, 1.0),      # one ran, three of ours: at least two of ours waited
    (1.0, 1.0, 3.0, 0.0),      # ours beyond the engine's count were on their way: never below 0
    (0.0, 6.0, 4.0, 0.0),
])
def test_derived_waiting(waiting: float, reading: float | None, at_read: float | None, expected: float) -> None:
    assert derived_waiting(waiting, reading, at_read) == expected


@pytest.mark.parametrize(("load", "waiting", "at_read", "now", "alive", "expected"), [
    (4.0, 3.0, 3.0, 1.0, True, (2.0, 1.0)),   # two of ours ended since; at least two of ours were waiting then
    (4.0, 3.0, None, 1.0, True, (4.0, 3.0)),  # the reading does not say our share: as read
    (None, 0.0, 3.0, 1.0, True, (None, 0.0)),  # no reading: unknown, and no waits priced
    (4.0, 3.0, 3.0, 1.0, False, (None, 0.0)),  # the view is not alive: nothing read is trusted
])
def test_a_targets_load_now_pairs_both_derivations(load: float | None, waiting: float, at_read: float | None,
                                                   now: float, alive: bool,
                                                   expected: tuple[float | None, float]) -> None:
    t = TargetInfo(id="w0", worker="w0", rank=None, slot=0, model="m", engine="vllm", address="127.0.0.1:9000",
                   exact_kv=True, healthy=True, engine_load=load, engine_waiting=waiting, load_inflight=at_read)
    assert t.load_now(now, alive) == expected


def test_a_reading_taken_while_our_request_waited_does_not_queue_the_holder_after_it_ended() -> None:
    """A conversation's turn was read waiting on the worker that now holds its prefix (running 0, waiting 1, this
    replica's 1 in flight); the turn ended before the next reading. Its next turn, sent at once, goes back to the
    holder: the ended request is no queue there. A waiting request of someone else's still is."""
    s = SchedulerConfig(alpha_ms_per_token=0.05, attention_ms_per_token2=0.0, step_ms=10.0, running_ms_per_request=0.0)
    facts = Facts(16, True, "no_cached_prefix", s, prompt_tokens=800, typical_prefill_ms=2000.0)

    def pick(reading: LoadReading) -> tuple[str, float]:
        holder = _target(reading, 100.2)
        other = TargetInfo(id="w1", worker="w1", rank=None, slot=1, model="m", engine="vllm",
                           address="127.0.0.1:9001", exact_kv=True, healthy=True, engine_load=0.0)
        cands = candidates.build([holder, other], matches=np.array([40, 0]), keys=list(range(50)),
                                 inflight=np.zeros(2, dtype=np.int64), alive=True, predictions=Predictions(),
                                 hysteresis=candidates.Hysteresis(), scoring=s, backlog_ms=np.zeros(2))
        d = Ttft().decide(cands, facts, random.Random(1))
        return d.chosen.id, d.estimates["w0"].queue_ms

    ours = pick(LoadReading(running=0.0, waiting=1.0, at=100.0, every_s=0.5, inflight=1.0))
    assert ours == ("w0", 0.0)
    theirs = pick(LoadReading(running=0.0, waiting=1.0, at=100.0, every_s=0.5, inflight=0.0))
    assert theirs == ("w1", 2000.0)


def test_poll_interval_by_who_keeps_the_worker_busy() -> None:
    icfg = IngestConfig()
    assert (icfg.load_poll_interval_s, icfg.routed_load_poll_interval_s, icfg.idle_load_poll_interval_s) == \
        (0.1, 0.5, 1.0)
    assert load_poll_interval(active=False, routed=False, icfg=icfg) == 1.0
    assert load_poll_interval(active=True, routed=False, icfg=icfg) == 0.1   # busy with others' traffic only
    assert load_poll_interval(active=True, routed=True, icfg=icfg) == 0.5    # this replica fills in its own share


@pytest.mark.parametrize(("active", "routed", "workers", "expected"), [
    (True, False, 25, 0.1),       # 25 active workers at 0.1 s: 250 reads/s, the default budget
    (True, False, 50, 0.2),       # twice as many: each read half as often
    (True, False, 256, 1.024),
    (True, True, 100, 0.5),       # the routed cadence is slower than the budget asks
    (True, True, 256, 1.024),
    (False, False, 100, 1.0),     # 100 idle workers at 1 s: within the budget
    (False, False, 512, 2.048),   # 512 idle workers: each read every ~2 s, 250 reads/s
])
def test_reads_stay_within_the_budget(active: bool, routed: bool, workers: int, expected: float) -> None:
    """Active and idle workers each have the budget: 512 idle workers read every second cost a replica more than
    half a core (docs/performance.md, "Fleet scale"). The other class's count does not change the cadence."""
    icfg = IngestConfig()
    assert icfg.load_reads_per_s == 250.0
    counts = (workers, 7) if active else (7, workers)
    assert load_poll_interval(active, routed, icfg, *counts) == pytest.approx(expected)
    assert load_poll_interval(active, routed, IngestConfig(load_reads_per_s=None), *counts) == \
        (0.5 if routed else 0.1) if active else 1.0


def test_backlog_latest_is_the_last_end_over_processes(tmp_path: Path) -> None:
    """Ingest tells the workers this replica sends requests to by when their last queued work is done."""
    a = BacklogBoard(tmp_path, 0, 2, 4)
    b = BacklogBoard(tmp_path, 1, 2, 4)
    reader = BacklogBoard(tmp_path, None, 2, 4)
    a.push(1, 500.0, now=100.0)
    b.push(1, 200.0, now=100.2)
    b.push(3, 100.0, now=50.0)
    assert reader.latest().tolist() == [0.0, pytest.approx(100.5), 0.0, pytest.approx(50.1)]


def _target(reading: LoadReading, now: float) -> TargetInfo:
    load, _ = engine_load_of(reading, now)
    return TargetInfo(id="w0", worker="w0", rank=None, slot=0, model="m", engine="vllm", address="127.0.0.1:9000",
                      exact_kv=True, healthy=True, engine_load=load, engine_waiting=reading.waiting,
                      load_at=reading.at, load_inflight=reading.inflight)


def test_a_worker_whose_load_is_derived_between_readings_goes_hot_and_cool_on_time() -> None:
    """One reading (40 active, 10 of them this replica's), then only this replica's in-flight count moves: the
    worker is hot as soon as ours push it over the high watermark (48) and cool again once they bring it down to the
    low one (32), with no new reading; the other replicas' 30 count all along."""
    s = SchedulerConfig(rule="cache_aware")
    reading = LoadReading(running=36.0, waiting=4.0, at=100.0, every_s=0.5, inflight=10.0)
    hysteresis = candidates.Hysteresis()
    seen = []
    for ours in (10, 17, 18, 12, 3, 2):
        cands = candidates.build([_target(reading, 100.4)], matches=np.array([0]), keys=[1],
                                 inflight=np.array([ours], dtype=np.int64), alive=True, predictions=Predictions(),
                                 hysteresis=hysteresis, scoring=s)
        hysteresis.carry(cands)
        seen.append((cands[0].load, cands[0].hot))
    assert seen == [(40.0, False), (47.0, False), (48.0, True), (42.0, True), (33.0, True), (32.0, False)]


def test_other_replicas_traffic_is_known_until_the_reading_ages_out() -> None:
    """The staleness bound: a reading at the routed cadence (0.5 s) stays usable for max(2 s, 2 x 0.5 s) and is then
    unknown, derived or not; only this replica's own share is known without it."""
    reading = LoadReading(running=30.0, waiting=0.0, at=100.0, every_s=0.5, inflight=0.0)
    assert load_max_age_s(0.5) == 2.0
    fresh = candidates.build([_target(reading, 101.9)], matches=None, keys=[], inflight=np.array([3]), alive=True,
                             predictions=Predictions(), hysteresis=candidates.Hysteresis(), scoring=SchedulerConfig())
    stale = candidates.build([_target(reading, 102.1)], matches=None, keys=[], inflight=np.array([3]), alive=True,
                             predictions=Predictions(), hysteresis=candidates.Hysteresis(), scoring=SchedulerConfig())
    assert fresh[0].engine_load == 33.0
    assert stale[0].engine_load is None and stale[0].load is None and stale[0].inflight == 3


def test_a_reading_carries_this_replicas_share_to_extproc(tmp_path: Path) -> None:
    """Ingest takes this replica's in-flight count with each reading and publishes it; a reading whose only change
    is that share is news (the others' share moved); extproc's candidate adds its own change since."""
    cfg = config(tmp_path)
    target = ingest_target(cfg.workers[0], 0, cfg.block_size)
    worker = target.worker
    worker.apply_load({0: RankLoad(running=6.0, waiting=2.0, activity=0.0)}, 100.0, np.array([3, 0]))
    assert target.inflight_at_read == 3.0 and target.load_news(100.0, 0.5)
    target.mark_published()
    worker.apply_load({0: RankLoad(running=6.0, waiting=2.0, activity=0.0)}, 100.5, np.array([3, 0]))
    assert not target.load_news(100.5, 0.5)  # nothing moved
    worker.apply_load({0: RankLoad(running=6.0, waiting=2.0, activity=0.0)}, 101.0, np.array([5, 0]))
    assert target.load_news(101.0, 0.5)  # same total, but two more of it are ours: the others' share fell by two
    reading = target.routable_meta().load
    assert (reading.running, reading.waiting, reading.inflight) == (6.0, 2.0, 5.0)
    cands = candidates.build([_target(reading, 101.2)], matches=None, keys=[], inflight=np.array([7]), alive=True,
                             predictions=Predictions(), hysteresis=candidates.Hysteresis(), scoring=SchedulerConfig())
    assert cands[0].engine_load == 10.0  # the others' 3 as read, and our 7 now


class Loops(ProbeLoops):
    """The probe loops' state as the Ingest sets it up (ingest/service.py), without the process around it."""

    def __init__(self, cfg: CortexConfig, targets: list[Target]) -> None:
        self.cfg = cfg
        self.workers = {t.worker.id: t.worker for t in targets}
        self._sources = {}
        self._board = InflightBoard(cfg.runtime_path() / "inflight", 0, 1, cfg.ingest.max_workers)
        self._meta_dirty = False
        self._peer_link = None
        self._outbox = {}


def test_a_peers_reading_is_applied_as_an_own_one_only_when_newer(tmp_path: Path) -> None:
    """Shared load readings (cortex/peering.py): ingest applies a peer's reading of a worker it knows and holds up,
    aged by what the report says, with this replica's in-flight counts now, unless its own reading is newer; one
    showing work wakes an idle worker's cadence; and the readings this replica took go out once, aged at sending."""
    cfg = config(tmp_path)
    w0, w1 = (ingest_target(w, i, cfg.block_size) for i, w in enumerate(cfg.workers))
    loops = Loops(cfg, [w0, w1])
    loops._board.inc(0)
    loops._board.inc(0)
    w1.worker.healthy = False
    w0.worker.apply_load({0: RankLoad(1.0, 0.0, 0.0)}, 100.0, None)  # its own reading, taken at 100.0
    busy = {0: RankLoad(4.0, 2.0, 5.0)}
    readings = (peering.Reading("w0", 300.0, busy),  # taken at 99.9 here: older than ours, ignored
                peering.Reading("w1", 0.0, busy),    # held down here: ignored
                peering.Reading("gone", 0.0, busy))  # not a worker here: ignored
    loops.apply_readings("gw-b", readings, 100.2)
    assert (w0.load.running, w0.load.at, w0.worker.read_by) == (1.0, 100.0, "")
    assert w1.load.at == 0.0 and not loops._meta_dirty
    assert w0.worker.idle and not w0.worker.wake.is_set()
    loops.apply_readings("gw-b", (peering.Reading("w0", 50.0, busy),), 100.3)
    assert (w0.load.running, w0.load.waiting, w0.worker.read_by, w0.worker.shared_at) == (4.0, 2.0, "gw-b", 100.3)
    assert w0.load.at == pytest.approx(100.25) and w0.inflight_at_read == 2.0  # our two in flight, now
    assert w0.worker.wake.is_set() and w0.worker.active_until > 100.3  # work seen: polled actively from now
    assert loops._meta_dirty  # published to extproc like an own reading
    # Readings this replica took: sent once, each aged from when it was taken.
    loops._outbox = {"w0": (10.0, busy), "w1": (10.4, busy)}
    assert loops.take_readings(10.5) == (peering.Reading("w0", 500.0, busy), peering.Reading("w1", 100.0, busy))
    assert loops.take_readings(10.6) == ()
