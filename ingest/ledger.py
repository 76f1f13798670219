"""The ledger: which Cortex block keys each worker's GPU holds, built only from that worker's own events.

Cortex keys blocks by its own chained hash of token ids (cortex.blockkeys), so prompts and events meet on
the same keys whatever the engine's hash seed or algorithm. Each worker keeps a map from the engine's
wire hashes to Cortex keys, which is how a BlockStored finds its parent and a BlockRemoved finds what to
drop. vLLM may store one hash twice on one worker (it does not dedupe), so hashes are reference-counted and
a key leaves the shared view only when its last reference goes.

Invariant: what the ledger says a worker holds is a subset of what it really holds, as far as the events
received show. Anything that breaks that (an unknown parent, an unmappable block size) drops the event
and is counted, never guessed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from cortex.blockkeys import chain_keys, root_key
from ingest.events import GPU_MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, Event


class KeySink(Protocol):
    """Where per-worker key membership is published (the shared view's writer)."""

    def add(self, worker: int, keys: list[int]) -> None: ...
    def remove(self, worker: int, keys: list[int]) -> None: ...
    def clear_worker(self, worker: int) -> None: ...


@dataclass
class WorkerLedger:
    slot: int
    engine: str
    block_size: int
    """Cortex's key block size; engine blocks of another size are not mapped yet and are counted as dropped."""
    key_of: dict[int, int] = field(default_factory=dict)
    hash_refs: Counter[int] = field(default_factory=Counter)
    key_refs: Counter[int] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    blocks_stored: int = 0
    blocks_removed: int = 0

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

    def clear(self, sink: KeySink) -> None:
        self.key_of.clear()
        self.hash_refs.clear()
        self.key_refs.clear()
        sink.clear_worker(self.slot)

    def _namespace_root(self, event: BlockStored) -> int:
        salt = event.cache_salt
        if salt is None and self.engine == "vllm" and event.extra_keys:
            # vLLM publishes extra keys untagged: [lora_name?, salt?] on the first block only for the salt.
            first = event.extra_keys[0]
            if isinstance(first, list):
                rest = [k for k in first if isinstance(k, str) and k != event.lora_name]
                salt = rest[0] if rest else None
        return root_key(event.lora_name, salt)

    def _stored(self, event: BlockStored, sink: KeySink) -> None:
        if event.medium not in GPU_MEDIA:
            self.dropped["not_gpu"] += 1
            return
        if event.block_size != self.block_size:
            self.dropped["block_size_mismatch"] += 1
            return
        n = len(event.block_hashes)
        if n == 0 or len(event.token_ids) != n * event.block_size:
            self.dropped["token_count_mismatch"] += 1
            return
        if event.parent_block_hash is None:
            parent = self._namespace_root(event)
        else:
            found = self.key_of.get(event.parent_block_hash)
            if found is None:
                self.dropped["unknown_parent"] += 1
                return
            parent = found
        keys = chain_keys(event.token_ids, self.block_size, parent)
        fresh: list[int] = []
        for engine_hash, key in zip(event.block_hashes, keys, strict=True):
            if self.hash_refs[engine_hash] == 0:
                self.key_of[engine_hash] = key
            else:
                key = self.key_of[engine_hash]
            self.hash_refs[engine_hash] += 1
            self.key_refs[key] += 1
            if self.key_refs[key] == 1:
                fresh.append(key)
        self.blocks_stored += n
        if fresh:
            sink.add(self.slot, fresh)

    def _removed(self, event: BlockRemoved, sink: KeySink) -> None:
        if event.medium not in GPU_MEDIA:
            return
        gone: list[int] = []
        for engine_hash in event.block_hashes:
            if self.hash_refs[engine_hash] <= 0:
                self.hash_refs.pop(engine_hash, None)
                self.dropped["unknown_removal"] += 1
                continue
            key = self.key_of[engine_hash]
            self.hash_refs[engine_hash] -= 1
            if self.hash_refs[engine_hash] == 0:
                del self.hash_refs[engine_hash]
                del self.key_of[engine_hash]
            self.key_refs[key] -= 1
            if self.key_refs[key] == 0:
                del self.key_refs[key]
                gone.append(key)
            self.blocks_removed += 1
        if gone:
            sink.remove(self.slot, gone)
