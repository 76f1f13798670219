"""The block hashes the engines themselves publish in KV events, reproduced bit for bit.

Two families (kv-events.md §3 and §4.3):

* vLLM 0.33: ``hash_fn((parent_bytes or NONE_HASH, tuple(block_tokens), extra_keys))`` with ``hash_fn`` one
  of ``--prefix-caching-hash-algo`` (``vllm/utils/hashing.py``): the SHA-256 (32-byte digest) or the
  XXH3-128 (``xxhash.xxh3_128_digest``, 16 bytes, no xxhash seed) of either a pickle (protocol
  HIGHEST_PROTOCOL: ``sha256``, vLLM's default, and ``xxhash``) or a canonical CBOR encoding (``sha256_cbor``,
  ``xxhash_cbor``) of that tuple. ``NONE_HASH = hash_fn(seed)`` where the seed is ``PYTHONHASHSEED``'s string
  value if set, else ``"vllm-none-hash"`` for the SHA-256 pair and ``os.urandom(32).hex()`` (random per
  engine process, so not reproducible by anyone else) for the xxhash pair. On the wire a hash is its last
  8 bytes as an unsigned int.
* SGLang 0.5.23: a per-page SHA-256 chain over little-endian uint32 token ids, optionally seeded by a salt
  prior; on the wire the first 8 digest bytes as a signed int64.

Everything here is pure (no engine state); the simulator and the gateway's tests both build on it. Only
full blocks/pages are ever hashed, because neither engine caches a partial one.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import cbor2
import xxhash

VllmHashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
VLLM_HASH_ALGOS: tuple[VllmHashAlgo, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# vLLM's _NON_CRYPTO_HASH_FUNCTIONS: without PYTHONHASHSEED their NONE_HASH seed is random per process.
VLLM_RANDOM_SEED_ALGOS: frozenset[str] = frozenset({"xxhash", "xxhash_cbor"})
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

_U64_MASK = (1 << 64) - 1


# --- vLLM -----------------------------------------------------------------------------------------


def sha256_pickle(obj: Any) -> bytes:
    """vLLM ``sha256``: the digest of the object's pickle, so it is only reproducible from Python."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """vLLM ``sha256_cbor``: the language-independent variant (canonical CBOR, tuples become arrays)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_pickle(obj: Any) -> bytes:
    """vLLM ``xxhash``: XXH3-128 (default xxhash seed 0) of the object's pickle, 16 digest bytes."""
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    """vLLM ``xxhash_cbor``: XXH3-128 of the canonical CBOR encoding, 16 digest bytes."""
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": sha256_pickle, "sha256_cbor": sha256_cbor, "xxhash": xxhash_pickle, "xxhash_cbor": xxhash_cbor}


def vllm_hash_fn(algo: str) -> Callable[[Any], bytes]:
    try:
        return _HASH_FNS[algo]
    except KeyError:
        raise ValueError(f"unsupported vLLM prefix-caching hash algo {algo!r}; "
                         f"expected one of {', '.join(VLLM_HASH_ALGOS)}") from None


def resolve_none_hash_seed(seed: str | None = None, env: Mapping[str, str] | None = None,
                           algo: str = "sha256") -> str:
    """The seed string vLLM hashes into NONE_HASH: an explicit seed, else PYTHONHASHSEED, else the default
    (``"vllm-none-hash"``; a fresh random one for the xxhash pair, as vLLM's ``resolve_none_hash_seed``).

    vLLM reads PYTHONHASHSEED from its own environment; passing `env` lets a caller mirror that for a
    particular worker without touching this process's environment.
    """
    if seed is not None:
        return seed
    environ = os.environ if env is None else env
    from_env = environ.get("PYTHONHASHSEED")
    if from_env is not None:
        return from_env
    return os.urandom(32).hex() if algo in VLLM_RANDOM_SEED_ALGOS else DEFAULT_NONE_HASH_SEED


def none_hash_reproducible(algo: str, seed: str | None) -> bool:
    """Whether a worker's NONE_HASH can be recomputed outside it: `seed` is its PYTHONHASHSEED (None =
    unset), and without one the xxhash pair draws a random seed per engine process."""
    return seed is not None or algo not in VLLM_RANDOM_SEED_ALGOS


def vllm_none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """NONE_HASH, the parent of every chain's first block. `seed` is used verbatim; None resolves as an
    engine with PYTHONHASHSEED unset would (the fixed default, or a random seed for the xxhash pair)."""
    return vllm_hash_fn(algo)(resolve_none_hash_seed(seed, env={}, algo=algo))


def vllm_hash_block_tokens(hash_fn: Callable[[Any], bytes], parent: bytes | None, none_hash: bytes,
                           tokens: Sequence[int], extra_keys: tuple[Any, ...] | None) -> bytes:
    # int() because numpy integers pickle differently from Python ints and would change every hash.
    return hash_fn((parent or none_hash, tuple(int(t) for t in tokens), extra_keys))


@dataclass(frozen=True)
class LoraRef:
    """A LoRA adapter as vLLM 0.33 folds it into block hashes: name and path both count."""

    name: str
    path: str
    int_id: int = 1


def vllm_mm_keys(items: Sequence[tuple[int, int, str]], start: int, end: int) -> list[tuple[str, int]]:
    """``_gen_mm_extra_hash_keys`` for the block [start, end): (identifier, offset - start) of every media item
    (offset, length, identifier; sorted by offset) whose placeholder run overlaps it."""
    return [(ident, offset - start) for offset, length, ident in items if offset < end and offset + length > start]


