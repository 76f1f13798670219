"""The ledger keys events by Cortex's own chained keys and reference-counts what the engines store."""

from __future__ import annotations

from typing import Any

import pytest

from cortex.blockkeys import chain_keys, root_key
from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored
from ingest.hash_parity import FAILED, OK, UNCHECKED, ParityCheck
from ingest.ledger import Ledger


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


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, **kw: Any) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=16, **kw)


def test_prompt_keys_meet_event_keys() -> None:
    sink, led = SetSink(), Ledger(slot=3, engine="vllm", block_size=16)
    led.apply([stored([11, 22], TOKENS)], sink)
    assert sink.held[3] == set(chain_keys(TOKENS, 16, root_key()))
    assert led.blocks == 2


def test_hide_shows_nothing_and_reveal_shows_what_the_ledger_kept() -> None:
    """An out-of-sync stream hides its target from the view at once, keeping the ledger; back in sync, the
    view shows the ledger's keys again, with the catch-up batches applied in the same net write."""
    sink, led = SetSink(), Ledger(slot=1, engine="vllm", block_size=16)
    led.apply([stored([11, 22], TOKENS)], sink)
    keys = chain_keys(TOKENS, 16, root_key())
    led.hide(sink)
    assert not sink.held.get(1) and led.blocks == 2
    with led.deferred(sink):  # a catch-up batch removes one block, then the target is shown again
        led.apply([BlockRemoved([22], "GPU")], sink)
        led.reveal(sink)
        assert not sink.held.get(1)  # nothing is written until the section ends
    assert sink.held[1] == {keys[0]}
    with led.deferred(sink):  # hiding inside a batch drops the batch's pending additions too
        led.apply([stored([22], TOKENS[16:], parent=11)], sink)
        led.hide(sink)
    assert not sink.held.get(1) and led.blocks == 2


def test_parent_chain_resolves_through_engine_hashes() -> None:
    sink, led = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([11], TOKENS[:16]), stored([22], TOKENS[16:], parent=11)], sink)
    assert sink.held[0] == set(chain_keys(TOKENS, 16, root_key()))


def test_unknown_parent_is_dropped_not_guessed() -> None:
    sink, led = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([22], TOKENS[16:], parent=999)], sink)
    assert not sink.held.get(0) and led.dropped["unknown_parent"] == 1


def test_duplicate_store_needs_two_removals() -> None:
    """vLLM does not dedupe: a fully cached prompt of whole blocks recomputes its last block (the hit leaves the
    last token) and stores a second copy under the same parent; each copy's eviction sends a BlockRemoved."""
    sink, led = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([11, 22], TOKENS), stored([22], TOKENS[16:], parent=11)], sink)
    first, key = chain_keys(TOKENS, 16, root_key())
    led.apply([BlockRemoved([22], "GPU")], sink)
    assert sink.held[0] == {first, key}
    led.apply([BlockRemoved([22], "GPU")], sink)
    assert sink.held[0] == {first} and led.blocks == 1


def test_a_chain_start_repeating_held_blocks_adds_no_copy() -> None:
    """vLLM 0.33 publishes a request's prefix hit again as a chain start when it asks for it
    (kv_cache_report_mode "full"): no new block, so one removal takes the key. (Where vLLM did make a second
    copy of a chain start, a one-block prompt or one skipping prefix-cache reads, the key leaves with the first
    copy: a miss, never a false hit.)"""
    sink, led = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([11], TOKENS[:16]), stored([11], TOKENS[:16])], sink)
    assert sink.held[0] == {chain_keys(TOKENS[:16], 16, root_key())[0]} and led.blocks_restated == 1
    led.apply([BlockRemoved([11], "GPU")], sink)
    assert sink.held[0] == set() and led.blocks == 0
    led.apply([BlockRemoved([11], "GPU")], sink)  # a second copy's removal, if there was one: nothing to drop
    assert led.dropped["unknown_removal"] == 1 and sink.held[0] == set()


def test_other_media_do_not_count_as_gpu_hits() -> None:
    sink, led = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([11], TOKENS[:16], medium="CPU")], sink)
    assert not sink.held.get(0)
    led.apply([stored([11], TOKENS[:16], medium="GPU"), BlockRemoved([11], "CPU")], sink)
    assert len(sink.held[0]) == 1  # a CPU-tier removal does not evict the GPU copy


