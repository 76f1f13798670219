"""Event shards (`ingest.event_shards`) behind a real `cortex run`: the targets' streams followed in child
processes of ingest, their key changes applied by ingest to the one view. Exact routing and exact claims as
in-process; a shard killed takes its targets out of exact routing at once and they come back with a new shard.
Every wait is a condition with a deadline; nothing is timed."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.harness import Gateway, chat_once, child_pids, cluster, long_chat, routed_to, wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with cluster(tmp_path_factory.mktemp("shards"), n_sims=3, replay=True,
                 extra_config={"ingest": {"event_shards": 2}}) as g:
        yield g


def ingest_doc(gw: Gateway) -> dict:
    return httpx.get(f"{gw.ingest_url}/cortex/workers", timeout=5).json()


def shard_pids(gw: Gateway) -> list[int]:
    ingest = gw.child_pids("cortexctl.cli ingest")
    assert len(ingest) == 1
    return child_pids(ingest[0], "ingest.event_shard")


def repeat_is_exact(gw: Gateway, seed: int) -> str:
    messages = long_chat(300, seed=seed)
    holder, mode, claimed, cached = chat_once(gw, messages)
    assert (claimed, cached) == (0, 0)
    wait_for(lambda: routed_to(gw, messages, holder), timeout=30, what=f"the view to show {holder} holding it")
    worker, mode, claimed, cached = chat_once(gw, messages)
    assert (worker, mode) == (holder, "exact_kv_events")
    assert claimed == cached > 0
    return holder


def test_streams_run_in_the_shards_and_repeats_are_exact(gw: Gateway) -> None:
    doc = ingest_doc(gw)
    shards = doc["event_shards"]
    assert [s["index"] for s in shards] == [0, 1] and sorted(s["targets"] for s in shards) == [1, 2]
    assert sorted(shard_pids(gw)) == sorted(s["pid"] for s in shards)
    targets = gw.targets()
    assert {t["event_shard"] for t in targets.values()} == {0, 1}
    assert all(t["exact_kv"] and t["view"] == "shown" for t in targets.values())
    holders = {repeat_is_exact(gw, seed) for seed in range(6)}
    assert len(holders) >= 2
    # The shards' figures reach ingest's document: batches counted, tail checks made on kept connections.
    targets = gw.targets()
    assert sum(t["batches"] for t in targets.values()) >= 6
    assert all(t["parity"]["status"] == "ok" for t in targets.values() if t["batches"])


def test_a_killed_shard_hides_its_targets_and_a_new_one_rebuilds_them(gw: Gateway) -> None:
    before = {s["index"]: s for s in ingest_doc(gw)["event_shards"]}
    victim = next(i for i, s in before.items() if s["targets"] == 2)
    followed = {t["worker"] for t in gw.targets().values() if t["event_shard"] == victim}
    # A prompt cached on one of the victim's workers before the kill (new prompts go where the load is lowest).
    kept, holder = next((m, w) for seed in range(200, 230)
                        if (w := chat_once(gw, m := long_chat(300, seed=seed))[0]) in followed)
    wait_for(lambda: routed_to(gw, kept, holder), timeout=30, what=f"the view to show {holder} holding it")
    os.kill(before[victim]["pid"], signal.SIGKILL)

    def restarted() -> bool:
        s = ingest_doc(gw)["event_shards"][victim]
        return s["restarts"] == 1 and s["pid"] not in (None, before[victim]["pid"])

    wait_for(restarted, timeout=30, what="a new shard process")
    assert b"event shard %d exited" % victim in gw.log.read_bytes()
    wait_for(lambda: all(t["exact_kv"] for t in gw.targets().values()), timeout=60,
             what="the new shard's targets back in exact routing")
    # The new shard's ledgers were rebuilt from the engines' replay: what was cached before the kill is claimed
    # exactly, on the worker that holds it.
    wait_for(lambda: routed_to(gw, kept, holder), timeout=30, what=f"{holder} shown holding the prompt again")
    worker, mode, claimed, cached = chat_once(gw, kept)
    assert (worker, mode) == (holder, "exact_kv_events") and claimed == cached > 0
    metrics = httpx.get(f"{gw.ingest_url}/metrics", timeout=5).text
    assert f'cortex_ingest_event_shard_restarts_total{{shard="{victim}"}} 1.0' in metrics
    assert f'cortex_ingest_event_shard_targets{{shard="{victim}"}} 2.0' in metrics
    # The other shard was not touched.
    other = ingest_doc(gw)["event_shards"][1 - victim]
    assert (other["pid"], other["restarts"]) == (before[1 - victim]["pid"], 0)


def test_shards_die_with_a_killed_ingest_and_its_successor_starts_its_own(gw: Gateway) -> None:
    old = shard_pids(gw)
    ingest = gw.child_pids("cortexctl.cli ingest")
    assert len(old) == 2 and len(ingest) == 1
    os.kill(ingest[0], signal.SIGKILL)  # the supervisor starts another ingest

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True

    wait_for(lambda: all(gone(p) for p in old), timeout=30, what="the dead ingest's shards gone")
    wait_for(lambda: len(gw.child_pids("cortexctl.cli ingest")) == 1 and len(shard_pids(gw)) == 2, timeout=60,
             what="a new ingest with two shards of its own")
    assert not set(shard_pids(gw)) & set(old)
    wait_for(lambda: all(t["exact_kv"] for t in gw.targets().values()), timeout=60,
             what="every target back on exact routing")
    repeat_is_exact(gw, seed=300)


def test_a_hung_shard_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard that stops reporting (SIGSTOP here) is killed and replaced as one that died: its targets are hidden
    and assigned to the new process. The pool on its own, with a real shard process; the silence limit shortened."""
    import asyncio

    from ingest import shards
    from tests.test_event_shards import View, assignment
    from tests.test_ledger import SetSink

    monkeypatch.setattr(shards, "STALLED_S", 2.0)

    async def main() -> None:
        changes: list[int] = []
        pool = shards.ShardPool(1, View(), SetSink(), lambda: None, lambda: changes.append(1))
        link = pool.shards[0]
        pool.start()
        src = pool.source(assignment(pool), on_change=lambda: None, on_events=None)
        task = asyncio.create_task(src.run())
        try:
            deadline = asyncio.get_running_loop().time() + 60
            while not (link.connected and src.sync.reason != "assigned to an event shard"):
                assert asyncio.get_running_loop().time() < deadline, "the shard never reported the target"
                await asyncio.sleep(0.05)
            first, gen, restarts = link.pid, src.gen, link.restarts
            assert first is not None
            os.kill(first, signal.SIGSTOP)
            while link.restarts == restarts or not link.connected or link.pid in (None, first):
                assert asyncio.get_running_loop().time() < deadline + 30, "the hung shard was not replaced"
                await asyncio.sleep(0.05)
            assert src.gen > gen
            with contextlib.suppress(ProcessLookupError):
                os.kill(first, signal.SIGCONT)  # killed by the pool: nothing left to resume
        finally:
            task.cancel()
            await pool.stop()

    asyncio.run(main())
