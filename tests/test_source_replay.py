"""One target's event source (ingest/source.py) against a real ROUTER answering replays in vLLM's layout: an
answer asked of a publisher that has since gone (its connection dropped, or its numbering restarted) never
reaches the ledger.

A tail check or replay is a DEALER of its own, so its answer is not fenced by re-creating the SUB socket. An
engine that dies right after answering (or mid-answer: the DEALER returns what it got once the socket falls
silent) leaves the old process's batches queued; applied after the clear, they listed blocks the restarted
engine does not hold, and the new publisher's first numbers were then dropped as duplicates."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio

from cortex.blockkeys import chain_keys, root_key
from cortex.kv_events import END_SEQ, BlockStored, KVEventBatch, encode_batch
from ingest.hash_parity import ParityCheck
from ingest.ledger import Ledger
from ingest.source import EventSource, ReplayLink
from ingest.sync import SourceSync, SyncState
from tests.harness import free_ports
from tests.test_ledger import SetSink

pytestmark = pytest.mark.timeout(60)

OLD = list(range(1000, 1016))  # the dead engine's blocks
OLD2 = list(range(1100, 1116))
NEW = list(range(2000, 2016))  # the restarted engine's


def batch(hashes: list[int | bytes], tokens: list[int], parent: int | None = None) -> bytes:
    """One vLLM 0.33 batch with one BlockStored (cortex/kv_events.py: the engine's own schema)."""
    return encode_batch(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=16, lora_id=None,
        medium="GPU", lora_name=None)]))


def key(tokens: list[int]) -> int:
    return chain_keys(tokens, 16, root_key())[0]


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def request(router: zmq.asyncio.Socket) -> tuple[bytes, int]:
    """The next replay request the ROUTER receives: (client identity, start seq)."""
    assert await router.poll(10_000), "no replay request arrived"
    ident, empty, start = await router.recv_multipart()
    assert empty == b""
    return ident, int.from_bytes(start, "big")


async def answer(router: zmq.asyncio.Socket, ident: bytes, batches: list[tuple[int, bytes]]) -> None:
    for seq, payload in batches:
        await router.send_multipart([ident, b"", b"topic", seq.to_bytes(8, "big"), payload])
    await router.send_multipart([ident, b"", b"", END_SEQ, b""])


def router_and_source(ctx: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, EventSource, SetSink]:
    """A ROUTER standing in for the publisher's replay socket, and a source whose replays and tail checks ask it."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    (port,) = free_ports(1)
    router.bind(f"tcp://127.0.0.1:{port}")
    sink, ledger = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    src = EventSource("t", ledger, ParityCheck(engine="vllm", page_size=16), SourceSync(has_replay=True), ctx,
                      sink, endpoint=None, replay_endpoint=f"tcp://127.0.0.1:{port}")
    return router, src, sink


async def first_sync(src: EventSource, router: zmq.asyncio.Socket) -> int:
    """Connect the source and answer its first replay with the old engine's batch 0; returns the start it asked."""
    src.perform(src.sync.connected())
    ident, start = await request(router)
    await answer(router, ident, [(0, batch([1], OLD))])
    await until(lambda: src.sync.state is SyncState.READY, "the first sync")
    return start


