"""Both engines' KV events as they are now, every field decoded tolerantly, and what each does to the ledger.

vLLM 0.32's payloads come from its own classes (tests/fixtures/event_fields.json, produced by
tests/vectors/event_fields_gen.py and re-checked when vLLM is installed): a hybrid model's step with every optional
field (kv_cache_spec_kind and window, locality, ownership, session_id), the offloading connector's location-only
copies (`token_ids=[]`, `block_size=0`) and self-describing ones, a secondary owner's copy on storage. vLLM 0.33's
`lookahead_token_ids` and the in-review `BlockInactive` come from cortex/kv_events.py (held to 0.33's wheel by
tests/sim/test_real_engine_decode.py; BlockInactive as vllm-project/vllm#50732 describes it). SGLang's RFC #39991
layout (no release publishes it yet) is written here from the RFC's text: `medium` and `lora_name` always on the
wire, the salt in `extra_keys`. Unknown event types and media are counted, never applied, never fatal.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from cortex import kv_events
from cortex.blockkeys import chain_keys, root_key
from cortex.contract import TierSlot
from ingest.events import BlockInactive, BlockRemoved, BlockStored, decode_batch
from ingest.ledger import Ledger
from tests.test_hit_rule import _Slots, _vllm_python
from tests.test_ledger import SetSink as Sink

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT / "tests" / "fixtures" / "event_fields.json"
GENERATOR = ROOT / "tests" / "vectors" / "event_fields_gen.py"
DOC = json.loads(VECTORS.read_text())
BS = DOC["block_size"]
TOKENS = DOC["tokens"]
H0, H1 = DOC["wire_hashes"]
K0, K1 = chain_keys(TOKENS, BS, root_key())


def case(name: str) -> bytes:
    return bytes.fromhex(next(c["payload"] for c in DOC["cases"] if c["name"] == name))


def apply(ledger: Ledger, sink: Sink, *names: str) -> None:
    for name in names:
        batch = decode_batch(case(name))
        assert not batch.errors and not batch.unknown, name
        ledger.apply(batch.events, sink)


def fresh() -> tuple[Ledger, Sink]:
    return Ledger(slot=0, engine="vllm", block_size=BS, alloc=_Slots(1)), Sink()


# --- decoding ---------------------------------------------------------------------------------------------------


def test_every_vllm_field_is_read() -> None:
    full, window = decode_batch(case("gpu_store_every_field")).events
    assert isinstance(full, BlockStored) and isinstance(window, BlockStored)
    assert (full.block_hashes, full.parent_block_hash, full.token_ids, full.block_size, full.medium) == \
        ([H0, H1], None, TOKENS, BS, "GPU")
    assert (full.group_idx, full.kv_cache_spec_kind, full.kv_cache_spec_sliding_window) == (0, "full_attention", None)
    assert (window.group_idx, window.kv_cache_spec_kind, window.kv_cache_spec_sliding_window) == (1, "sliding_window",
                                                                                                  5)
    assert window.block_hashes == [H1] and window.token_ids == TOKENS  # the window's block only, all the tokens
    assert (window.locality, window.ownership) == ("LOCAL", None)
    (removed,) = decode_batch(case("gpu_remove")).events
    assert isinstance(removed, BlockRemoved) and (removed.group_idx, removed.locality) == (1, "LOCAL")
    a, b = decode_batch(case("cpu_location_only")).events
    assert isinstance(a, BlockStored) and (a.block_hashes, a.token_ids, a.block_size, a.medium, a.locality) == \
        ([H0], [], 0, "CPU", "LOCAL")
    assert isinstance(b, BlockStored) and b.block_hashes == [H1]
    (owned,) = decode_batch(case("storage_secondary_owner")).events
    assert isinstance(owned, BlockStored) and (owned.medium, owned.locality, owned.ownership) == \
        ("STORAGE", "REMOTE", "kvcr")
    assert decode_batch(case("cleared")).dp_rank == 1


def test_lookahead_token_ids_vllm_033() -> None:
    ev = kv_events.BlockStored(block_hashes=[H0], parent_block_hash=None, token_ids=TOKENS[:4], block_size=BS,
                               lora_id=None, medium="GPU", lora_name=None, lookahead_token_ids=[[5, 6]])
    (got,) = decode_batch(kv_events.encode_batch(kv_events.KVEventBatch(ts=1.0, events=[ev]))).events
    assert isinstance(got, BlockStored) and got.lookahead == 2
    ledger, sink = fresh()
    ledger.apply([got], sink)
    assert ledger.lookahead == 2  # the claim leaves out ceil(2 / 4) = 1 block (TargetMeta.lookahead_blocks)
    assert sink.held[0] == {K0}


def test_block_inactive_is_decoded_and_changes_nothing() -> None:
    """vllm-project/vllm#50732 (in review): a block no request references, still cached."""
    batch = msgspec.msgpack.encode(kv_events.EventBatch(ts=1.0, events=[
        kv_events.BlockInactive(block_hashes=[H1], medium="GPU", group_idx=0)], data_parallel_rank=0))
    (ev,) = decode_batch(batch).events
    assert isinstance(ev, BlockInactive) and ev.block_hashes == [H1]
    ledger, sink = fresh()
    apply(ledger, sink, "gpu_store")
    ledger.apply([ev], sink)
    assert sink.held[0] == {K0, K1} and ledger.events_inactive == 1
    # The older positional layout too.
    (pos,) = decode_batch(msgspec.msgpack.encode([1.0, [["BlockInactive", [H1], "GPU"]], 0])).events
    assert isinstance(pos, BlockInactive)


