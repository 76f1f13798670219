"""The ledger: which Cortex block keys one event source's GPU holds, built only from its own events.

Cortex keys blocks by its own chained hash of token ids (cortex.blockkeys), so prompts and events meet on
the same keys whatever the engine's hash seed or algorithm. The ledger maps each engine wire hash to the
chain state after that engine block: the Cortex key of the last full Cortex block, plus the tokens since
(non-empty only when engine pages are smaller than Cortex blocks, e.g. SGLang's page size 1 against
Cortex's 16). That is how a BlockStored finds its parent. The engine block whose tokens complete a Cortex
block owns that key, which is how a BlockRemoved finds what to drop: both engines evict leaf-first, so a
block's earlier pages never leave before the page that completes it. Cortex never splits an engine block
(its block size is a multiple of the engine's page size), so a Cortex hit never claims more than the
engine can reuse.

vLLM may store one hash twice on one worker (it does not dedupe), so hashes are reference-counted, and a
key leaves the shared view only when its last owner goes. A reference must stand for a block the engine made:
vLLM also announces blocks it already holds (`kv_cache_report_mode: "full"` publishes a request's prefix hit as
a chain start, parent None, at each lookup), and their one eviction sends one BlockRemoved. So a chain start
that repeats a hash the ledger holds adds no reference; where vLLM did make a second copy there (a prompt of one
block, or one that skips prefix-cache reads), the key then leaves with the first copy: a miss, never a false hit.

Invariant: what the ledger lists is a subset of what the GPU holds, as far as the received events show.
Anything that breaks that (an unknown parent, a page size that does not divide Cortex's block) drops the
event and is counted, never guessed.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from cortex import engines
from cortex.blockkeys import block_key, chain_keys, root_key, token_bytes
from ingest.events import GPU_MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, Event
from ingest.hash_parity import ParityCheck


class KeySink(Protocol):
    """Where per-slot key membership is published (the shared view's writer)."""

    def add(self, worker: int, keys: list[int]) -> None: ...
    def remove(self, worker: int, keys: list[int]) -> None: ...
    def clear_worker(self, worker: int) -> None: ...


_EMPTY = b""


@dataclass
class Ledger:
    slot: int
    engine: str
    block_size: int
    """Cortex's key block size."""
    parity: ParityCheck | None = None
    key_of: dict[int, int] = field(default_factory=dict)
    """engine hash -> Cortex key of the last full Cortex block at or before the end of that engine block."""
    pending_of: dict[int, bytes] = field(default_factory=dict)
    """engine hash -> tokens after that key, as little-endian uint32 bytes (only for engine pages smaller
    than a Cortex block)."""
    owns: dict[int, int] = field(default_factory=dict)
    """engine hash -> the Cortex key its tokens completed, 0 for none; absent when it is key_of's (pages
    as large as Cortex blocks, the common case, need no second map)."""
    hash_refs: dict[int, int] = field(default_factory=dict)
    key_refs: dict[int, int] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)
    blocks_stored: int = 0
    blocks_removed: int = 0
    blocks_restated: int = 0
    """Blocks a chain start announced again while the ledger held them: counted, no new reference."""
    events_applied: int = 0
    _delta: _Delta | None = field(default=None, repr=False)

    @property
    def blocks(self) -> int:
        return len(self.key_refs)

    @contextlib.contextmanager
    def deferred(self, sink: KeySink) -> Iterator[None]:
        """Collect the net effect of every apply/clear inside, and publish it in at most three view writes
        at the end (each write is a section readers may have to wait out, and costs about the same for 1
        key or 100). Removals go before additions, so a reader between the two sees a subset of the
        worker's cache, never more."""
        if self._delta is not None:
            yield
            return
        self._delta = _Delta()
        try:
            yield
        finally:
            delta, self._delta = self._delta, None
            delta.flush(self.slot, sink)

    def apply(self, events: list[Event], sink: KeySink) -> None:
        with self.deferred(sink):
            delta = self._delta
            assert delta is not None
            for event in events:
                if isinstance(event, BlockStored):
                    self._stored(event, delta)
                elif isinstance(event, BlockRemoved):
                    self._removed(event, delta)
                elif isinstance(event, AllBlocksCleared):
                    self._forget()
                    delta.clear()
                self.events_applied += 1

    def clear(self, sink: KeySink) -> None:
        self._forget()
        if self._delta is not None:
            self._delta.clear()
        else:
            sink.clear_worker(self.slot)

    def hide(self, sink: KeySink) -> None:
        """Show nothing for this target in the view, keeping what the ledger knows. While a stream is not in
        sync (a gap, a silence probe), batches it has not applied yet may hold removals: the view must not
        offer those blocks to a reader that has not yet seen the target turn untrusted (extproc re-reads trust
        a refresh later)."""
        with self.deferred(sink):
            assert self._delta is not None
            self._delta.clear()

    def reveal(self, sink: KeySink) -> None:
        """Show the ledger's whole key set again (the stream is back in sync)."""
        with self.deferred(sink):
            delta = self._delta
            assert delta is not None
            delta.clear()
            delta.added = dict.fromkeys(self.key_refs)

    def _forget(self) -> None:
        self.key_of.clear()
        self.pending_of.clear()
        self.owns.clear()
        self.hash_refs.clear()
        self.key_refs.clear()

    def _salt(self, event: BlockStored) -> str | None:
        return engines.adapter(self.engine).event_salt(event.cache_salt, event.extra_keys, event.lora_name)

    def _stored(self, event: BlockStored, delta: _Delta) -> None:
        if event.medium not in GPU_MEDIA:
            self.dropped["not_gpu"] += 1
            return
        salt = self._salt(event)
        if self.parity is not None:
            self.parity.observe(event, salt)
        page = event.block_size
        n = len(event.block_hashes)
        if page <= 0 or self.block_size % page:
            self.dropped["page_size_not_a_divisor"] += 1
            return
        if n == 0 or len(event.token_ids) != n * page:
            self.dropped["token_count_mismatch"] += 1
            return
        if event.parent_block_hash is None:
            key, pending = root_key(event.lora_name, salt), _EMPTY
        else:
            found = self.key_of.get(event.parent_block_hash)
            if found is None:
                self.dropped["unknown_parent"] += 1
                return
            key, pending = found, self.pending_of.get(event.parent_block_hash, _EMPTY)
        hashes = event.block_hashes
        refs, key_of, key_refs = self.hash_refs, self.key_of, self.key_refs
        # A chain start may announce blocks the engine already holds (vLLM's reported prefix hits): a hash held
        # already is then no new block, and counting it would outlive the block's one BlockRemoved.
        restated = event.parent_block_hash is None
        if page == self.block_size:
            for engine_hash, k in zip(hashes, chain_keys(event.token_ids, page, key), strict=True):
                r = refs.get(engine_hash)
                if r is None:
                    refs[engine_hash] = 1
                    key_of[engine_hash] = k
                elif restated:
                    self.blocks_restated += 1
                    continue
                else:  # stored twice (vLLM does not dedupe): the first mapping stands
                    refs[engine_hash] = r + 1
                    k = key_of[engine_hash]
                kr = key_refs.get(k, 0)
                key_refs[k] = kr + 1
                if kr == 0:
                    delta.add(k)
        else:
            raw = token_bytes(event.token_ids)
            stride, full = page * 4, self.block_size * 4
            for i, engine_hash in enumerate(hashes):
                pending = pending + raw[i * stride:(i + 1) * stride]
                completed = 0
                if len(pending) == full:
                    key = block_key(pending, key)
                    completed, pending = key, _EMPTY
                r = refs.get(engine_hash)
                if r is None:
                    refs[engine_hash] = 1
                    key_of[engine_hash] = key
                    self.owns[engine_hash] = completed
                    if pending:
                        self.pending_of[engine_hash] = pending
                elif restated:
                    self.blocks_restated += 1
                    continue
                else:
                    refs[engine_hash] = r + 1
                    completed = self.owns[engine_hash]
                if completed:
                    kr = key_refs.get(completed, 0)
                    key_refs[completed] = kr + 1
                    if kr == 0:
                        delta.add(completed)
        self.blocks_stored += n

    def _removed(self, event: BlockRemoved, delta: _Delta) -> None:
        if event.medium not in GPU_MEDIA:
            return
        refs, key_refs = self.hash_refs, self.key_refs
        for engine_hash in event.block_hashes:
            r = refs.get(engine_hash)
            if r is None:
                self.dropped["unknown_removal"] += 1
                continue
            owned = self.owns.get(engine_hash)
            if owned is None:
                owned = self.key_of[engine_hash]
            if r == 1:
                del refs[engine_hash]
                del self.key_of[engine_hash]
                self.pending_of.pop(engine_hash, None)
                self.owns.pop(engine_hash, None)
            else:
                refs[engine_hash] = r - 1
            if owned:
                kr = key_refs[owned] - 1
                if kr == 0:
                    del key_refs[owned]
                    delta.remove(owned)
                else:
                    key_refs[owned] = kr
            self.blocks_removed += 1


class _Delta:
    """The net change of one batch to a target's key set."""

    __slots__ = ("added", "cleared", "removed")

    def __init__(self) -> None:
        self.cleared = False
        self.added: dict[int, None] = {}
        self.removed: dict[int, None] = {}

    def add(self, key: int) -> None:
        if key in self.removed:  # removed then stored again within the batch: present before and after
            del self.removed[key]
        else:
            self.added[key] = None

    def remove(self, key: int) -> None:
        if key in self.added:  # stored then removed within the batch: absent before and after
            del self.added[key]
        else:
            self.removed[key] = None

    def clear(self) -> None:
        self.cleared = True
        self.added.clear()
        self.removed.clear()

    def flush(self, slot: int, sink: KeySink) -> None:
        if self.cleared:
            sink.clear_worker(slot)
        if self.removed:
            sink.remove(slot, list(self.removed))
        if self.added:
            sink.add(slot, list(self.added))
