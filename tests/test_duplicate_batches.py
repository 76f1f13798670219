"""Duplicated and replayed KV-event batches, and blocks an engine announces twice, never make the ledger list a
block the worker has evicted.

The worker is the simulator's vLLM cache (cortexsim/prefix_cache.py: vLLM 0.33's allocation, hit cap, no-dedupe
and tail-first eviction), driven like tests/test_faults_e2e.py: one request at a time (or two scheduled together)
over a few long prompts and a 300-block pool, so blocks are evicted all the time. Its batches, in vLLM's own
msgpack layout, reach the sync state machine and the ledger as ingest's event path delivers them, with the faults
in between: every batch may be sent twice, an old batch may come again after newer ones (a removal among them),
and a tail check may answer batches before their live copies arrive. Once a request's batches have arrived, the
ledger must hold exactly the worker's blocks, and a claim for any prompt must not exceed what the worker would
find."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from cortex.blockkeys import chain_keys, root_key
from cortex.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch
from cortexsim.prefix_cache import PrefixCache
from ingest.events import decode_batch
from ingest.ledger import Ledger
from ingest.sync import REORDER_WINDOW, Apply, Clear, RequestReplay, SourceSync, SyncState
from tests.test_ledger import SetSink

BS = 16


def claim(sink: SetSink, prompt: list[int]) -> int:
    """What extproc claims for `prompt` from this view: the leading run of its usable blocks."""
    keys = chain_keys(prompt, BS, root_key(), max_blocks=(len(prompt) - 1) // BS)
    held = sink.held.get(0, set())
    n = 0
    while n < len(keys) and keys[n] in held:
        n += 1
    return n * BS


class Stream:
    """One worker's cache, its publisher (seq, replay ring) and ingest's sync state and ledger for it."""

    def __init__(self, rng: random.Random, *, duplicates: float, old_duplicates: float, tail_checks: float) -> None:
        self.rng = rng
        self.cache = PrefixCache(300, BS)
        self.sync, self.sink, self.ledger = SourceSync(has_replay=True), SetSink(), Ledger(0, "vllm", BS)
        self.ring: list[tuple[int, bytes]] = []
        self.in_flight: list[tuple[int, bytes]] = []
        self.p_dup, self.p_old, self.p_tail = duplicates, old_duplicates, tail_checks
        self.perform(self.sync.connected())

    def perform(self, actions: list[Apply | Clear | RequestReplay]) -> None:
        for a in actions:
            if isinstance(a, Apply):
                self.ledger.apply(decode_batch(a.payload).events, self.sink)
            elif isinstance(a, Clear):
                self.ledger.clear(self.sink)
            else:  # the replay endpoint answers from its ring at once
                for seq, payload in self.ring:
                    if seq >= a.from_seq:
                        self.perform(self.sync.replayed(seq, payload))
                self.perform(self.sync.replay_done(complete=True))

    def publish(self) -> None:
        """One engine step's batch (vLLM publishes one per step with events)."""
        events = self.cache.take_events()
        if not events:
            return
        seq, payload = len(self.ring), encode_batch(KVEventBatch(ts=time.time(), events=events))
        self.ring.append((seq, payload))
        self.in_flight.append((seq, payload))
        if self.rng.random() < self.p_dup:  # the simulator's duplicate_events: sent twice, one number
            self.in_flight.append((seq, payload))

    def deliver(self) -> None:
        while self.in_flight:
            self.perform(self.sync.live(*self.in_flight.pop(0)))
            if self.rng.random() < self.p_old:  # an old batch again, after newer ones (removals among them)
                seen = self.ring[: (self.sync.newest_seen or 0) + 1]
                self.perform(self.sync.live(*self.rng.choice(seen[-40:])))
            s = self.sync
            if self.rng.random() < self.p_tail and s.state is SyncState.READY and s.last_applied is not None:
                # A tail check: the publisher's ring may be ahead of the live stream.
                self.perform(s.tail_checked([(q, p) for q, p in self.ring if q > s.last_applied]))

    def serve(self, rid: str, prompt: list[int], report: bool, *, also: list[int] | None = None) -> None:
        """One request (two with `also`, scheduled in the same steps) as the simulator's engine runs it: admit
        and cache the prompt when scheduled (vLLM's allocate_slots), three decode steps, free."""
        running = []
        for k, p in enumerate([prompt] if also is None else [prompt, also]):
            hashes = self.cache.prompt_hashes(p)
            if self.cache.admit(f"{rid}.{k}", p, max_new_tokens=4, block_hashes=hashes, report_hits=report):
                self.cache.commit(f"{rid}.{k}", len(p))
                running.append((f"{rid}.{k}", p))
        assert running
        self.publish()
        for step in range(3):
            for r, p in running:
                self.cache.extend(r, [7 + step])
                self.cache.commit(r, len(p) + step + 1)
                if step == 2:
                    self.cache.free(r)
            self.publish()

    def copies(self) -> dict[int, int]:
        """Engine hash (wire form) -> how many cached blocks have it: what the ledger's counts must equal."""
        out: Counter[int] = Counter()
        for h, blocks in self.cache._cached.items():
            out[self.cache._wire(h)] += len(blocks)  # type: ignore[index]
        return dict(out)


