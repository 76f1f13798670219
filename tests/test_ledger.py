"""The ledger keys events by Cortex's own chained keys and reference-counts what the engines store."""

from __future__ import annotations

from cortex.blockkeys import chain_keys, root_key
from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored
from ingest.ledger import WorkerLedger
from ingest.sequence import SeqVerdict, classify


class SetSink:
    """Records per-worker membership exactly as the shared view would hold it."""

    def __init__(self) -> None:
        self.held: dict[int, set[int]] = {}

    def add(self, worker: int, keys: list[int]) -> None:
        self.held.setdefault(worker, set()).update(keys)

    def remove(self, worker: int, keys: list[int]) -> None:
        self.held.setdefault(worker, set()).difference_update(keys)

    def clear_worker(self, worker: int) -> None:
        self.held.pop(worker, None)


TOKENS = list(range(100, 132))  # two blocks of 16


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, **kw: object) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=16, **kw)


def test_prompt_keys_meet_event_keys() -> None:
    sink, led = SetSink(), WorkerLedger(slot=3, engine="vllm", block_size=16)
    led.apply([stored([11, 22], TOKENS)], sink)
    assert sink.held[3] == set(chain_keys(TOKENS, 16, root_key()))
    assert led.blocks == 2


def test_parent_chain_resolves_through_engine_hashes() -> None:
    sink, led = SetSink(), WorkerLedger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([11], TOKENS[:16]), stored([22], TOKENS[16:], parent=11)], sink)
    assert sink.held[0] == set(chain_keys(TOKENS, 16, root_key()))


def test_unknown_parent_is_dropped_not_guessed() -> None:
    sink, led = SetSink(), WorkerLedger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([22], TOKENS[16:], parent=999)], sink)
    assert not sink.held.get(0) and led.dropped["unknown_parent"] == 1


def test_duplicate_store_needs_two_removals() -> None:
    sink, led = SetSink(), WorkerLedger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([11], TOKENS[:16]), stored([11], TOKENS[:16])], sink)
    key = chain_keys(TOKENS[:16], 16, root_key())[0]
    led.apply([BlockRemoved([11], "GPU")], sink)
    assert sink.held[0] == {key}
    led.apply([BlockRemoved([11], "GPU")], sink)
    assert sink.held[0] == set() and led.blocks == 0


def test_other_media_do_not_count_as_gpu_hits() -> None:
    sink, led = SetSink(), WorkerLedger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([11], TOKENS[:16], medium="CPU")], sink)
    assert not sink.held.get(0)
    led.apply([stored([11], TOKENS[:16], medium="GPU"), BlockRemoved([11], "CPU")], sink)
    assert len(sink.held[0]) == 1  # a CPU-tier removal does not evict the GPU copy


def test_cache_salt_and_lora_namespaces() -> None:
    sink, led = SetSink(), WorkerLedger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([11], TOKENS[:16], extra_keys=[["tenant-a"]])], sink)
    assert sink.held[0] == set(chain_keys(TOKENS[:16], 16, root_key(None, "tenant-a")))
    sink2, led2 = SetSink(), WorkerLedger(slot=0, engine="sglang", block_size=16)
    led2.apply([stored([5], TOKENS[:16], cache_salt="s1", lora_name="sql")], sink2)
    assert sink2.held[0] == set(chain_keys(TOKENS[:16], 16, root_key("sql", "s1")))


def test_clear_and_mismatched_block_size() -> None:
    sink, led = SetSink(), WorkerLedger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([11, 22], TOKENS), AllBlocksCleared()], sink)
    assert not sink.held.get(0) and led.blocks == 0
    led.apply([BlockStored([1, 2], None, TOKENS, 8)], sink)
    assert led.dropped["block_size_mismatch"] == 1 and not sink.held.get(0)


def test_sequence_verdicts() -> None:
    assert classify(None, 5) is SeqVerdict.FIRST
    assert classify(4, 5) is SeqVerdict.NEXT
    assert classify(4, 7) is SeqVerdict.GAP
    assert classify(4, 4) is SeqVerdict.DUPLICATE
    assert classify(4, 2) is SeqVerdict.DUPLICATE
    assert classify(4, 0) is SeqVerdict.RESTART
    assert classify(0, 0) is SeqVerdict.DUPLICATE