def test_cache_salt_and_lora_namespaces() -> None:
    sink, led = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([11], TOKENS[:16], extra_keys=[["tenant-a"]])], sink)
    assert sink.held[0] == set(chain_keys(TOKENS[:16], 16, root_key(None, "tenant-a")))
    sink2, led2 = SetSink(), Ledger(slot=0, engine="sglang", block_size=16)
    led2.apply([stored([5], TOKENS[:16], cache_salt="s1", lora_name="sql")], sink2)
    assert sink2.held[0] == set(chain_keys(TOKENS[:16], 16, root_key("sql", "s1")))


def test_clear_then_half_size_pages() -> None:
    sink, led = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    led.apply([stored([11, 22], TOKENS), AllBlocksCleared()], sink)
    assert not sink.held.get(0) and led.blocks == 0
    led.apply([BlockStored([1, 2, 3, 4], None, TOKENS, 8)], sink)
    assert sink.held[0] == set(chain_keys(TOKENS, 16, root_key()))


def test_small_engine_pages_accumulate_into_cortex_blocks() -> None:
    """SGLang's default page size is 1: sixteen one-token pages make one Cortex block, in any event split."""
    one_shot, split = SetSink(), SetSink()
    a = Ledger(slot=0, engine="sglang", block_size=16)
    a.apply([BlockStored(list(range(1, 33)), None, TOKENS, 1)], one_shot)
    b = Ledger(slot=0, engine="sglang", block_size=16)
    b.apply([BlockStored(list(range(1, 8)), None, TOKENS[:7], 1),
             BlockStored(list(range(8, 21)), 7, TOKENS[7:20], 1),
             BlockStored(list(range(21, 33)), 20, TOKENS[20:], 1)], split)
    assert one_shot.held[0] == split.held[0] == set(chain_keys(TOKENS, 16, root_key()))
    # The page that completed the second block owns it: evicting the tail page drops exactly that block.
    b.apply([BlockRemoved([32])], split)
    assert split.held[0] == set(chain_keys(TOKENS[:16], 16, root_key()))
    # A page in the middle of an unfinished block owns nothing.
    b.apply([BlockRemoved([31, 30])], split)
    assert split.held[0] == set(chain_keys(TOKENS[:16], 16, root_key()))


def test_partial_cortex_block_is_not_claimed() -> None:
    sink, led = SetSink(), Ledger(slot=0, engine="sglang", block_size=16)
    led.apply([BlockStored([1, 2, 3], None, TOKENS[:12], 4)], sink)
    assert not sink.held.get(0)
    led.apply([BlockStored([4], 3, TOKENS[12:16], 4)], sink)
    assert sink.held[0] == set(chain_keys(TOKENS[:16], 16, root_key()))


def test_engine_pages_larger_than_cortex_blocks_are_refused() -> None:
    sink, led = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    led.apply([BlockStored([1], None, TOKENS, 32)], sink)
    assert not sink.held.get(0) and led.dropped["page_size_not_a_divisor"] == 1


def test_vllm_parity_with_the_reference_vectors() -> None:
    # kv-events.md §9.1: tokens 1..8, block size 4, sha256_cbor, default seed.
    wire = [9561501211280363793, 15292913576410714033]
    check = ParityCheck(engine="vllm", page_size=4, hash_algo="sha256_cbor")
    led = Ledger(slot=0, engine="vllm", block_size=4, parity=check)
    led.apply([BlockStored(wire, None, [1, 2, 3, 4, 5, 6, 7, 8], 4)], SetSink())
    assert check.status == OK
    salted = ParityCheck(engine="vllm", page_size=4, hash_algo="sha256_cbor")
    Ledger(slot=0, engine="vllm", block_size=4, parity=salted).apply(
        [BlockStored([4280308768446823598, 5400091051297473476], None, [1, 2, 3, 4, 5, 6, 7, 8], 4,
                     extra_keys=[["tenant-a"], None])], SetSink())
    assert salted.status == OK
    other_seed = ParityCheck(engine="vllm", page_size=4, hash_algo="sha256_cbor", hash_seed="0")
    Ledger(slot=0, engine="vllm", block_size=4, parity=other_seed).apply(
        [BlockStored(wire, None, [1, 2, 3, 4, 5, 6, 7, 8], 4)], SetSink())
    assert other_seed.status == FAILED and "PYTHONHASHSEED" in other_seed.reason


