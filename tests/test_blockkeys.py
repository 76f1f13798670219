from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cortex.blockkeys import block_key, chain_keys, root_key, token_bytes

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=200)


def test_only_full_blocks_are_keyed() -> None:
    assert chain_keys(list(range(31)), 16, root_key()) == chain_keys(list(range(16)), 16, root_key())
    assert len(chain_keys(list(range(48)), 16, root_key())) == 3
    assert chain_keys([], 16, root_key()) == []


def test_namespaces_separate_chains() -> None:
    t = list(range(16))
    roots = {root_key(), root_key("a"), root_key(None, "a"), root_key("a", "b"), root_key("ab")}
    assert len(roots) == 5
    assert len({chain_keys(t, 16, r)[0] for r in roots}) == 5


def test_max_blocks_and_bad_size() -> None:
    assert len(chain_keys(list(range(64)), 16, 7, max_blocks=2)) == 2
    with pytest.raises(ValueError):
        chain_keys([1], 0, 7)


@given(tokens, tokens)
def test_chunked_hashing_equals_one_shot(a: list[int], b: list[int]) -> None:
    a = a[: len(a) // 8 * 8]
    whole = chain_keys(a + b, 8, root_key())
    first = chain_keys(a, 8, root_key())
    rest = chain_keys(b, 8, first[-1] if first else root_key())
    assert whole == first + rest


@given(tokens)
def test_prefix_stable_and_nonzero(t: list[int]) -> None:
    keys = chain_keys(t, 4, root_key())
    assert keys == chain_keys([*t, 1, 2, 3, 4], 4, root_key())[: len(keys)]
    assert all(0 < k < 2**64 for k in keys)


def test_key_depends_on_position_not_only_tokens() -> None:
    t = [5] * 16
    k = chain_keys(t + t, 16, root_key())
    assert k[0] != k[1]


# Golden vectors: Cortex's own key function, pinned literally (like the engine hashes in test_engine_hashes.py).
# Keys are shared between processes and releases (the ledger view, predictions, a rolling restart): any change
# to the domain, the namespace encoding, the token bytes or the chain step must fail here, loudly.
CHAT = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 9707, 151645]


def test_golden_roots() -> None:
    assert root_key() == 0xF003D0A74180CFB0
    assert root_key("adapter-a") == 0x7DCBA46F4F83A7BF
    assert root_key(None, "salt-1") == 0x77A14A273E0A9237
    assert root_key("adapter-a", "salt-1") == 0xC67B546B10EA69F1
    assert root_key("") == 0x2FB71FCB38983958  # an empty name is a name, not None


def test_golden_chains() -> None:
    assert chain_keys(list(range(32)), 16, root_key()) == [0xBEE2C9DB7ADD0A18, 0xF53DB4E816EC6BC0]
    assert chain_keys(CHAT, 4, root_key("adapter-a", "salt-1")) == [
        0xC7362155F47B6791, 0xA96DCA8AD7F61555, 0xDFBA83BB98265662, 0xE88AF30A0A2F6585]
    assert chain_keys([2**32 - 1] * 16, 16, 1) == [0x52D4C09FA5DD813]


def test_golden_step_and_token_bytes() -> None:
    assert token_bytes([1, 256, 2**32 - 1]) == bytes.fromhex("0100000000010000ffffffff")
    assert block_key(b"", 0) == 0x2D06800538D394C2


@given(tokens, st.sampled_from([1, 4, 16]), st.integers(1, 2**64 - 1))
def test_chain_keys_is_the_step_iterated(t: list[int], block_size: int, parent: int) -> None:
    # chain_keys inlines block_key for speed; the ledger calls block_key itself: they must agree.
    raw, stride, key, expected = token_bytes(t), 4 * block_size, parent, []
    for start in range(0, len(t) // block_size * stride, stride):
        key = block_key(raw[start:start + stride], key)
        expected.append(key)
    assert chain_keys(t, block_size, parent) == expected
