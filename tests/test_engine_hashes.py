"""Engine block hashes against the golden vectors of kv-events.md §9.1 (vLLM 0.33), §9.3 (SGLang 0.5.23)."""

from __future__ import annotations

import hashlib

import cbor2
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from cortex.engine_hashes import (
    DEFAULT_NONE_HASH_SEED,
    LoraRef,
    VllmBlockHasher,
    none_hash_reproducible,
    resolve_none_hash_seed,
    sglang_namespace_seed,
    sglang_namespaced_hash,
    sglang_page_hash,
    sglang_page_hashes,
    sglang_salt_prior,
    sglang_wire_hash,
    vllm_event_extra_keys,
    vllm_extra_keys,
    vllm_hash_fn,
    vllm_none_hash,
    vllm_wire_hash,
)

TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]


# --- vLLM §9.1 ------------------------------------------------------------------------------------


def test_cbor_of_default_seed_and_none_hash() -> None:
    assert cbor2.dumps(DEFAULT_NONE_HASH_SEED, canonical=True).hex() == "6e766c6c6d2d6e6f6e652d68617368"
    assert vllm_none_hash("sha256_cbor").hex() == (
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0")


def test_sha256_cbor_block_digests_and_wire_ints() -> None:
    hasher = VllmBlockHasher("sha256_cbor")
    none_hash = hasher.none_hash
    encoded = cbor2.dumps((none_hash, (1, 2, 3, 4), None), canonical=True)
    assert encoded.hex() == "835820" + none_hash.hex() + "84" + "01020304" + "f6"
    b0, b1 = hasher.block_hashes(TOKENS, 4)
    assert b0.hex() == "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111"
    assert b1.hex() == "e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1"
    assert vllm_wire_hash(b0) == 0x84B146B151D55111 == 9561501211280363793
    assert vllm_wire_hash(b1) == 0xD43B57DF56B58FB1 == 15292913576410714033


@pytest.mark.parametrize(("algo", "seed", "none_hex", "wires"), [
    ("sha256_cbor", None, "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
     [9561501211280363793, 15292913576410714033]),
    ("sha256", None, "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
     [1882140585328457242, 15284023028817948126]),
    ("sha256_cbor", "0", "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
     [2164874634404590027, 17270480062156288726]),
    ("sha256", "0", "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
     [10362225831949560093, 12472515041799373675]),
    # xxhash pair: computed by vLLM 0.33.0's own vllm/utils/hashing.py + kv_cache_utils.py (the seed is
    # PYTHONHASHSEED: without it vLLM draws a random one; see test_vllm_hashing_real.py for the live check).
    ("xxhash", "0", "6fb31cc38bba6066183f7f2104b9c051", [5138823041740264343, 1324190186712315504]),
    ("xxhash", "vllm-none-hash", "d98f72b9c430d985211489af307f0229",
     [16027864559667985086, 4133263525950419709]),
    ("xxhash_cbor", "0", "1ebe36576dcb573f26b99533a20aaeca", [1560721706249274670, 16652244415917022755]),
    ("xxhash_cbor", "vllm-none-hash", "a4e364baa0791a6f63bbf917db9b700d",
     [15832582268029990071, 6053360263242172844]),
])
def test_vllm_vectors_per_algo_and_seed(algo: str, seed: str | None, none_hex: str, wires: list[int]) -> None:
    hasher = VllmBlockHasher(algo, seed)
    assert hasher.none_hash.hex() == none_hex
    assert vllm_none_hash(algo, seed) == hasher.none_hash
    assert [vllm_wire_hash(h) for h in hasher.block_hashes(TOKENS, 4)] == wires


def test_xxhash_digests_are_16_bytes_of_xxh3_128() -> None:
    hasher = VllmBlockHasher("xxhash_cbor", "0")
    b0, b1 = hasher.block_hashes(TOKENS, 4)
    assert (b0.hex(), b1.hex()) == ("0a8577df5ee3430515a8cc1f6e3ac52e", "d152782cb4d753bde718a811a3b75e23")
    # The same CBOR bytes as sha256_cbor, only the digest differs: XXH3-128 with xxhash seed 0.
    assert b0 == xxhash.xxh3_128_digest(cbor2.dumps((hasher.none_hash, (1, 2, 3, 4), None), canonical=True))
    assert VllmBlockHasher("xxhash", "0").block_hashes(TOKENS, 4)[0].hex() == "f3856cedd7e636094750c4546e855397"


@pytest.mark.parametrize(("algo", "salted", "lora"), [
    ("xxhash", [13875744322483724580, 2178400585005859192], [7458967791414903428, 9046735134021471802]),
    ("xxhash_cbor", [11672171116688799424, 12309515964919378285], [302391529724431961, 10442341121064655963]),
])
def test_xxhash_salt_and_lora_vectors(algo: str, salted: list[int], lora: list[int]) -> None:
    hasher = VllmBlockHasher(algo, "0")
    assert [vllm_wire_hash(h) for h in hasher.block_hashes(TOKENS, 4, cache_salt="tenant-a")] == salted
    ref = LoraRef("sql-lora", "/adapters/sql")
    assert [vllm_wire_hash(h) for h in hasher.block_hashes(TOKENS, 4, lora=ref)] == lora


def test_xxhash_without_pythonhashseed_is_random_per_process() -> None:
    """vLLM's resolve_none_hash_seed: the xxhash pair gets os.urandom(32).hex() when PYTHONHASHSEED is unset."""
    for algo in ("xxhash", "xxhash_cbor"):
        a, b = resolve_none_hash_seed(None, env={}, algo=algo), resolve_none_hash_seed(None, env={}, algo=algo)
        assert a != b and len(a) == 64 and int(a, 16) >= 0
        assert VllmBlockHasher(algo).none_hash != VllmBlockHasher(algo).none_hash
        assert resolve_none_hash_seed(None, env={"PYTHONHASHSEED": "7"}, algo=algo) == "7"
        assert not none_hash_reproducible(algo, None) and none_hash_reproducible(algo, "7")
    for algo in ("sha256", "sha256_cbor"):
        assert resolve_none_hash_seed(None, env={}, algo=algo) == DEFAULT_NONE_HASH_SEED
        assert none_hash_reproducible(algo, None)


def test_cache_salt_vector_and_first_block_only() -> None:
    hasher = VllmBlockHasher("sha256_cbor")
    salted = hasher.block_hashes(TOKENS, 4, cache_salt="tenant-a")
    assert [vllm_wire_hash(h) for h in salted] == [4280308768446823598, 5400091051297473476]
    assert vllm_extra_keys(0, cache_salt="tenant-a") == (("cache_salt", "tenant-a"),)
    assert vllm_extra_keys(4, cache_salt="tenant-a") is None


def test_lora_vector_on_every_block() -> None:
    hasher = VllmBlockHasher("sha256_cbor")
    lora = LoraRef("sql-lora", "/adapters/sql")
    assert [vllm_wire_hash(h) for h in hasher.block_hashes(TOKENS, 4, lora=lora)] == [
        3662046965970426350, 6278496880037812645]
    assert vllm_extra_keys(4, lora=lora) == (("lora", "sql-lora", "/adapters/sql"),)
    # The path is hashed but never published: a different path gives different hashes.
    other = hasher.block_hashes(TOKENS, 4, lora=LoraRef("sql-lora", "/elsewhere"))
    assert other[0] != hasher.block_hashes(TOKENS, 4, lora=lora)[0]


def test_event_extra_keys_are_untagged() -> None:
    lora = LoraRef("sql-lora", "/adapters/sql")
    assert vllm_event_extra_keys(vllm_extra_keys(0, cache_salt="tenant-a")) == ("tenant-a",)
    assert vllm_event_extra_keys(vllm_extra_keys(0, lora=lora)) == ("sql-lora",)
    assert vllm_event_extra_keys(vllm_extra_keys(0, cache_salt="s", lora=lora)) == ("sql-lora", "s")
    assert vllm_event_extra_keys(None) is None


def test_pythonhashseed_overrides_default_seed() -> None:
    assert resolve_none_hash_seed(None, env={}) == "vllm-none-hash"
    assert resolve_none_hash_seed(None, env={"PYTHONHASHSEED": "0"}) == "0"
    assert resolve_none_hash_seed("explicit", env={"PYTHONHASHSEED": "0"}) == "explicit"


def test_unknown_algo_is_rejected() -> None:
    with pytest.raises(ValueError, match="xxhash_cbor"):
        vllm_hash_fn("md5")


def test_partial_block_is_not_hashed() -> None:
    hasher = VllmBlockHasher()
    assert len(hasher.block_hashes(list(range(1, 31)), 16)) == 1
    assert hasher.block_hashes(list(range(1, 16)), 16) == []


@given(st.lists(st.integers(0, 200_000), max_size=80), st.integers(0, 5),
       st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]))