def prompts(rng: random.Random) -> list[list[int]]:
    # Lengths as the e2e test's (about 450..2700 tokens); two are whole blocks, so a full hit recomputes the
    # last block and vLLM holds two copies of its hash.
    lengths = [rng.randint(450, 2700) for _ in range(6)] + [16 * 40, 16 * 120]
    return [[rng.randint(10, 50_000) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("report", [False, True], ids=["incremental", "report-full"])
@pytest.mark.parametrize("seed", range(3))
def test_delivered_batches_keep_the_ledger_exact(seed: int, report: bool) -> None:
    rng = random.Random(seed)
    w = Stream(rng, duplicates=0.5, old_duplicates=0.2, tail_checks=0.3)
    chats = prompts(rng)
    full_hits = 0
    for r in range(150):
        w.deliver()
        assert w.sync.state is SyncState.READY
        assert w.ledger.hash_refs == w.copies(), f"request {r}: ledger counts differ from the worker's blocks"
        prompt = chats[rng.randrange(len(chats))]
        cached = w.cache.lookup(len(prompt), w.cache.prompt_hashes(prompt))
        assert claim(w.sink, prompt) == cached, f"request {r}"
        full_hits += cached == (len(prompt) - 1) // BS * BS
        w.serve(f"r{r}", prompt, report=report and rng.random() < 0.7)
    assert w.sync.duplicates > 50 and w.cache.num_cached_blocks < 300 and full_hits > 5


@pytest.mark.parametrize("report", [False, True], ids=["incremental", "report-full"])
def test_requests_scheduled_together_keep_the_ledger_exact(report: bool) -> None:
    """Two requests per step, often with the same prompt: vLLM caches blocks when it schedules them, so the
    second hits the first's instead of storing a copy, and the ledger stays exact."""
    rng = random.Random(11)
    w = Stream(rng, duplicates=0.5, old_duplicates=0.2, tail_checks=0.3)
    chats = [c for c in prompts(rng) if len(c) < 1200]
    for r in range(100):
        w.deliver()
        assert w.ledger.hash_refs == w.copies(), f"step {r}"
        pair = [chats[rng.randrange(len(chats))] for _ in range(2)]
        for prompt in pair:
            assert claim(w.sink, prompt) == w.cache.lookup(len(prompt), w.cache.prompt_hashes(prompt))
        w.serve(f"r{r}", pair[0], report=report, also=pair[1])


def test_an_undelivered_batch_is_the_one_way_to_over_claim() -> None:
    """The same worker, with each request's last batches still in flight when the next is routed (ledger window 2:
    an eviction's BlockRemoved not yet arrived). Claims then exceed the worker's hit, often by exactly one block:
    eviction takes a chain's last block first. This is the one way the streams above over-claim."""
    rng = random.Random(7)
    w = Stream(rng, duplicates=0.5, old_duplicates=0.0, tail_checks=0.0)
    chats = prompts(rng)
    over: list[int] = []
    for r in range(150):
        late = w.in_flight[-1:] if rng.random() < 0.5 else []
        del w.in_flight[len(w.in_flight) - len(late):]
        w.deliver()
        prompt = chats[rng.randrange(len(chats))]
        cached = w.cache.lookup(len(prompt), w.cache.prompt_hashes(prompt))
        if (claimed := claim(w.sink, prompt)) > cached:
            over.append(claimed - cached)
        w.in_flight[:0] = late
        w.serve(f"r{r}", prompt, report=False)
    assert over and BS in over


# -- hand cases in vLLM 0.33's layout ----------------------------------------------------------------------

TOKENS = list(range(100, 132))


def batch(*events: BlockStored | BlockRemoved) -> bytes:
    return encode_batch(KVEventBatch(ts=time.time(), events=list(events)))


def stored(hashes: list[int | bytes], tokens: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, lora_id=None,
                       medium="GPU", lora_name=None)


def removed(h: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[h], medium="GPU")


def feed(sync: SourceSync, ledger: Ledger, sink: SetSink, actions: list) -> None:
    for a in actions:
        if isinstance(a, Apply):
            ledger.apply(decode_batch(a.payload).events, sink)
        elif isinstance(a, Clear):
            ledger.clear(sink)


def test_an_old_store_batch_sent_again_after_its_removal_is_dropped() -> None:
    sync, sink, ledger = SourceSync(has_replay=True), SetSink(), Ledger(0, "vllm", BS)
    sync.connected()
    sync.replay_done()
    b0, b1 = batch(stored([11, 22], TOKENS)), batch(removed(22), removed(11))
    for seq, payload in [(0, b0), (1, b1), (0, b0)]:  # the store again, after the removal
        feed(sync, ledger, sink, sync.live(seq, payload))
    feed(sync, ledger, sink, sync.replayed(0, b0) + sync.replay_done())  # and again from a replay's overlap
    feed(sync, ledger, sink, sync.tail_checked([(0, b0), (1, b1)]))
    assert not sink.held.get(0) and sync.duplicates == 1 and sync.state is SyncState.READY
    # So old that its digest is forgotten: taken for a restarted publisher, the ledger is cleared (a miss, never
    # a false hit).
    feed(sync, ledger, sink, sync.live(2, b0))
    for seq in range(3, 3 + REORDER_WINDOW + 8):
        feed(sync, ledger, sink, sync.live(seq, batch()))
    assert sink.held.get(0) == set(chain_keys(TOKENS, BS, root_key()))
    feed(sync, ledger, sink, sync.live(2, b0))
    assert not sink.held.get(0)
    feed(sync, ledger, sink, sync.live(0, b0))
    assert sync.restarts == 2 and sink.held.get(0) == set(chain_keys(TOKENS, BS, root_key()))
    feed(sync, ledger, sink, sync.live(1, b1))
    assert not sink.held.get(0)


def test_a_reported_hit_is_not_a_second_copy() -> None:
    """vLLM 0.33's kv_cache_report_mode "full" (vllm_xargs, per request): each lookup publishes the request's
    prefix hit again as a BlockStored (parent None, BlockPool.emit_cached_block_events) for blocks already
    cached, with no new block behind it. Each block's eviction still sends one BlockRemoved, so counting the
    announcement as a copy kept the evicted blocks listed for good: claimed, never held."""
    sink, ledger = SetSink(), Ledger(0, "vllm", BS)
    ledger.apply(decode_batch(batch(stored([11, 22], TOKENS))).events, sink)
    for _ in range(2):  # looked up twice: the request waited one step for blocks
        ledger.apply(decode_batch(batch(stored([11], TOKENS[:16]))).events, sink)
    ledger.apply(decode_batch(batch(removed(22), removed(11))).events, sink)
    assert not sink.held.get(0) and ledger.blocks == 0 and not ledger.hash_refs
    # A copy the engine really made (a whole-block prompt fully cached recomputes its last block, stored under
    # its parent) still needs both removals.
    ledger.apply(decode_batch(batch(stored([11, 22], TOKENS), stored([22], TOKENS[16:], parent=11))).events, sink)
    ledger.apply(decode_batch(batch(removed(22))).events, sink)
    assert sink.held[0] == set(chain_keys(TOKENS, BS, root_key()))
    ledger.apply(decode_batch(batch(removed(22))).events, sink)
    assert sink.held[0] == set(chain_keys(TOKENS[:16], BS, root_key()))
