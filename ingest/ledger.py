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
key leaves the shared view only when its last owner goes.

Invariant: what the ledger lists is a subset of what the GPU holds, as far as the received events show.
Anything that breaks that (an unknown parent, a page size that does not divide Cortex's block) drops the
event and is counted, never guessed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import xxhash

from cortex.blockkeys import chain_keys, root_key
from ingest.events import GPU_MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, Event
from ingest.parity import ParityCheck


class KeySink(Protocol):
    """Where per-slot key membership is published (the shared view's writer)."""

    def add(self, worker: int, keys: list[int]) -> None: ...
    def remove(self, worker: int, keys: list[int]) -> None: ...
    def clear_worker(self, worker: int) -> None: ...


_EMPTY: tuple[int, ...] = ()


@dataclass
class Ledger:
    slot: int
    engine: str
    block_size: int
    """Cortex's key block size."""
    parity: ParityCheck | None = None
    key_of: dict[int, int] = field(default_factory=dict)
    """engine hash -> Cortex key of the last full Cortex block at or before the end of that engine block."""
    pending_of: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """engine hash -> tokens after that key (only for engine pages smaller than a Cortex block)."""
    owns: dict[int, int] = field(default_factory=dict)
    """engine hash -> the Cortex key its tokens completed."""
    hash_refs: Counter[int] = field(default_factory=Counter)
    key_refs: Counter[int] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    blocks_stored: int = 0
    blocks_removed: int = 0
    events_applied: int = 0

    @property
    def blocks(self) -> int:
        return len(self.key_refs)

    def apply(self, events: list[Event], sink: KeySink) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event, sink)
            elif isinstance(event, BlockRemoved):
                self._removed(event, sink)
            elif isinstance(event, AllBlocksCleared):
                self.clear(sink)
            self.events_applied += 1

    def clear(self, sink: KeySink) -> None:
        self.key_of.clear()
        self.pending_of.clear()
        self.owns.clear()
        self.hash_refs.clear()
        self.key_refs.clear()
        sink.clear_worker(self.slot)

    def _salt(self, event: BlockStored) -> str | None:
        if event.cache_salt is not None or self.engine != "vllm" or not event.extra_keys:
            return event.cache_salt
        # vLLM publishes extra keys untagged, per block: [lora_name?, ..., salt?] with the salt on block 0.
        first = event.extra_keys[0]
        if isinstance(first, list):
            rest = [k for k in first if isinstance(k, str) and k != event.lora_name]
            return rest[-1] if rest else None
        return None

    def _stored(self, event: BlockStored, sink: KeySink) -> None:
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
        fresh: list[int] = []
        hashes = event.block_hashes
        if page == self.block_size:
            keys = chain_keys(event.token_ids, page, key)
            for engine_hash, k in zip(hashes, keys, strict=True):
                self._own(engine_hash, k, _EMPTY, k, fresh)
        else:
            tokens = np.asarray(event.token_ids, dtype=np.uint32)
            for i, engine_hash in enumerate(hashes):
                pending = pending + tuple(int(t) for t in tokens[i * page:(i + 1) * page])
                completed = None
                if len(pending) == self.block_size:
                    key = xxhash.xxh3_64_intdigest(np.asarray(pending, dtype="<u4").tobytes(), seed=key) or 1
                    completed, pending = key, _EMPTY
                self._own(engine_hash, key, pending, completed, fresh)
        self.blocks_stored += n
        if fresh:
            sink.add(self.slot, fresh)

    def _own(self, engine_hash: int, key: int, pending: tuple[int, ...], completed: int | None,
             fresh: list[int]) -> None:
        if self.hash_refs[engine_hash] == 0:
            self.key_of[engine_hash] = key
            if pending:
                self.pending_of[engine_hash] = pending
            if completed is not None:
                self.owns[engine_hash] = completed
        self.hash_refs[engine_hash] += 1
        owned = self.owns.get(engine_hash)
        if owned is not None:
            self.key_refs[owned] += 1
            if self.key_refs[owned] == 1:
                fresh.append(owned)

    def _removed(self, event: BlockRemoved, sink: KeySink) -> None:
        if event.medium not in GPU_MEDIA:
            return
        gone: list[int] = []
        for engine_hash in event.block_hashes:
            if self.hash_refs[engine_hash] <= 0:
                self.hash_refs.pop(engine_hash, None)
                self.dropped["unknown_removal"] += 1
                continue
            owned = self.owns.get(engine_hash)
            self.hash_refs[engine_hash] -= 1
            if self.hash_refs[engine_hash] == 0:
                del self.hash_refs[engine_hash]
                del self.key_of[engine_hash]
                self.pending_of.pop(engine_hash, None)
                self.owns.pop(engine_hash, None)
            if owned is not None:
                self.key_refs[owned] -= 1
                if self.key_refs[owned] == 0:
                    del self.key_refs[owned]
                    gone.append(owned)
            self.blocks_removed += 1
        if gone:
            sink.remove(self.slot, gone)
