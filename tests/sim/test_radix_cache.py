"""RadixCache: SGLang's page-aligned radix matching, locking, LRU leaf eviction, dedupe and coalesced events."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortex.engine_hashes import (
    LoraRef,
    sglang_namespace_seed,
    sglang_namespaced_hash,
    sglang_page_hashes,
    sglang_wire_hash,
)
from cortex.kv_events import SglAllBlocksCleared, SglBlockRemoved, SglBlockStored, SglKVEventBatch, encode_batch
from cortexsim.prefix_cache import CapacityError
from cortexsim.radix_cache import RadixCache, sglang_extra_key, sglang_lora_id

P0, P1 = -3488128144981237669, 5674439469042975057  # kv-events.md §9.3, page 4, tokens 1..8
BRANCH = -1085141225147335203


def wires(tokens: list[int], page: int, **kw: object) -> list[int]:
    return [sglang_wire_hash(d) for d in sglang_page_hashes(tokens, page, **kw)]  # type: ignore[arg-type]


def run(cache: RadixCache, rid: str, prompt: list[int], outputs: list[int] | None = None) -> int:
    """Prefill, decode `outputs` (the last is sampled, never computed), finish; returns cached tokens."""
    outputs = outputs or [7]
    admission = cache.admit(rid, prompt, max_new_tokens=len(outputs))
    assert admission is not None
    cache.commit(rid, len(prompt))
    for i, tok in enumerate(outputs[:-1]):
        cache.extend(rid, [tok])
        cache.commit(rid, len(prompt) + i + 1)
    cache.free(rid)
    return admission.num_cached_tokens


def test_construction_clears_and_the_golden_store() -> None:
    cache = RadixCache(16, 4)
    assert cache.take_events() == [SglAllBlocksCleared()]
    run(cache, "a", list(range(1, 11)))
    (stored,) = cache.take_events()
    assert stored == SglBlockStored(block_hashes=[P0, P1], parent_block_hash=None, token_ids=list(range(1, 9)),
                                    block_size=4, lora_id=None, medium="GPU")
    payload = encode_batch(SglKVEventBatch(ts=1.0, events=[stored], attn_dp_rank=0))
    assert payload.hex() == (
        "93cb3ff00000000000009187a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d3cf97adeedb5"
        "9e05bcf4ebfa8a1f3c34151b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708"
        "aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347505500")


def test_branch_splits_silently_and_links_the_parent_page() -> None:
    cache = RadixCache(16, 4)
    cache.take_events()
    run(cache, "a", [*range(1, 9), 99])
    cache.take_events()
    assert run(cache, "b", [1, 2, 3, 4, 11, 12, 13, 14, 15]) == 4
    (stored,) = cache.take_events()  # the split of [1..8] itself emitted nothing
    assert isinstance(stored, SglBlockStored)
    assert stored.block_hashes == [BRANCH] and stored.parent_block_hash == P0
    assert stored.token_ids == [11, 12, 13, 14]
    assert cache.num_cached_blocks == 3


def test_hit_is_page_aligned_and_capped_below_the_prompt() -> None:
    cache = RadixCache(64, 4)
    prompt = list(range(100, 112))  # three full pages
    run(cache, "a", prompt)
    # The whole prompt is cached, but one token must be computed: (12 - 1) // 4 pages hit.
    assert run(cache, "b", prompt) == 8
    assert run(cache, "c", [*prompt, 5]) == 12
    assert cache.lookup(7, prompt[:7]) == 4


def test_page_size_one_hashes_every_token() -> None:
    cache = RadixCache(64, 1)
    cache.take_events()
    run(cache, "a", [1, 2, 3], outputs=[9])
    (stored,) = cache.take_events()
    assert isinstance(stored, SglBlockStored)
    assert stored.block_hashes == [7470307888890966271, -1634645291211865391, 7325169757385981536]
    assert stored.block_size == 1


def test_decode_tokens_enter_the_tree_only_at_release() -> None:
    cache = RadixCache(64, 4)
    cache.take_events()
    prompt = list(range(1, 9))
    assert cache.admit("a", prompt, max_new_tokens=6) is not None
    cache.commit("a", 8)
    (prefill,) = cache.take_events()
    assert isinstance(prefill, SglBlockStored)
    assert prefill.token_ids == prompt
    outputs = [50, 51, 52, 53, 54]
    for i, tok in enumerate(outputs):
        cache.extend("a", [tok])
        cache.commit("a", 9 + i)
    assert cache.take_events() == []  # nothing while decoding
    cache.free("a")
    (release,) = cache.take_events()
    assert isinstance(release, SglBlockStored)
    # 8 prompt + 5 computed outputs = 13 tokens: one more full page, the partial tail is dropped.
    assert release.token_ids == [50, 51, 52, 53]
    assert release.block_hashes == wires([*prompt, 50, 51, 52, 53], 4)[2:]
    assert release.parent_block_hash == P1


def test_duplicates_are_deduped_not_stored_twice() -> None:
    cache = RadixCache(16, 4)
    cache.take_events()
    prompt = list(range(1, 10))
    assert cache.admit("a", prompt) is not None
    assert cache.admit("b", prompt) is not None  # side by side: neither hits
    cache.commit("a", 9)
    cache.commit("b", 9)
    cache.free("a")
    cache.free("b")
    stores = [e for e in cache.take_events() if isinstance(e, SglBlockStored)]
    assert len(stores) == 1 and stores[0].block_hashes == [P0, P1]
    assert cache.num_cached_blocks == 2
    assert cache.num_free_blocks + cache.num_evictable_blocks == 16


def test_locked_pages_survive_pressure_and_admission_waits() -> None:
    cache = RadixCache(4, 4)
    a = list(range(1, 13))
    assert cache.admit("a", a) is not None
    cache.commit("a", 12)
    cache.take_events()
    assert cache.admit("b", list(range(500, 508))) is None  # needs 2 pages, 1 free, a's 3 locked
    assert cache.take_events() == []
    cache.free("a")
    assert cache.admit("b", list(range(500, 508))) is not None
    (removed,) = cache.take_events()
    assert isinstance(removed, SglBlockRemoved)
    assert removed.block_hashes == wires(a, 4)  # one node, evicted whole, one event


def test_eviction_is_lru_over_leaves_whole_nodes() -> None:
    cache = RadixCache(6, 4)
    a, b = list(range(100, 109)), list(range(200, 209))
    run(cache, "a", a)  # node a: 2 pages
    run(cache, "b", b)  # node b: 2 pages
    run(cache, "a2", [*a[:8], 1])  # touches a: b is now least recently used
    cache.take_events()
    assert cache.admit("c", list(range(300, 316))) is not None  # needs 4 pages, 2 free
    events = cache.take_events()
    assert events == [SglBlockRemoved(block_hashes=wires(b, 4), medium="GPU")]
    # One more page: the only unlocked leaf left is a, evicted whole although one page would do.
    assert cache.admit("d", list(range(400, 404))) is not None
    assert cache.take_events() == [SglBlockRemoved(block_hashes=wires(a, 4), medium="GPU")]
    assert cache.admit("e", list(range(500, 508))) is None  # 2 pages; c and d hold 5 of 6


def test_parent_becomes_a_leaf_after_its_children_go() -> None:
    cache = RadixCache(5, 4)
    stem = list(range(1, 9))
    run(cache, "x", [*stem, 20, 21, 22, 23, 24])  # nodes: stem+[20..23]
    run(cache, "y", [*stem, 30, 31, 32, 33, 34])  # split: stem / [20..23] / [30..33]
    cache.take_events()
    assert cache.admit("big", list(range(900, 920))) is not None  # 5 pages: everything goes
    (removed,) = cache.take_events()
    assert isinstance(removed, SglBlockRemoved)
    h_x, h_y = wires([*stem, 20, 21, 22, 23], 4), wires([*stem, 30, 31, 32, 33], 4)
    # Leaves first (x then y by recency), then the stem once it became a leaf; one coalesced event.
    assert removed.block_hashes == [h_x[2], h_y[2], h_x[0], h_x[1]]


def test_salt_and_lora_namespaces() -> None:
    lora = LoraRef("sql-lora", "/adapters/sql")
    cache = RadixCache(64, 4)
    cache.take_events()
    prompt = list(range(1, 10))
    assert cache.admit("s", prompt, cache_salt="s1") is not None
    cache.commit("s", 9)
    cache.free("s")
    (salted,) = cache.take_events()
    assert isinstance(salted, SglBlockStored)
    assert salted.block_hashes[0] == 8751685944416650314  # kv-events.md §9.3 salt vector
    assert salted.cache_salt == "s1" and salted.parent_block_hash is None
    assert run(cache, "plain", prompt) == 0  # another namespace: no hit
    cache.take_events()
    assert cache.admit("l", prompt, lora=lora) is not None
    cache.commit("l", 9)
    cache.free("l")
    (adapted,) = cache.take_events()
    assert isinstance(adapted, SglBlockStored)
    extra_key = sglang_extra_key(None, lora)
    assert extra_key == uuid.uuid5(uuid.NAMESPACE_URL, "sql-lora\0/adapters/sql").hex == sglang_lora_id(lora)
    seed = sglang_namespace_seed(extra_key, None)
    assert adapted.block_hashes == [sglang_namespaced_hash(h, seed) for h in (P0, P1)]
    assert adapted.lora_name == "sql-lora"
    # A bare extra_key isolates the tree but is not rehashed in the default format.
    assert cache.admit("e", prompt, extra_key="tenant") is not None
    cache.commit("e", 9)
    cache.free("e")
    (extra,) = cache.take_events()
    assert isinstance(extra, SglBlockStored)
    assert extra.block_hashes == [P0, P1] and extra.lora_name is None


def test_dynamo_format_namespaces_salt_too() -> None:
    cache = RadixCache(64, 4, dynamo_format=True)
    cache.take_events()
    assert cache.admit("s", list(range(1, 10)), cache_salt="s1") is not None
    cache.commit("s", 9)
    cache.free("s")
    (ev,) = cache.take_events()
    assert isinstance(ev, SglBlockStored)
    salted_chain = wires(list(range(1, 9)), 4, cache_salt="s1")
    seed = sglang_namespace_seed(None, "s1")
    assert ev.block_hashes == [sglang_namespaced_hash(h, seed) for h in salted_chain]


def test_flush_refuses_while_running_and_forget_all_starts_over() -> None:
    cache = RadixCache(16, 4)
    cache.take_events()
    assert cache.admit("a", list(range(1, 10))) is not None
    cache.commit("a", 9)
    cache.take_events()
    assert cache.reset() is False
    cache.forget_all()
    assert cache.take_events() == [SglAllBlocksCleared()]  # what a freshly built cache records
    cache.free("a")  # no longer cacheable: inserts nothing
    assert cache.take_events() == [] and cache.num_cached_blocks == 0
    assert cache.num_free_blocks == 16
    assert cache.reset() is True
    assert cache.take_events() == [SglAllBlocksCleared()]


def test_disabled_cache_is_silent_and_never_hits() -> None:
    cache = RadixCache(16, 4, enabled=False)
    assert cache.take_events() == []
    assert run(cache, "a", list(range(1, 10))) == 0
    assert run(cache, "b", list(range(1, 10))) == 0
    assert cache.take_events() == [] and cache.num_free_blocks == 16


def test_capacity_errors() -> None:
    cache = RadixCache(4, 4)
    with pytest.raises(CapacityError, match="holds only 4"):
        cache.admit("a", list(range(17)))
    with pytest.raises(CapacityError):
        cache.admit("b", [])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 40), st.sampled_from([1, 4, 16]))
def test_hit_equals_shared_full_pages_capped(cached_len: int, prompt_len: int, shared: int, page: int) -> None:
    cache = RadixCache(256, page)
    first = list(range(1000, 1000 + cached_len))
    run(cache, "a", first)
    shared = min(shared, cached_len, prompt_len)
    prompt = first[:shared] + list(range(50_000, 50_000 + prompt_len - shared))
    expected = min(shared, cached_len // page * page, (prompt_len - 1) // page * page) // page * page
    assert cache.lookup(prompt_len, prompt) == expected
    # Pool accounting is conserved whatever happened.
    assert cache.num_free_blocks + cache.num_evictable_blocks == 256
