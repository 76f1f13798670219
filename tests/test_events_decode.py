"""Decoding real engine payloads: the byte vectors in kv-events.md §9, produced by vLLM 0.33 / SGLang 0.5.23."""

from __future__ import annotations

import msgspec
import pytest

from ingest.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, decode_batch, wire_hash

VLLM_STORED = bytes.fromhex(
    "93cb41d954fc4000000091de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf84b146b1"
    "51d55111cfd43b57df56b58fb1b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708"
    "aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b"
    "65797392c0c0a967726f75705f6964780000")
VLLM_REMOVED = bytes.fromhex(
    "93cb41d954fc404000009284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf84b146b151d5"
    "5111a66d656469756da3475055a967726f75705f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68"
    "617368657391cfd43b57df56b58fb1a66d656469756da3475055a967726f75705f6964780000")
VLLM_CONTINUE_AND_CLEAR = bytes.fromhex(
    "93cb3ff800000000000092de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfd43b57df56"
    "b58fb1b1706172656e745f626c6f636b5f68617368cf84b146b151d55111a9746f6b656e5f6964739405060708aa626c6f636b"
    "5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c081a474797065b0416c6c426c6f63"
    "6b73436c656172656401")
SGLANG_STORED = bytes.fromhex(
    "93cb3ff00000000000009187a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d3cf97adeedb59e0"
    "5bcf4ebfa8a1f3c34151b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c"
    "6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347505500")


def test_vllm_block_stored_vector() -> None:
    batch = decode_batch(VLLM_STORED)
    assert batch.ts == 1700000000.0 and batch.dp_rank == 0 and not batch.errors
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [9561501211280363793, 15292913576410714033]
    assert ev.parent_block_hash is None
    assert ev.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert ev.block_size == 4 and ev.medium == "GPU" and ev.group_idx == 0
    assert ev.extra_keys == [None, None]


def test_vllm_removed_one_event_per_block() -> None:
    batch = decode_batch(VLLM_REMOVED)
    assert [type(e) for e in batch.events] == [BlockRemoved, BlockRemoved]
    removed = [e for e in batch.events if isinstance(e, BlockRemoved)]  # all of them, as just asserted
    assert [e.block_hashes for e in removed] == [[9561501211280363793], [15292913576410714033]]


def test_vllm_continuation_with_parent_and_clear() -> None:
    batch = decode_batch(VLLM_CONTINUE_AND_CLEAR)
    assert batch.dp_rank == 1
    stored, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(cleared, AllBlocksCleared)
    assert stored.parent_block_hash == 9561501211280363793
    assert stored.token_ids == [5, 6, 7, 8]


def test_sglang_signed_hashes_become_unsigned() -> None:
    (ev,) = decode_batch(SGLANG_STORED).events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [-3488128144981237669 & (2**64 - 1), 5674439469042975057]


def test_positional_events_from_older_releases() -> None:
    old_vllm = ["BlockStored", [1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None, [None, None], 0]
    old_sglang = ["BlockStored", [-5], 7, [9, 9], 2, None, None]
    removed = ["BlockRemoved", [1], "GPU", 0]
    payload = msgspec.msgpack.encode([1.0, [old_vllm, old_sglang, removed, ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert batch.dp_rank is None and not batch.errors
    a, b, c, d = batch.events
    assert isinstance(a, BlockStored) and a.block_hashes == [1, 2] and a.medium == "GPU"
    assert isinstance(b, BlockStored) and b.parent_block_hash == 7 and b.block_hashes == [(-5) & (2**64 - 1)]
    assert isinstance(c, BlockRemoved) and isinstance(d, AllBlocksCleared)


def test_bytes_hashes_use_the_last_eight_bytes() -> None:
    digest = bytes.fromhex("58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111")
    assert wire_hash(digest) == 9561501211280363793


def test_unknown_event_costs_that_event_only() -> None:
    """An event of a type Cortex does not know (a newer engine's) is skipped and counted apart; a malformed one is
    an error; neither costs the rest of the batch."""
    good = {"type": "AllBlocksCleared", "future_field": 1}
    payload = msgspec.msgpack.encode([1.0, [{"type": "Teleported"}, 5, ["Beamed", 1], good], 0])
    batch = decode_batch(payload)
    assert len(batch.events) == 1 and isinstance(batch.events[0], AllBlocksCleared)
    assert batch.unknown == ["Teleported", "Beamed"]
    assert len(batch.errors) == 1


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode({"a": 1}),
                                     msgspec.msgpack.encode([1.0])])
def test_not_a_batch(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)