class RfcBlockStored(msgspec.Struct, omit_defaults=True, tag_field="type", tag="BlockStored"):
    """SGLang's BlockStored as RFC sgl-project/sglang#39991 proposes it (vLLM's field order): `medium` and
    `lora_name` lose their defaults (always on the wire), the salt rides in `extra_keys` (and `cache_salt` stays)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[str, ...] | None] | None = None
    cache_salt: str | None = None


def _sgl(events: list[Any]) -> bytes:
    return msgspec.msgpack.encode(kv_events.SglEventBatch(ts=1.0, events=events, attn_dp_rank=0))


def test_sglang_rfc_39991_salt_in_extra_keys() -> None:
    ev = RfcBlockStored(block_hashes=[-5, 7], parent_block_hash=None, token_ids=TOKENS, block_size=BS, lora_id=None,
                        medium="GPU", lora_name=None, extra_keys=[("tenant-a",), None])
    raw = msgspec.msgpack.decode(_sgl([ev]))
    assert {"medium", "lora_name", "extra_keys"} <= set(raw[1][0])  # always sent, as the RFC asks
    (got,) = decode_batch(_sgl([ev])).events
    assert isinstance(got, BlockStored) and got.cache_salt is None and got.extra_keys == [["tenant-a"], None]
    ledger, sink = Ledger(slot=0, engine="sglang", block_size=BS), Sink()
    ledger.apply([got], sink)
    assert sink.held[0] == set(chain_keys(TOKENS, BS, root_key(None, "tenant-a")))  # the salted namespace


def test_sglang_hicache_media_are_tiers() -> None:
    """SGLang 0.5.23's StorageMedium: a host copy is CPU_PINNED, a storage copy DISK (cortex.kv_events)."""
    gpu = kv_events.SglBlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=TOKENS, block_size=BS,
                                   lora_id=None, medium="GPU")
    host = kv_events.SglBlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=TOKENS, block_size=BS,
                                    lora_id=None, medium="CPU_PINNED")
    disk = kv_events.SglBlockStored(block_hashes=[1], parent_block_hash=None, token_ids=TOKENS[:4], block_size=BS,
                                    lora_id=None, medium="DISK")
    ledger, sink = Ledger(slot=0, engine="sglang", block_size=BS, alloc=_Slots(1)), Sink()
    ledger.apply(decode_batch(_sgl([gpu, host, disk, kv_events.SglBlockRemoved(block_hashes=[2], medium="GPU")]))
                 .events, sink)
    _, tiers = ledger.layout()
    slot = {t.medium: t.slot for t in tiers}
    assert sink.held[0] == {K0} and sink.held[slot["CPU"]] == {K0, K1} and sink.held[slot["STORAGE"]] == {K0}


