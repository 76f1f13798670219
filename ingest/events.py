"""Decode engine KV-event batches (vLLM and SGLang, ZMQ + msgpack) into engine-neutral events.

Wire facts (../shared/reference/kv-events.md §1-§5; the engines' own schemas are cortex/kv_events.py, this is
the lenient read of them): a batch is the positional array [ts, events, dp_rank]
(older releases may omit the rank); each event is a map tagged by "type" (vLLM >= 0.24, SGLang >= 0.5.20)
or, in older releases, a positional array whose first element is the tag. Hashes are 64-bit ints (vLLM:
unsigned, SGLang: signed) or raw digests as msgpack bin (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0;
its int form is the digest's last 8 bytes, so that is what bytes are reduced to). Events are decoded one by
one so an unknown or malformed event costs that event, never the batch; every such loss is counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from cortex import kv_events


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    cache_salt: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    """vLLM: the KV-cache group's kind (full_attention, sliding_window, mamba, ...); None: not said (one group)."""
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    """LOCAL / REMOTE relative to the publisher (offloading tiers); None: unspecified."""
    ownership: str | None = None
    """A secondary offloading tier's id; a copy under another ownership is another copy."""
    lookahead: int = 0
    """Tokens after each block that vLLM folded into its hash (`lookahead_token_ids`, speculative drafters): the
    last block of a hit also needs them to match (ingest/ledger.py)."""


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class BlockInactive(msgspec.Struct, tag="BlockInactive", tag_field="type"):
    """A block no request references any more, still cached (vllm-project/vllm#50732, in review): no change to
    what the engine holds."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared | BlockInactive


class _WireStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    """The current map layout, decoded in C; hashes may still be signed or bytes until normalised. Fields Cortex
    does not use (lora_id, session_id) are skipped by the decoder."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    cache_salt: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _WireRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _WireInactive(msgspec.Struct, tag="BlockInactive", tag_field="type"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


_typed = msgspec.msgpack.Decoder(
    tuple[float, list[_WireStored | _WireRemoved | AllBlocksCleared | _WireInactive], int | None])


@dataclass(slots=True)
class Batch:
    ts: float
    events: list[Event]
    dp_rank: int | None
    errors: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    """Tags of events of a type Cortex does not know (skipped and counted: a newer engine's event is no error)."""


class DecodeError(ValueError):
    """The payload is not a KV-event batch at all (the whole batch is lost)."""


def wire_hash(value: Any) -> int:
    """An engine block hash as an unsigned 64-bit int, whatever form it took on the wire."""
    if isinstance(value, bool):
        raise DecodeError("boolean where a block hash was expected")
    if isinstance(value, int):
        return value & 0xFFFF_FFFF_FFFF_FFFF
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            raise DecodeError("empty bytes block hash")
        return int.from_bytes(raw[-8:], "big")
    raise DecodeError(f"block hash of type {type(value).__name__}")


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise DecodeError("block_hashes is not a list")
    return [wire_hash(v) for v in value]


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _lookahead(value: Any) -> int:
    """Tokens folded into each block's hash after it: the longest of `lookahead_token_ids`' lists (0 for none)."""
    if not isinstance(value, list):
        return 0
    return max((len(v) for v in value if isinstance(v, list)), default=0)


class UnknownEvent(DecodeError):
    """An event of a type Cortex does not know: skipped and counted, not an error."""

    def __init__(self, tag: str) -> None:
        super().__init__(f"unknown event type {tag!r}")
        self.tag = tag


# Positional layouts of older releases, after the tag: the engine schema's fields in order (kv-events.md §5).
# SGLang's old BlockStored is a prefix of vLLM's, so vLLM's order serves both.
_POSITIONAL: dict[str, tuple[str, ...]] = {
    cls.__struct_config__.tag: cls.__struct_fields__  # type: ignore[misc]
    for cls in (kv_events.BlockStored, kv_events.BlockRemoved, kv_events.AllBlocksCleared, kv_events.BlockInactive)
}