def vllm_extra_keys(start_token_idx: int, *, cache_salt: str | None = None, lora: LoraRef | None = None,
                    media: Sequence[tuple[str, int]] = ()) -> tuple[Any, ...] | None:
    """``generate_block_hash_extra_keys``: LoRA on every block, then the block's media items ((identifier,
    offset) from vllm_mm_keys), then the salt on the first block."""
    keys: list[tuple[Any, ...]] = []
    if lora is not None:
        keys.append(("lora", lora.name, lora.path))
    keys += [("mm", ident, offset) for ident, offset in media]
    if cache_salt is not None and start_token_idx == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def vllm_event_extra_keys(extra_keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """``to_event_extra_keys``: the published, untagged form (bare lora name, bare salt)."""
    if extra_keys is None:
        return None
    out: list[Any] = []
    for key in extra_keys:
        if isinstance(key, tuple) and key and key[0] in ("lora", "cache_salt"):
            out.append(key[1])
        elif isinstance(key, tuple) and key and key[0] == "mm":
            out.append((key[1], key[2]))
        elif isinstance(key, tuple) and key and key[0] == "prompt_embeds":
            out.append(key[1])
        else:
            out.append(key)
    return tuple(out)


def vllm_wire_hash(block_hash: bytes) -> int:
    """``maybe_convert_block_hash`` in int mode: the last 8 bytes, unsigned."""
    return int.from_bytes(block_hash, "big") & _U64_MASK


class VllmBlockHasher:
    """A vLLM worker's block hasher: algorithm plus NONE_HASH, fixed at engine start like vLLM's."""

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        """`seed` is the NONE_HASH seed string; None resolves as vLLM does with PYTHONHASHSEED unset."""
        self.algo = algo
        self.hash_fn = vllm_hash_fn(algo)
        self.seed = resolve_none_hash_seed(seed, env={}, algo=algo)
        self.none_hash = self.hash_fn(self.seed)

    def hash_block(self, parent: bytes | None, tokens: Sequence[int],
                   extra_keys: tuple[Any, ...] | None = None) -> bytes:
        return vllm_hash_block_tokens(self.hash_fn, parent, self.none_hash, tokens, extra_keys)

    def block_hashes(self, token_ids: Sequence[int], block_size: int, *, start_block: int = 0,
                     parent: bytes | None = None, cache_salt: str | None = None,
                     lora: LoraRef | None = None, media: Sequence[tuple[int, int, str]] = ()) -> list[bytes]:
        """Hashes of the full blocks of `token_ids` from block index `start_block` on.

        `parent` must be the hash of block `start_block - 1` (None for a chain start), which lets a caller
        extend a request's hashes as output tokens arrive without rehashing the prefix.
        """
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        hashes: list[bytes] = []
        for idx in range(start_block, len(token_ids) // block_size):
            start = idx * block_size
            extra = vllm_extra_keys(start, cache_salt=cache_salt, lora=lora,
                                    media=vllm_mm_keys(media, start, start + block_size) if media else ())
            parent = self.hash_block(parent, token_ids[start:start + block_size], extra)
            hashes.append(parent)
        return hashes


# --- SGLang ---------------------------------------------------------------------------------------

_SGLANG_SALT_DOMAIN = b"sglang-cache-salt-v1\x00"
_SGLANG_NAMESPACE_DOMAIN = b"sglang-kv-event-namespace-v1"


def sglang_page_hash(prior: bytes | None, tokens: Sequence[int]) -> bytes:
    """One page of SGLang's chain (``hash_binding.cpp``): SHA-256(prior || LE token ids)."""
    h = hashlib.sha256()
    if prior is not None:
        h.update(prior)
    ids = [int(t) for t in tokens]
    if any(t > 0xFFFFFFFF for t in ids):
        # Ids that do not fit in uint32 switch the whole page to a marked uint64 encoding.
        h.update(b"\xff")
        h.update(b"".join(t.to_bytes(8, "little") for t in ids))
    else:
        h.update(b"".join(t.to_bytes(4, "little") for t in ids))
    return h.digest()


def sglang_salt_prior(cache_salt: str) -> bytes:
    """The prior SGLang's event chain starts from for a salted request."""
    return hashlib.sha256(_SGLANG_SALT_DOMAIN + cache_salt.encode()).digest()


def sglang_page_hashes(token_ids: Sequence[int], page_size: int, *, prior: bytes | None = None,
                       cache_salt: str | None = None) -> list[bytes]:
    """Digests of the full pages of `token_ids`.

    `prior` continues an existing chain; `cache_salt` starts a salted one.
    """
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    if prior is None and cache_salt is not None:
        prior = sglang_salt_prior(cache_salt)
    digests: list[bytes] = []
    for start in range(0, len(token_ids) // page_size * page_size, page_size):
        prior = sglang_page_hash(prior, token_ids[start:start + page_size])
        digests.append(prior)
    return digests


def sglang_wire_hash(digest: bytes) -> int:
    """``hash_str_to_int64``: the first 8 digest bytes, big-endian, as a signed int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


def sglang_namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes:
    parts = bytearray(_SGLANG_NAMESPACE_DOMAIN)
    for part in (extra_key, cache_salt):
        if part is None:
            parts += b"\x00"
        else:
            raw = part.encode()
            parts += b"\x01" + len(raw).to_bytes(8, "little") + raw
    return hashlib.sha256(bytes(parts)).digest()


def sglang_namespaced_hash(wire_hash: int, seed: bytes) -> int:
    """``namespaced_block_hash``: rehash a published int64 under a LoRA/salt namespace seed."""
    digest = hashlib.sha256(seed + wire_hash.to_bytes(8, "big", signed=True)).digest()
    return int.from_bytes(digest[:8], "big", signed=True)
