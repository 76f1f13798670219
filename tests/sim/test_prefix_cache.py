"""PrefixCache: vLLM's prefix-hit rules, pinning, eviction order and the events they produce."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortex.engine_hashes import LoraRef, VllmBlockHasher, vllm_wire_hash
from cortex.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from cortexsim.prefix_cache import CapacityError, PrefixCache

BS = 16
HASHER = VllmBlockHasher("sha256")


def toks(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def wires(tokens: list[int], **kw: object) -> list[int]:
    return [vllm_wire_hash(h) for h in HASHER.block_hashes(tokens, BS, **kw)]  # type: ignore[arg-type]


def run(cache: PrefixCache, rid: str, prompt: list[int], max_new: int = 1) -> int:
    """Admit, prefill and finish a request that samples exactly one token; return its cached tokens."""
    admission = cache.admit(rid, prompt, max_new_tokens=max_new)
    assert admission is not None
    cache.commit(rid, len(prompt))
    cache.free(rid)
    return admission.num_cached_tokens


def removed(events: Sequence[object]) -> list[int]:
    out: list[int] = []
    for e in events:
        if isinstance(e, BlockRemoved):
            assert len(e.block_hashes) == 1 and e.medium == "GPU" and e.group_idx == 0
            out.append(e.block_hashes[0])  # type: ignore[arg-type]
    return out


def test_hit_is_the_longest_cached_run_of_leading_blocks() -> None:
    cache = PrefixCache(64, BS)
    prompt = toks(40)
    assert run(cache, "a", prompt) == 0
    assert cache.lookup(40, cache.prompt_hashes(prompt)) == 32
    assert run(cache, "b", prompt) == 32
    # Divergence inside block 1 keeps only block 0.
    branched = prompt[:20] + toks(20, start=9000)
    assert run(cache, "c", branched) == 16
    # Divergence in block 0 hits nothing even though later tokens match.
    assert run(cache, "d", [7, *prompt[1:]]) == 0


def test_hit_capped_so_one_prompt_token_is_computed() -> None:
    cache = PrefixCache(64, BS)
    prompt = toks(32)  # exactly two full blocks
    run(cache, "a", prompt)
    cache.take_events()
    # (32 - 1) // 16 = 1 block may hit: the second block is recomputed...
    assert run(cache, "b", prompt) == 16
    # ...and cached again as a duplicate, reported with its parent like vLLM (no dedupe).
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored)
    h = wires(prompt)
    assert stored.block_hashes == [h[1]] and stored.parent_block_hash == h[0]
    assert stored.token_ids == prompt[16:32]
    assert cache.num_cached_blocks == 3
    assert run(cache, "c", [*prompt, 5]) == 32


def test_block_stored_fields_and_chaining() -> None:
    cache = PrefixCache(64, BS, kv_cache_spec_kind="full_attention")
    prompt = toks(36)
    assert cache.admit("a", prompt, max_new_tokens=20) is not None
    assert cache.take_events() == []  # nothing is cached before it is computed
    cache.commit("a", 36)
    (first,) = cache.take_events()
    assert isinstance(first, BlockStored)
    assert first.block_hashes == wires(prompt)
    assert first.parent_block_hash is None
    assert first.token_ids == prompt[:32]
    assert (first.block_size, first.lora_id, first.medium, first.lora_name) == (16, None, "GPU", None)
    assert first.extra_keys == [None, None]
    assert first.group_idx == 0 and first.kv_cache_spec_kind == "full_attention"
    # Decode: output tokens fill block 2; it is stored once its last token has been computed.
    outputs = toks(12, start=50)
    for i, tok in enumerate(outputs):
        cache.extend("a", [tok])
        cache.commit("a", 36 + i + 1)
    (second,) = cache.take_events()
    assert isinstance(second, BlockStored)
    full = prompt + outputs
    assert second.block_hashes == [wires(full)[2]]
    assert second.parent_block_hash == wires(full)[1]
    assert second.token_ids == full[32:48]


def test_salt_and_lora_isolate_and_are_published() -> None:
    cache = PrefixCache(64, BS)
    prompt = toks(40)
    lora = LoraRef("sql-lora", "/adapters/sql", int_id=3)
    assert cache.admit("a", prompt, cache_salt="tenant-a", lora=lora) is not None
    cache.commit("a", 40)
    cache.free("a")
    (ev,) = cache.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == wires(prompt, cache_salt="tenant-a", lora=lora)
    assert ev.extra_keys == [("sql-lora", "tenant-a"), ("sql-lora",)]
    assert (ev.lora_id, ev.lora_name) == (3, "sql-lora")
    assert run(cache, "b", prompt) == 0
    assert cache.admit("c", prompt, cache_salt="tenant-a", lora=lora) == cache.admit(
        "d", prompt, cache_salt="tenant-a", lora=lora)


def test_pinned_blocks_survive_pressure_and_admission_waits() -> None:
    cache = PrefixCache(5, BS)  # 4 usable blocks
    a = toks(48)
    assert cache.admit("a", a) is not None
    cache.commit("a", 48)
    # b needs 2 blocks, only 1 is free and a's 3 are pinned: it must wait, evicting nothing.
    assert cache.admit("b", toks(32, start=5000)) is None
    assert removed(cache.take_events()) == []
    assert cache.lookup(49, cache.prompt_hashes([*a, 1])) == 48
    cache.free("a")
    assert cache.admit("b", toks(32, start=5000)) is not None
    assert len(removed(cache.take_events())) == 1  # one of a's blocks made room


def test_reservation_keeps_decode_room() -> None:
    cache = PrefixCache(5, BS)  # 4 usable
    # 20 prompt + 29 new -> 48 slots -> 3 blocks, only 2 allocated now.
    assert cache.admit("a", toks(20), max_new_tokens=29) is not None
    assert cache.num_free_blocks == 2
    assert cache.admit("b", toks(20, start=3000)) is None  # 2 blocks needed, 1 is promised to a
    assert cache.admit("c", toks(10, start=3000)) is not None


def test_capacity_errors_are_immediate() -> None:
    cache = PrefixCache(5, BS)
    with pytest.raises(CapacityError, match="holds only 4"):
        cache.admit("a", toks(65))
    with pytest.raises(CapacityError):
        cache.admit("b", toks(60), max_new_tokens=10)
    with pytest.raises(CapacityError):
        cache.admit("c", [])
    cache.check_fits(64, 1)


def test_eviction_is_lru_and_leaf_first() -> None:
    cache = PrefixCache(9, BS)  # 8 usable: blocks 1..8
    a, b = toks(48, start=100), toks(32, start=500)
    run(cache, "a", a)  # takes blocks 1-3, frees a2, a1, a0
    run(cache, "b", b)  # takes blocks 4-5, frees b1, b0
    cache.take_events()
    ha, hb = wires(a), wires(b)
    big = toks(128, start=20_000)  # needs all 8 blocks
    assert cache.admit("c", big) is not None
    assert removed(cache.take_events()) == [ha[2], ha[1], ha[0], hb[1], hb[0]]
    assert cache.lookup(49, cache.prompt_hashes([*a, 0])) == 0


def test_a_hit_refreshes_recency() -> None:
    cache = PrefixCache(9, BS)
    a, b = toks(48, start=100), toks(32, start=500)
    run(cache, "a", a)
    run(cache, "b", b)
    # d re-uses a's first two blocks; freeing it moves them behind everything else.
    assert run(cache, "d", [*a[:32], 1]) == 32
    cache.take_events()
    ha, hb = wires(a), wires(b)
    assert cache.admit("c", toks(128, start=20_000)) is not None
    assert removed(cache.take_events()) == [ha[2], hb[1], hb[0], ha[1], ha[0]]


def test_duplicate_blocks_are_removed_one_event_each() -> None:
    cache = PrefixCache(5, BS)
    prompt = toks(32)
    # Two requests prefill the same prefix side by side: neither hits, both store.
    assert cache.admit("a", prompt) is not None
    assert cache.admit("b", prompt) is not None
    cache.commit("a", 32)
    cache.commit("b", 32)
    cache.free("a")
    cache.free("b")
    stores = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert [s.block_hashes for s in stores] == [wires(prompt)] * 2
    assert cache.admit("c", toks(64, start=7000)) is not None
    assert sorted(removed(cache.take_events())) == sorted(wires(prompt) * 2)


def test_reset_refuses_while_pinned_then_clears() -> None:
    cache = PrefixCache(16, BS)
    prompt = toks(40)
    assert cache.admit("a", prompt) is not None
    cache.commit("a", 40)
    cache.take_events()
    assert cache.reset() is False
    assert cache.take_events() == []
    cache.free("a")
    assert cache.reset() is True
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.lookup(40, cache.prompt_hashes(prompt)) == 0
    assert cache.num_cached_blocks == 0
    # Cleared blocks are plain free blocks: reusing them evicts nothing.
    assert cache.admit("b", toks(200, start=9000)) is not None
    assert removed(cache.take_events()) == []


def test_usage_counts_pinned_blocks_only() -> None:
    cache = PrefixCache(11, BS)
    assert cache.usage == 0.0
    assert cache.admit("a", toks(40)) is not None
    assert cache.usage == pytest.approx(0.3)
    cache.commit("a", 40)
    cache.free("a")
    assert cache.usage == 0.0
    assert (cache.query_tokens, cache.hit_tokens) == (40, 0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 90), st.integers(1, 90), st.integers(0, 90))
def test_hit_equals_shared_full_blocks_capped(cached_len: int, prompt_len: int, shared: int) -> None:
    cache = PrefixCache(64, BS)
    first = toks(cached_len)
    run(cache, "a", first)
    shared = min(shared, cached_len, prompt_len)
    prompt = first[:shared] + toks(prompt_len - shared, start=50_000)
    cached_blocks = cached_len // BS
    expected = min(shared // BS, cached_blocks, (prompt_len - 1) // BS) * BS
    assert cache.lookup(prompt_len, cache.prompt_hashes(prompt)) == expected


def test_report_mode_full_announces_the_hit_again_at_every_lookup() -> None:
    """vLLM 0.33's kv_cache_report_mode "full" (KVCacheManager.get_computed_blocks ->
    BlockPool.emit_cached_block_events): the hit blocks as one BlockStored, parent None, emitted before the
    allocation, so again at each step the request waits for blocks. No block is added: one eviction each."""
    cache = PrefixCache(8, BS)  # 7 usable blocks
    prompt = toks(40)
    run(cache, "a", prompt)
    stored_first = cache.take_events()
    assert [type(e) for e in stored_first] == [BlockStored]
    assert isinstance(stored_first[0], BlockStored)
    hog = cache.admit("hog", toks(80, start=5000))  # pins 5 blocks: "b" fits only once "hog" is done
    assert hog is not None
    cache.take_events()
    for _ in range(2):
        assert cache.admit("b", prompt, max_new_tokens=1, report_hits=True) is None
        (event,) = cache.take_events()
        assert isinstance(event, BlockStored) and event.parent_block_hash is None
        assert event.block_hashes == wires(prompt)[:2] and event.token_ids == prompt[:32]
        assert event.extra_keys == stored_first[0].extra_keys
    cache.free("hog")
    assert cache.admit("b", prompt, max_new_tokens=1, report_hits=True) is not None
    assert [e.block_hashes for e in cache.take_events() if isinstance(e, BlockStored)] == [wires(prompt)[:2]]
    cache.commit("b", 40)
    cache.free("b")
    assert cache.num_cached_blocks == 2  # the announcements added nothing
    assert run(cache, "c", toks(112, start=7000)) == 0  # takes every block: one removal per cached block
    assert sorted(removed(cache.take_events())) == sorted(wires(prompt)[:2])
