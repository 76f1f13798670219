"""The engines' KV-event wire facts, written once: vLLM 0.33's and SGLang 0.5.23's schemas and framing.

The simulator's publisher (cortexsim/kv_events.py) encodes with these Structs, so its bytes are the
engines'; ingest (ingest/events.py, ingest/source.py) decodes what they describe, leniently, into
engine-neutral events. Tests check them against the engines' own publisher classes from the wheels
(tests/sim/test_real_engine_decode.py, tests/test_real_publishers_e2e.py).

Schemas (kv-events.md §2, §4.1): events are msgspec Structs with ``tag=True, omit_defaults=True`` (msgpack
maps tagged ``"type"``, required fields always present, defaulted fields omitted when default) and the batch
is ``array_like=True``. vLLM's batch is ``[ts, events, data_parallel_rank]`` (msgspec 0.23 keeps the trailing
rank despite ``omit_defaults``); SGLang's own copy has no ``omit_defaults`` and names the rank
``attn_dp_rank``, and its ``BlockStored`` has a different field set (``medium`` defaulted,
``cache_salt``/``session_id``/``lora_name``, no ``extra_keys``). Field order and defaults match
``vllm/distributed/kv_events.py`` and ``sglang/srt/disaggregation/kv_events.py`` so the encoded bytes are
identical to the engines'. Older releases sent the same events as positional arrays in this field order
(fields are only ever appended; kv-events.md §5). SGLang hashes are signed int64s, which msgpack encodes as
``d3`` when negative.

Transport (§1): a PUB socket sends ``[topic, seq (8 B big-endian, from 0), payload]`` per batch; an optional
ROUTER answers ``[identity, b"", start_seq]`` with every buffered batch ``seq >= start_seq`` as
``[identity, b"", topic, seq, payload]`` and then the end marker ``[identity, b"", b"", END_SEQ, b""]``.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

# Where a block lives, as Cortex ranks hits: the engines' `medium` values folded into three tiers. vLLM's GPU pool
# sends "GPU" (also on CPU builds), its OffloadingConnector "CPU" / "STORAGE" (vllm/distributed/kv_events.py);
# SGLang 0.5.23's StorageMedium is GPU / CPU_PINNED / DISK / EXTERNAL (HiCache: device, host, storage), and an
# earlier SGLang sent CPU_TIER1 / CPU_TIER2 for its L2 / L3 (sgl-project/sglang#18205). No medium (older
# publishers) is the GPU. Anything else is unknown: counted, never applied (ingest/events.py).
TIER_GPU, TIER_CPU, TIER_STORAGE = "GPU", "CPU", "STORAGE"
TIERS = (TIER_GPU, TIER_CPU, TIER_STORAGE)
MEDIUM_TIERS: dict[str | None, str] = {
    None: TIER_GPU, "GPU": TIER_GPU, "gpu": TIER_GPU,
    "CPU": TIER_CPU, "cpu": TIER_CPU, "CPU_PINNED": TIER_CPU, "CPU_TIER1": TIER_CPU,
    "STORAGE": TIER_STORAGE, "DISK": TIER_STORAGE, "EXTERNAL": TIER_STORAGE, "CPU_TIER2": TIER_STORAGE,
}

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of a replay's end marker (ff * 8)."""


# --- schema ---------------------------------------------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class BlockInactive(KVCacheEvent):
    """In review for vLLM (vllm-project/vllm#50732, not in 0.32/0.33): a GPU block no request references any more,
    still cached. Not part of KVEventBatch's union here, as upstream has not released it; the simulator never
    sends it. Cortex decodes it and leaves the ledger unchanged (the block is still held)."""

    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- SGLang 0.5.23 schema ------------------------------------------------------------------------


class SglEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SglKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of SGLang's tagged events; the tags are the engine's class names."""


class SglBlockStored(SglKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglBlockRemoved(SglKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SglAllBlocksCleared(SglKVCacheEvent, tag="AllBlocksCleared"):
    pass


class SglKVEventBatch(SglEventBatch):
    events: list[SglBlockStored | SglBlockRemoved | SglAllBlocksCleared]


AnyEvent = BlockStored | BlockRemoved | AllBlocksCleared | SglBlockStored | SglBlockRemoved | SglAllBlocksCleared
AnyBatch = KVEventBatch | SglKVEventBatch

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_sgl_decoder = msgspec.msgpack.Decoder(SglKVEventBatch)


def encode_batch(batch: AnyBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Strict decode into vLLM's schema (for tests and tools; a gateway should decode leniently)."""
    return _decoder.decode(payload)


def decode_sglang_batch(payload: bytes) -> SglKVEventBatch:
    """Strict decode into SGLang's schema."""
    return _sgl_decoder.decode(payload)