async def shut(src: EventSource, router: zmq.asyncio.Socket, ctx: zmq.asyncio.Context) -> None:
    src.close()
    tasks = [t for t in (src._replay_task, src._tail_task) if t is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # their DEALERs close before the context ends
    router.close(0)
    ctx.term()


@pytest.mark.parametrize("old_answer_arrives", ["before_reconnect", "during_new_replay", "after_restart_by_seq"])
def test_an_answer_from_a_gone_publisher_never_reaches_the_ledger(old_answer_arrives: str) -> None:
    """The publisher goes away while a tail check waits for its answer: the connection drops (an engine restart)
    and comes back, or, on the same connection, its numbering starts again (seen by the sequence alone)."""
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        router, src, sink = router_and_source(ctx)
        try:
            # Connected: the first replay brings the old engine's batch 0.
            assert await first_sync(src, router) == 0
            assert sink.held[0] == {key(OLD)}

            # A tail check asks the old engine for anything after 0; the engine dies before its answer is read.
            src.check_tail()
            tail_ident, start = await request(router)
            assert start == 1
            stale = [(1, batch([2], OLD2))]
            if old_answer_arrives == "after_restart_by_seq":
                src.perform(src.sync.live(0, batch([9], NEW)))  # same number, other bytes: a new publisher
                assert src.sync.restarts == 1 and sink.held[0] == {key(NEW)}
                await answer(router, tail_ident, stale)
                await asyncio.sleep(0.05)  # room for the stale answer to land, if anything still listened for it
                assert sink.held[0] == {key(NEW)}, "the old publisher's batch reached the ledger"
                src.perform(src.sync.live(1, batch([10], NEW[:8] * 2, parent=9)))
                assert src.sync.last_applied == 1 and len(sink.held[0]) == 2
                return
            src.lost("connection to the publisher lost")
            assert not sink.held.get(0) and src.sync.state is SyncState.CONNECTING
            if old_answer_arrives == "before_reconnect":
                await answer(router, tail_ident, stale)
            # The engine comes back as a new process: seq from 0, its own blocks.
            src.perform(src.sync.connected())
            ident, start = await request(router)
            assert start == 0
            if old_answer_arrives == "during_new_replay":
                await answer(router, tail_ident, stale)
            await answer(router, ident, [(0, batch([9], NEW))])
            await until(lambda: src.sync.state is SyncState.READY, "the new publisher's sync")
            await asyncio.sleep(0.05)  # room for a stale answer to land, if anything still listened for it
            assert sink.held[0] == {key(NEW)}, "the dead engine's batch reached the ledger"
            assert src.sync.last_applied == 0
            # The new publisher's next batch is applied, not taken for a duplicate of the old one.
            src.perform(src.sync.live(1, batch([10], NEW[:8] * 2, parent=9)))
            assert src.sync.last_applied == 1 and len(sink.held[0]) == 2
        finally:
            await shut(src, router, ctx)

    asyncio.run(scenario())


def test_tail_checks_keep_one_connection_and_drop_it_after_an_unfinished_answer() -> None:
    """Consecutive exchanges that end at the end marker share one DEALER (the ROUTER sees one identity); one that
    times out closes it, so its late answer is never read as the next exchange's."""
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        (port,) = free_ports(1)
        router.bind(f"tcp://127.0.0.1:{port}")
        link = ReplayLink(ctx, f"tcp://127.0.0.1:{port}")
        try:
            asked = asyncio.create_task(link.ask(5, timeout_s=5.0))
            first, start = await request(router)
            assert start == 5
            await answer(router, first, [(5, batch([1], OLD))])
            got, complete = await asked
            assert complete and [seq for seq, _ in got] == [5] and link.open

            asked = asyncio.create_task(link.ask(6, timeout_s=5.0))
            ident, start = await request(router)
            assert (ident, start) == (first, 6), "the second check opened a new connection"
            await answer(router, ident, [])
            assert await asked == ([], True)

            # Unanswered within its timeout: incomplete, and the socket is gone with anything still coming to it.
            asked = asyncio.create_task(link.ask(7, timeout_s=0.2))
            ident, start = await request(router)
            assert (ident, start) == (first, 7)
            assert await asked == ([], False)
            assert not link.open
            await answer(router, ident, [(7, batch([2], OLD2))])  # late

            asked = asyncio.create_task(link.ask(7, timeout_s=5.0))
            fresh, start = await request(router)
            assert fresh != first and start == 7
            await answer(router, fresh, [])
            assert await asked == ([], True), "the late answer to the abandoned check was read"
        finally:
            link.close()
            router.close(0)
            ctx.term()

    asyncio.run(scenario())


def test_a_sources_tail_checks_reuse_its_connection_until_the_publisher_is_fenced() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        router, src, _ = router_and_source(ctx)
        try:
            await first_sync(src, router)

            idents = []
            for _ in range(3):
                src.check_tail()
                ident, start = await request(router)
                assert start == 1
                idents.append(ident)
                await answer(router, ident, [])
                assert src._tail_task is not None
                await src._tail_task
            assert len(set(idents)) == 1 and src.tail_checks == 3 and src.tail_connections == 1

            # The publisher restarts (seen by its numbering): the next check asks whoever publishes there now.
            src.perform(src.sync.live(0, batch([9], NEW)))
            assert src.sync.restarts == 1
            if src.sync.replay_pending:  # the new publisher's buffer, asked on a DEALER of its own
                ident, start = await request(router)
                assert start == 0 and ident not in idents
                await answer(router, ident, [(0, batch([9], NEW))])
            await until(lambda: src.sync.state is SyncState.READY and not src.sync.replay_pending, "the resync")
            src.check_tail()
            ident, start = await request(router)
            assert ident not in idents and start == 1
            await answer(router, ident, [])
        finally:
            await shut(src, router, ctx)

    asyncio.run(scenario())


def test_a_check_fenced_mid_exchange_gives_up_its_reader_once() -> None:
    """The fence closes the kept socket, then the cancelled check closes it again on its way out. Only the first
    may remove the loop's reader: by the second, the socket's FD number may be another socket's (the stream's new
    SUB socket, created by the same fence), and a second remove took that one's reader away: the stream stopped
    waking and its worker was judged silent (a CI run's fault suite)."""
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        (port,) = free_ports(1)  # nothing answers there: the check waits
        link = ReplayLink(ctx, f"tcp://127.0.0.1:{port}")
        loop = asyncio.get_running_loop()
        removed: list[int] = []
        real = loop.remove_reader

        def counting(fd: int) -> bool:
            removed.append(fd)
            return real(fd)

        loop.remove_reader = counting  # type: ignore[method-assign, assignment]
        try:
            check = asyncio.create_task(link.ask(1, timeout_s=5.0))
            await until(lambda: link.open, "the check's socket")
            await asyncio.sleep(0.05)
            link.close()  # the fence's order: the socket, then the task
            check.cancel()
            await asyncio.gather(check, return_exceptions=True)
            assert len(removed) == 1, removed
        finally:
            loop.remove_reader = real  # type: ignore[method-assign]
            link.close()
            ctx.term()

    asyncio.run(scenario())


def test_the_streams_context_holds_more_sockets_than_libzmqs_default() -> None:
    """A replica of a few hundred targets holds more than libzmq's default 1023 sockets (a SUB, a monitor pair and a
    kept DEALER each, and replays): at the default, 512 workers' replays failed with "Too many open files"."""
    from ingest.source import streams_context

    default = zmq.Context()
    try:
        assert default.get(zmq.MAX_SOCKETS) == 1023  # what the streams had before
    finally:
        default.term()
    ctx = streams_context()
    socks = []
    try:
        socks = [ctx.socket(zmq.SUB) for _ in range(1100)]
        assert len(socks) == 1100
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