def test_unknown_kinds_and_media_are_counted_never_applied() -> None:
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockTeleported", "block_hashes": [H0]},
        {"type": "BlockStored", "block_hashes": [H0], "parent_block_hash": None, "token_ids": TOKENS[:4],
         "block_size": BS, "lora_id": None, "medium": "HBM3"},
        {"type": "BlockRemoved", "block_hashes": [H0], "medium": "HBM3"},
        {"type": "BlockStored", "block_hashes": [H0], "parent_block_hash": None, "token_ids": TOKENS[:4],
         "block_size": BS, "lora_id": None, "medium": "GPU", "locality": 7, "group_idx": "x"},  # odd types
    ], 0])
    batch = decode_batch(payload)
    assert batch.unknown == ["BlockTeleported"] and not batch.errors
    ledger, sink = fresh()
    ledger.apply(batch.events, sink)
    assert ledger.unknown_media == {"HBM3": 2} and ledger.dropped["unknown_medium"] == 2
    assert sink.held[0] == {K0}  # the GPU store with odd optional fields still counts (they read as absent)


# --- what each does to the ledger ------------------------------------------------------------------------------


def test_hybrid_step_then_the_window_block_leaves() -> None:
    ledger, sink = fresh()
    apply(ledger, sink, "gpu_store_every_field")
    groups, _ = ledger.layout()
    window = next(g for g in groups if g.kind == "window")
    assert window.need == 1  # ceil((5 - 1) / 4)
    assert sink.held[0] == {K0, K1} and sink.held[window.slot] == {K1}
    apply(ledger, sink, "gpu_remove")
    assert sink.held[0] == {K0, K1} and not sink.held[window.slot]


def test_location_only_copies_are_placed_by_the_gpus_hashes() -> None:
    ledger, sink = fresh()
    apply(ledger, sink, "gpu_store", "cpu_location_only", "storage_secondary_owner")
    _, tiers = ledger.layout()
    slot = {t.medium: t.slot for t in tiers}
    assert tiers == (TierSlot(slot=slot["CPU"], medium="CPU"), TierSlot(slot=slot["STORAGE"], medium="STORAGE"))
    assert sink.held[slot["CPU"]] == {K0, K1} and sink.held[slot["STORAGE"]] == {K0}
    assert ledger.lanes() == {"GPU/0": 2, "CPU/0/LOCAL": 2, "STORAGE/0/REMOTE/kvcr": 1}
    apply(ledger, sink, "cpu_remove")
    assert sink.held[slot["CPU"]] == {K0} and sink.held[0] == {K0, K1}
    apply(ledger, sink, "cleared")
    assert not any(sink.held.values())


def test_self_describing_copies_chain_through_the_gpus_parent() -> None:
    ledger, sink = fresh()
    apply(ledger, sink, "gpu_store", "cpu_self_describing")
    (tier,) = ledger.layout()[1]
    assert sink.held[tier.slot] == {K0, K1} and ledger.dropped == {}


def test_a_location_only_copy_of_a_block_never_seen_is_not_guessed() -> None:
    ledger, sink = fresh()
    apply(ledger, sink, "cpu_location_only")
    assert not any(sink.held.values()) and ledger.dropped["unknown_position"] == 2


def test_a_lower_tier_of_a_hybrid_model_is_not_used() -> None:
    ledger, sink = fresh()
    apply(ledger, sink, "gpu_store_every_field", "cpu_location_only")
    assert ledger.layout()[1] == () and ledger.dropped["tier_of_hybrid_model"] == 2
    assert np.array_equal(sorted(ledger.slots()), [0, 1])


def test_the_vectors_are_what_vllm_encodes() -> None:
    py = _vllm_python()
    if py is None:
        pytest.skip("no vLLM install (set CORTEX_VLLM_VENV, or run scripts/setup-vllm.sh)")
    out = subprocess.run([str(py), str(GENERATOR)], capture_output=True, timeout=600, check=True, cwd=ROOT)
    assert json.loads(out.stdout) == DOC


def test_only_a_layout_extproc_must_know_moves_the_layout_version() -> None:
    """A target whose events show one full-attention group publishes nothing new (and is not hidden while extproc
    reads it, ingest/source.py); a window group or a lower tier does."""
    ledger, sink = fresh()
    apply(ledger, sink, "gpu_store")
    assert ledger.layout_version == 0 and ledger.layout() == ((), ())
    apply(ledger, sink, "cpu_location_only")
    assert ledger.layout_version == 1
    hybrid, sink = fresh()
    apply(hybrid, sink, "gpu_store_every_field")
    assert hybrid.layout_version == 1 and len(hybrid.layout()[0]) == 2
