"""Event shards without processes: a shard (ingest/event_shard.py) and ingest's pool (ingest/shards.py) joined by a
real PAIR socket pair, against an EventSource run in-process on the same batches. What ingest writes to the view
from a shard's reports must be what the in-process source writes, including around a clear, and nothing a shard
made under an older generation may land after the change that superseded it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from cortex.blockkeys import chain_keys, root_key
from cortex.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from ingest.event_shard import Shard, state_of
from ingest.shard_wire import ENCODER, TO_INGEST, TO_SHARD, Assign, Control, KeyOp, Report, Spares
from ingest.shards import RemoteSource, ShardPool
from ingest.source import EventSource, follow
from ingest.sync import SyncState
from tests.test_ledger import SetSink

pytestmark = pytest.mark.timeout(60)

SLOT = 3
UNCHECKED_ALGO = "not-reproduced"
"""The engine hash is not recomputed (hash parity `unchecked`): these batches carry made-up hashes."""
A, B, C = list(range(100, 132)), list(range(200, 216)), list(range(300, 316))


def stored(hashes: list[int | bytes], tokens: list[int], parent: int | None = None) -> bytes:
    return encode_batch(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=16, lora_id=None, medium="GPU",
        lora_name=None)]))


def removed(hashes: list[int | bytes]) -> bytes:
    return encode_batch(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=hashes, medium="GPU")]))


def keys(tokens: list[int]) -> set[int]:
    return set(chain_keys(tokens, 16, root_key()))


class View:
    """The ViewWriter's write section, counted."""

    def __init__(self) -> None:
        self.sections = 0

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        self.sections += 1
        yield


def target(gen: int) -> Assign:
    return Assign(tid="w", gen=gen, slot=SLOT, engine="vllm", block_size=16, page_size=16, hash_algo=UNCHECKED_ALGO,
                  hash_seed=None, endpoint=None, replay_endpoint=None, topic="")


def assignment(pool: ShardPool) -> Assign:
    return target(pool.next_gen())


def in_process() -> tuple[EventSource, SetSink]:
    sink = SetSink()
    ev = follow(target(0), zmq.asyncio.Context.instance(), sink, alloc=None, on_change=lambda: None, on_events=None)
    return ev, sink


class Wired:
    """A shard and ingest's pool of one shard over an inproc PAIR pair, each message handled when pumped."""

    def __init__(self, spare: list[int] | None = None) -> None:
        self.ctx = zmq.asyncio.Context()
        self.ingest_end = self.ctx.socket(zmq.PAIR)
        self.ingest_end.bind("inproc://shard")
        self.shard_end = self.ctx.socket(zmq.PAIR)
        self.shard_end.connect("inproc://shard")
        shard_out: zmq.Socket[bytes] = zmq.Socket.shadow(self.shard_end.underlying)
        self.shard = Shard(self.ctx, shard_out.send)
        self.sink, self.view, self.changes = SetSink(), View(), 0
        spares = list(spare or [])
        self.pool = ShardPool(1, self.view, self.sink, lambda: spares.pop(0) if spares else None, self._changed)
        self.link = self.pool.shards[0]
        self.link.out = zmq.Socket.shadow(self.ingest_end.underlying).send

    def _changed(self) -> None:
        self.changes += 1

    async def hello(self) -> None:
        await self.shard_end.send(ENCODER.encode(Report(ops=[], states=[], stamps=[])))
        await self.to_ingest()

    async def to_shard(self) -> None:
        """Deliver every message ingest sent the shard."""
        while await self.shard_end.poll(50):
            self.shard.handle(TO_SHARD.decode(await self.shard_end.recv()))

    async def to_ingest(self) -> None:
        """Let the shard's loop send its report, then deliver every report to ingest."""
        await asyncio.sleep(0)
        while await self.ingest_end.poll(50):
            self.pool._received(self.link, TO_INGEST.decode(await self.ingest_end.recv()))

    async def follow(self) -> RemoteSource:
        """Ingest assigns target "w" to the shard, which starts following it."""
        src = self.pool.source(assignment(self.pool), on_change=self._changed, on_events=None)
        self.pool.assign(src)
        await self.to_shard()
        return src

    def remote(self) -> EventSource:
        return self.shard.followed["w"].source

    def close(self) -> None:
        self.ingest_end.close(0)
        self.shard_end.close(0)
        self.ctx.term()


def test_the_view_from_a_shards_reports_is_the_in_process_view_through_a_clear() -> None:
    async def main() -> None:
        w = Wired()
        try:
            await w.hello()
            src = await w.follow()
            ref, ref_sink = in_process()
            steps = [lambda s: s.sync.connected(), lambda s: s.sync.live(1, stored([1, 2], A)),
                     lambda s: s.sync.live(2, stored([3], B)), lambda s: s.sync.live(3, removed([2]))]
            for step in steps:
                ref.perform(step(ref))
                w.remote().perform(step(w.remote()))
                await w.to_ingest()
                assert w.sink.held == ref_sink.held
            assert w.sink.held[SLOT] == (keys(A) - set(chain_keys(A, 16, root_key())[1:])) | keys(B)
            assert (src.sync.state, src.shown, src.batches, src.ledger.blocks) == (SyncState.READY, True, 3, 2)
            assert src.sync.last_applied == 3 and src.parity.status == ref.parity.status

            # The worker goes down: ingest clears the slot now and the shard's ledger under a new generation. A
            # batch the shard applied before it read the clear is reported under the old one: never applied.
            src.ledger.clear(w.sink)
            assert SLOT not in w.sink.held
            w.remote().perform(w.remote().sync.live(4, stored([9], C)))
            await w.to_ingest()
            assert SLOT not in w.sink.held, "a change of the superseded generation reached the view"
            await w.to_shard()  # the clear
            await w.to_ingest()
            ref.ledger.clear(ref_sink)
            for s in (ref, w.remote()):
                s.perform(s.sync.live(5, stored([10], A[:16])))
            await w.to_ingest()
            assert w.sink.held == ref_sink.held and w.sink.held[SLOT] == set(chain_keys(A[:16], 16, root_key()))
        finally:
            w.close()

    asyncio.run(main())