@pytest.mark.parametrize(("algo", "seed", "wire"), [
    ("sha256", None, [1882140585328457242, 15284023028817948126]),
    ("sha256_cbor", "0", [2164874634404590027, 17270480062156288726]),
    ("xxhash", "0", [5138823041740264343, 1324190186712315504]),
    ("xxhash_cbor", "0", [1560721706249274670, 16652244415917022755]),
])
def test_vllm_parity_for_every_hash_algo(algo: str, seed: str | None, wire: list[int]) -> None:
    """Issue 11, defect 10: xxhash and xxhash_cbor were 'unchecked'; vectors by vLLM 0.33's own code."""
    event = BlockStored(wire, None, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    check = ParityCheck(engine="vllm", page_size=4, hash_algo=algo, hash_seed=seed)
    Ledger(slot=0, engine="vllm", block_size=4, parity=check).apply([event], SetSink())
    assert check.status == OK and check.checked == 1, check.reason
    assert algo in check.reason
    # Any other algorithm, or the same one under another seed, is caught.
    for other in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        for other_seed in ("0", "1"):
            if (other, other_seed) == (algo, seed or "vllm-none-hash") or (other, other_seed) == (algo, seed):
                continue
            wrong = ParityCheck(engine="vllm", page_size=4, hash_algo=other, hash_seed=other_seed)
            Ledger(slot=0, engine="vllm", block_size=4, parity=wrong).apply([event], SetSink())
            assert wrong.status == FAILED, (other, other_seed)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_a_seed_is_unchecked_but_page_size_still_is(algo: str) -> None:
    # vLLM's NONE_HASH is random per process here: no chain start can be recomputed, and none must fail.
    check = ParityCheck(engine="vllm", page_size=4, hash_algo=algo)
    led = Ledger(slot=0, engine="vllm", block_size=4, parity=check)
    led.apply([BlockStored([11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4)], SetSink())
    assert check.status == UNCHECKED and "PYTHONHASHSEED" in check.reason and not check.failed
    check.reset()
    assert check.status == UNCHECKED
    led.apply([BlockStored([13], None, [1] * 16, 16)], SetSink())
    assert check.status == FAILED and "page size 16" in check.reason


def test_unchecked_parity_stays_unchecked_after_a_page_size_failure_and_reset() -> None:
    """A restarted worker whose hashes cannot be recomputed is judged unchecked again, never against another
    engine's hash (before the adapters, a reset vLLM check compared chain starts with SGLang's chain)."""
    check = ParityCheck(engine="vllm", page_size=4, hash_algo="xxhash")
    led = Ledger(slot=0, engine="vllm", block_size=4, parity=check)
    led.apply([BlockStored([13], None, [1] * 16, 16)], SetSink())
    assert check.status == FAILED
    check.reset()
    assert check.status == UNCHECKED and "PYTHONHASHSEED" in check.reason
    led.apply([BlockStored([11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4)], SetSink())
    assert check.status == UNCHECKED and check.checked == 0 and check.failures == 1


def test_sglang_parity_and_page_size_mismatch() -> None:
    check = ParityCheck(engine="sglang", page_size=4)
    led = Ledger(slot=0, engine="sglang", block_size=4, parity=check)
    led.apply([BlockStored([-3488128144981237669 & (2**64 - 1), 5674439469042975057], None,
                           [1, 2, 3, 4, 5, 6, 7, 8], 4)], SetSink())
    assert check.status == OK
    wrong = ParityCheck(engine="sglang", page_size=1)
    Ledger(slot=0, engine="sglang", block_size=4, parity=wrong).apply(
        [BlockStored([1], None, [1, 2, 3, 4], 4)], SetSink())
    assert wrong.status == FAILED and "page size 4" in wrong.reason
