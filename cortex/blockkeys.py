"""Cortex's own block keys: a chained 64-bit hash of token ids, independent of any engine's hash seed.

key(block i) = XXH3-64(little-endian uint32 token ids of block i, seed = key(block i-1)),
key(block -1) = root(namespace), where the namespace holds what the engines fold into their hashes
besides tokens (LoRA adapter, cache_salt). Events and prompts are keyed by the same function, so a
prompt's key sequence meets the ledger exactly where the engine's cache does. Only full blocks are
keyed: engines never cache a partial block. Key 0 is reserved (it marks an empty slot in the shared
ledger view), so a hash that lands on 0 is mapped to 1.

A block the engine hashes with more than its tokens (a media item's `(identifier, offset)`, a prompt-embeds
digest: vLLM's per-block extra keys other than the LoRA name and cache salt, which are the chain's namespace)
has those keys folded in: its key hashes the token bytes followed by `extras_suffix(...)`. The suffix is never
empty, so such a block's key never equals a text-only block's with the same token ids, and a media block is
matched only by a prompt whose same item sits at the same place (docs/ledger.md, "Media").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import xxhash

_ROOT_DOMAIN = b"cortex-block-key-v1\x00"
_EXTRAS_DOMAIN = b"\x00cortex-extra-keys-v1\x00"
_encode = msgspec.msgpack.Encoder().encode


def root_key(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The seed of a chain: requests that differ in adapter or salt never share a block."""
    parts = bytearray(_ROOT_DOMAIN)
    for part in (lora_name, cache_salt):
        if part is None:
            parts += b"\x00"
        else:
            raw = part.encode()
            parts += b"\x01" + len(raw).to_bytes(4, "little") + raw
    return _nonzero(xxhash.xxh3_64_intdigest(bytes(parts)))


def _nonzero(key: int) -> int:
    return key or 1


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The bytes a block key hashes: each token id as a little-endian uint32."""
    return np.asarray(token_ids, dtype="<u4").tobytes()


def block_key(block: bytes, parent: int) -> int:
    """One step of the chain: the key of the block whose token_bytes are `block`, following `parent` (a root
    key or the previous block's key). The ledger keys engine pages with it as they complete a Cortex block."""
    return _nonzero(xxhash.xxh3_64_intdigest(block, seed=parent))


def _full_blocks(token_ids: Sequence[int] | np.ndarray, block_size: int,
                 max_blocks: int | None) -> tuple[bytes, int]:
    """The token bytes of the full blocks to key (at most `max_blocks`), and how many there are."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    tokens = np.asarray(token_ids, dtype=np.uint32)
    n_blocks = len(tokens) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    return token_bytes(tokens[: n_blocks * block_size]), n_blocks


def chain_keys(token_ids: Sequence[int] | np.ndarray, block_size: int, parent: int,
               max_blocks: int | None = None) -> list[int]:
    """Keys of the full blocks of `token_ids`, chained from `parent` (a root key or a previous block's key).

    Chunked hashing equals one-shot hashing: chain_keys(a + b, parent=r) ==
    chain_keys(a) + chain_keys(b, parent=last key of a) when len(a) is a multiple of block_size.
    """
    raw, n_blocks = _full_blocks(token_ids, block_size, max_blocks)
    stride = block_size * 4
    keys: list[int] = []
    # block_key's step, inlined: the call per block would cost ~15% of this loop, which runs per request
    # (tests/test_blockkeys.py holds the two equal).
    digest = xxhash.xxh3_64_intdigest
    key = parent
    for start in range(0, n_blocks * stride, stride):
        key = digest(raw[start:start + stride], seed=key) or 1
        keys.append(key)
    return keys


def content_extras(block_extra_keys: Sequence[Any] | None) -> list[Any]:
    """The extra keys of one block that describe its content rather than its namespace: everything but the
    strings (the LoRA name on every block, the cache salt on the first: both already in the root key). For vLLM:
    `[identifier, offset]` pairs of media items and prompt-embeds digests (bytes), in the engine's order."""
    if not block_extra_keys:
        return []
    return [k for k in block_extra_keys if not isinstance(k, str)]


def extras_suffix(extras: Sequence[Any]) -> bytes:
    """The bytes a block's content extra keys add after its token bytes (b"" for none). Pairs may be lists or
    tuples: both encode alike, so the ledger (events) and extproc (prompts) produce the same suffix."""
    if not extras:
        return b""
    return _EXTRAS_DOMAIN + _encode(list(extras))


def event_suffixes(extra_keys: Sequence[Any] | None) -> dict[int, bytes]:
    """Per block index of a BlockStored, the suffix its content extra keys add ({} when no block has any: the
    common text-only event, whose extra keys are absent or hold only namespace strings)."""
    out: dict[int, bytes] = {}
    if not extra_keys or not any(extra_keys):
        return out
    for i, block in enumerate(extra_keys):
        if block and not isinstance(block, str):
            content = content_extras(block)
            if content:
                out[i] = extras_suffix(content)
    return out


def chain_keys_with(token_ids: Sequence[int] | np.ndarray, block_size: int, parent: int,
                    suffixes: dict[int, bytes], max_blocks: int | None = None) -> list[int]:
    """chain_keys where block i's bytes are followed by `suffixes[i]` when present (extras_suffix)."""
    if not suffixes:
        return chain_keys(token_ids, block_size, parent, max_blocks)
    raw, n_blocks = _full_blocks(token_ids, block_size, max_blocks)
    stride = block_size * 4
    keys: list[int] = []
    key = parent
    for i in range(n_blocks):
        block = raw[i * stride:(i + 1) * stride]
        suffix = suffixes.get(i)
        key = block_key(block + suffix if suffix else block, key)
        keys.append(key)
    return keys