def test_a_lost_shard_hides_its_targets_and_a_new_incarnation_is_assigned_them_anew() -> None:
    async def main() -> None:
        w = Wired()
        try:
            await w.hello()
            src = await w.follow()
            for action in (w.remote().sync.connected(), w.remote().sync.live(1, stored([1, 2], A))):
                w.remote().perform(action)
            await w.to_ingest()
            assert w.sink.held[SLOT] and src.shown
            gen, changes = src.gen, w.changes
            w.pool._lose(w.link)
            assert SLOT not in w.sink.held
            assert (src.sync.state, src.shown) == (SyncState.STALE, False) and src.gen > gen
            assert w.changes > changes
            # A report of the dead incarnation arriving late changes nothing.
            w.pool._received(w.link, Report(ops=[KeyOp("w", gen, 2, SLOT, [1, 2, 3])], states=[], stamps=[]))
            assert SLOT not in w.sink.held
            # The next incarnation's hello: every target is assigned again, under a generation of its own.
            w.link.connected = False
            await w.hello()
            sent = TO_SHARD.decode(await w.shard_end.recv())
            assert isinstance(sent, Assign) and sent.tid == "w" and sent.gen == src.gen > gen
        finally:
            w.close()

    asyncio.run(main())


def test_spare_slots_are_reserved_per_shard_and_topped_up_as_ledgers_take_them() -> None:
    async def main() -> None:
        w = Wired(spare=[10, 11, 12])
        try:
            await w.hello()
            sent = TO_SHARD.decode(await w.shard_end.recv())
            assert sent == Spares([10, 11]) and w.pool.reserved() == {10, 11}
            w.shard.handle(sent)
            src = await w.follow()
            assert w.shard.spares == [10, 11]
            # The ledger met a second KV-cache spec and took a spare: reported, no longer reserved, replaced.
            assert w.shard._spare() == 10
            followed = w.shard.followed["w"]
            st = state_of(followed.source, followed.recorder.gen)
            st.slots = [SLOT, 10]
            w.pool._received(w.link, Report(ops=[], states=[st], stamps=[]))
            assert src.ledger.slots() == [SLOT, 10] and w.pool.reserved() == {11, 12}
            assert TO_SHARD.decode(await w.shard_end.recv()) == Spares([12])
        finally:
            w.close()

    asyncio.run(main())


def test_only_news_reaches_ingest_as_a_change() -> None:
    """The target list is rewritten on each change: a report whose counters moved is not one, a state change is."""
    pool = ShardPool(1, View(), SetSink(), lambda: None, lambda: None)
    changed: list[int] = []
    arrived: list[int] = []
    src = RemoteSource(pool, assignment(pool), on_change=lambda: changed.append(1),
                       on_events=lambda: arrived.append(1))
    ev, _ = in_process()
    src.update(state_of(ev, src.gen))
    assert len(changed) == 1 and not arrived  # the shard's reason for CONNECTING replaces the proxy's own
    src.update(state_of(ev, src.gen))
    assert len(changed) == 1  # nothing new
    ev.perform(ev.sync.connected())
    src.update(state_of(ev, src.gen))
    assert len(changed) == 2 and src.sync.state is SyncState.READY
    ev.perform(ev.sync.live(1, stored([1, 2], A)))
    src.update(state_of(ev, src.gen))
    assert len(changed) == 2 and len(arrived) == 1 and src.batches == 1
    # Layout news is passed on once per version, not at every write of the target list.
    sent: list[object] = []
    src.send = sent.append  # type: ignore[method-assign,assignment]
    src.ledger.layout_version = 2
    src.layout_published(2)
    src.layout_published(2)
    assert sent == [Control("w", "layout_published", version=2)]


def test_a_reload_that_changes_the_shard_count_waits_for_the_restart(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The shard processes are started with ingest: a config edit of their number is logged and kept for the next
    start, never half-applied to a running pool."""
    from ingest.service import Ingest
    from tests.test_k8s_discovery import ingest_cfg

    async def main() -> None:
        ingest = Ingest(ingest_cfg(tmp_path))
        await ingest.start()
        try:
            await ingest._apply_config(ingest_cfg(tmp_path, ingest={"event_shards": 2}), ingest._probes)
            assert ingest.cfg.ingest.event_shards == 0 and ingest.shards is None
        finally:
            await ingest.stop()

    with caplog.at_level("WARNING", logger="cortex.ingest"):
        asyncio.run(main())
    assert "ingest.event_shards changed: it takes effect when the gateway restarts" in caplog.text