def test_chunked_hashing_equals_one_shot(tokens: list[int], split_blocks: int, algo: str) -> None:
    hasher = VllmBlockHasher(algo, "0")
    whole = hasher.block_hashes(tokens, 8, cache_salt="s")
    head = hasher.block_hashes(tokens[: split_blocks * 8], 8, cache_salt="s")
    tail = hasher.block_hashes(tokens, 8, start_block=len(head), parent=head[-1] if head else None,
                               cache_salt="s")
    assert head + tail == whole


# --- SGLang §9.3 ----------------------------------------------------------------------------------


def test_sglang_pages_of_four() -> None:
    d0, d1 = sglang_page_hashes(TOKENS, 4)
    assert d0.hex() == "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
    assert d1.hex() == "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"
    assert [sglang_wire_hash(d) for d in (d0, d1)] == [-3488128144981237669, 5674439469042975057]


def test_sglang_branch_continues_from_parent_digest() -> None:
    (d0,) = sglang_page_hashes([1, 2, 3, 4], 4)
    (branch,) = sglang_page_hashes([11, 12, 13, 14], 4, prior=d0)
    assert sglang_wire_hash(branch) == -1085141225147335203
    assert sglang_page_hashes([1, 2, 3, 4, 11, 12, 13, 14], 4)[1] == branch