def decode_event(raw: Any) -> Event:
    if isinstance(raw, dict):
        fields = raw
        tag = raw.get("type")
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _POSITIONAL.get(tag)
        if names is None:
            raise UnknownEvent(tag)
        fields = dict(zip(names, raw[1:], strict=False))
        # SGLang 0.5.18-0.5.19 appended a {cache_salt, session_id} map to salted stores.
        if tag == "BlockStored" and len(raw) == 8 and isinstance(raw[7], dict):
            fields.pop("lora_name", None)
            fields["cache_salt"] = raw[7].get("cache_salt")
    else:
        raise DecodeError(f"event is a {type(raw).__name__}, not a map or tagged array")
    if tag == "BlockStored":
        tokens = fields.get("token_ids")
        block_size = fields.get("block_size")
        if not isinstance(tokens, list) or not isinstance(block_size, int):
            raise DecodeError("BlockStored without token_ids or block_size")
        if not all(type(t) is int for t in tokens):
            raise DecodeError("BlockStored token_ids are not plain token ids (e.g. EAGLE bigram payload)")
        parent = fields.get("parent_block_hash")
        extra = fields.get("extra_keys")
        return BlockStored(_hashes(fields.get("block_hashes")), None if parent is None else wire_hash(parent),
                           tokens, block_size, lora_name=_opt_str(fields.get("lora_name")),
                           medium=_opt_str(fields.get("medium")), cache_salt=_opt_str(fields.get("cache_salt")),
                           extra_keys=extra if isinstance(extra, list) else None,
                           group_idx=_opt_int(fields.get("group_idx")),
                           kv_cache_spec_kind=_opt_str(fields.get("kv_cache_spec_kind")),
                           kv_cache_spec_sliding_window=_opt_int(fields.get("kv_cache_spec_sliding_window")),
                           locality=_opt_str(fields.get("locality")), ownership=_opt_str(fields.get("ownership")),
                           lookahead=_lookahead(fields.get("lookahead_token_ids")))
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(fields.get("block_hashes")), medium=_opt_str(fields.get("medium")),
                            group_idx=_opt_int(fields.get("group_idx")), locality=_opt_str(fields.get("locality")),
                            ownership=_opt_str(fields.get("ownership")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockInactive":
        return BlockInactive(_hashes(fields.get("block_hashes")), medium=_opt_str(fields.get("medium")),
                             group_idx=_opt_int(fields.get("group_idx")))
    if not isinstance(tag, str):
        raise DecodeError("event without a type tag")
    raise UnknownEvent(tag)


_decoder = msgspec.msgpack.Decoder()


def _norm(hashes: list[int | bytes]) -> list[int]:
    try:
        if min(hashes) >= 0:  # type: ignore[operator]  # all unsigned ints: vLLM's default form
            return hashes  # type: ignore[return-value]
    except (TypeError, ValueError):  # bytes among them, or empty
        pass
    return [wire_hash(h) for h in hashes]


def _from_wire(ev: _WireStored | _WireRemoved | AllBlocksCleared | _WireInactive) -> Event:
    if isinstance(ev, _WireStored):
        parent = ev.parent_block_hash
        return BlockStored(_norm(ev.block_hashes), None if parent is None else wire_hash(parent), ev.token_ids,
                           ev.block_size, ev.lora_name, ev.medium, ev.cache_salt, ev.extra_keys, ev.group_idx,
                           ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, ev.locality, ev.ownership,
                           _lookahead(ev.lookahead_token_ids) if ev.lookahead_token_ids else 0)
    if isinstance(ev, _WireRemoved):
        return BlockRemoved(_norm(ev.block_hashes), ev.medium, ev.group_idx, ev.locality, ev.ownership)
    if isinstance(ev, _WireInactive):
        return BlockInactive(_norm(ev.block_hashes), ev.medium, ev.group_idx)
    return ev


def decode_batch(payload: bytes) -> Batch:
    """Decode one batch. The current layout (map events, 3-element batch) takes a typed C decoder; anything
    else (older positional events, unknown event types, odd payloads) falls back to a per-event decoder
    that keeps whatever it can."""
    try:
        ts, events, rank = _typed.decode(payload)
        return Batch(ts=ts, events=[_from_wire(e) for e in events], dp_rank=rank)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3) or not isinstance(raw[1], list):
        raise DecodeError("payload is not a [ts, events, dp_rank] batch")
    ts = raw[0] if isinstance(raw[0], int | float) else 0.0
    dp_rank = _opt_int(raw[2]) if len(raw) == 3 else None
    batch = Batch(ts=float(ts), events=[], dp_rank=dp_rank)
    for item in raw[1]:
        try:
            batch.events.append(decode_event(item))
        except UnknownEvent as exc:
            batch.unknown.append(exc.tag)
        except DecodeError as exc:
            batch.errors.append(str(exc))
    return batch
