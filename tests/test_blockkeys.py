from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cortex.blockkeys import chain_keys, root_key

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