def test_sglang_page_size_one() -> None:
    digests = sglang_page_hashes([1, 2, 3], 1)
    assert [d.hex()[:8] for d in digests] == ["67abdd72", "e95092c4", "65a83b15"]
    assert [sglang_wire_hash(d) for d in digests] == [
        7470307888890966271, -1634645291211865391, 7325169757385981536]


def test_sglang_salt_prior() -> None:
    assert sglang_salt_prior("s1") == hashlib.sha256(b"sglang-cache-salt-v1\x00s1").digest()
    (d0,) = sglang_page_hashes([1, 2, 3, 4], 4, cache_salt="s1")
    assert sglang_wire_hash(d0) == 8751685944416650314


def test_sglang_namespace() -> None:
    seed = sglang_namespace_seed("abc", None)
    assert seed.hex() == "170dcaf62c4aab8eb1ae872b057b417d07cade5f809549a03341951934440855"
    assert sglang_namespaced_hash(-3488128144981237669, seed) == -4658327497187630698


def test_sglang_wide_token_ids_switch_to_marked_uint64() -> None:
    big = 1 << 33
    expected = hashlib.sha256(b"\xff" + b"".join(t.to_bytes(8, "little") for t in (1, big))).digest()
    assert sglang_page_hash(None, [1, big]) == expected
    assert sglang_page_hashes([1, 2, 3], 2) == sglang_page_hashes([1, 2], 2)
