"""KV-event payloads with every field vLLM 0.32 publishes, encoded by vLLM's own classes (run with its interpreter).

    $CORTEX_VLLM_VENV/bin/python tests/vectors/event_fields_gen.py > tests/fixtures/event_fields.json

Each case is one `KVEventBatch` as vLLM's publisher encodes it (`msgspec.msgpack.Encoder().encode(batch)`): a GPU
store with every optional field set (a sliding-window group of a hybrid model, locality, ownership, session_id),
its removal, the offloading connector's location-only copy (`OffloadingEventsTracker`'s placeholder:
`token_ids=[]`, `block_size=0`, parent None) and its self-describing copy (the tracker with
`self_describing_kv_events` and a recorded store), and their removals. tests/test_event_fields.py decodes each with
Cortex's decoder and applies it to a ledger. lookahead_token_ids (vLLM 0.33) and BlockInactive (in review) are not
in 0.32: that test builds them from cortex/kv_events.py, which tests/sim/test_real_engine_decode.py holds to 0.33.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
import torch
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
    get_offloading_event_group_spec,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadingKVEventsConfig, make_offload_key
from vllm.v1.request import Request

BLOCK = 4
TOKENS = list(range(1, 9))  # two blocks


def payload(events: list[Any], rank: int = 0) -> str:
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1700000000.0, events=events,
                                                         data_parallel_rank=rank)).hex()


def main() -> None:
    init_none_hash(sha256)
    req = Request("r", TOKENS, SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(BLOCK, sha256), session_id="conv-7")
    raw = req.block_hashes  # the engine's BlockHash digests
    wire = [maybe_convert_block_hash(h) for h in raw]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    group = GroupOffloadConfig(group_idx=0, tokens_per_block=BLOCK, tokens_per_chunk=BLOCK, hashes_per_chunk=1,
                               kv_event_group_spec=get_offloading_event_group_spec(KVCacheGroupSpec(["l0"], spec)),
                               sliding_window_size_in_chunks=None, kv_cache_spec=spec,
                               manager_cls=FullAttentionManager)
    keys = [make_offload_key(h, 0) for h in raw]
    placeholder = OffloadingEventsTracker(OffloadingKVEventsConfig(enable_kv_cache_events=True,
                                                                   self_describing_kv_events=False))
    described = OffloadingEventsTracker(OffloadingKVEventsConfig(enable_kv_cache_events=True,
                                                                 self_describing_kv_events=True))
    for i, key in enumerate(keys):
        described.record_store(req, group, i, key)
    cpu_store = OffloadingEvent(keys=keys, medium=Medium.CPU, removed=False, locality=Locality.LOCAL)
    cpu_removed = OffloadingEvent(keys=keys[1:], medium=Medium.CPU, removed=True, locality=Locality.LOCAL)
    storage_store = OffloadingEvent(keys=keys[:1], medium=Medium.STORAGE, removed=False, locality=Locality.REMOTE,
                                    ownership="kvcr", removal_expected=True)
    gpu_full = BlockStored(block_hashes=wire, parent_block_hash=None, token_ids=TOKENS, block_size=BLOCK,
                           lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
                           kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None,
                           session_id="conv-7")
    gpu_window = BlockStored(block_hashes=wire[1:], parent_block_hash=None, token_ids=TOKENS, block_size=BLOCK,
                             lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=1,
                             kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=5,
                             locality="LOCAL", ownership=None, session_id="conv-7")
    cases = [
        {"name": "gpu_store", "payload": payload([gpu_full])},
        # A hybrid model's step: the full-attention group and the sliding-window group (only its last block).
        {"name": "gpu_store_every_field", "payload": payload([gpu_full, gpu_window])},
        {"name": "gpu_remove", "payload": payload([BlockRemoved(block_hashes=[wire[1]], medium="GPU", group_idx=1,
                                                                 locality="LOCAL", ownership=None)])},
        # The offloading connector's copies: location-only (the default) and self-describing.
        {"name": "cpu_location_only", "payload": payload(list(placeholder.take_events([cpu_store])))},
        {"name": "cpu_self_describing", "payload": payload(list(described.take_events([cpu_store])))},
        {"name": "storage_secondary_owner", "payload": payload(list(placeholder.take_events([storage_store])))},
        {"name": "cpu_remove", "payload": payload(list(placeholder.take_events([cpu_removed])))},
        {"name": "cleared", "payload": payload([AllBlocksCleared()], rank=1)},
    ]
    import vllm
    json.dump({"vllm": vllm.__version__, "generator": "tests/vectors/event_fields_gen.py", "block_size": BLOCK,
               "tokens": TOKENS, "wire_hashes": wire, "cases": cases}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
