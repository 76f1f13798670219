"""Vectors for the hybrid cache-hit rule, produced by vLLM's own KV-cache classes (run with vLLM's interpreter).

    $CORTEX_VLLM_VENV/bin/python tests/vectors/hybrid_hits_gen.py > tests/fixtures/hybrid_hits.json

Drives vLLM 0.32's real `KVCacheManager` (HybridKVCacheCoordinator, FullAttentionManager, SlidingWindowManager,
BlockPool with KV events on) the way its scheduler does for one request at a time: look the prompt up
(`get_computed_blocks`, the engine's hit), allocate and cache it, decode a few tokens (`allocate_slots` one token
at a time, which frees blocks behind the window and caches full blocks), free it. The pool is small, so later
requests evict earlier ones' blocks. Every `BlockStored` / `BlockRemoved` the manager publishes is recorded with
the hit the engine found for each request before it ran: a consumer that replays the events up to a request must
claim no more than that hit (tests/test_hit_rule.py replays them through Cortex's ledger and rule, and asserts it
claims exactly that). Nothing else is recorded; the engine's code decides every number.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request

BLOCK = 4


def spec(kind: str, window: int | None) -> Any:
    common = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
    if kind == "full_attention":
        return FullAttentionSpec(**common)
    return SlidingWindowSpec(**common, sliding_window=window)


class Numbering:
    """Engine hashes as small ids in order of first sight: identity is all a consumer uses, and 64-bit digests
    would make most of the file."""

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}

    def __call__(self, h: int | None) -> int | None:
        return None if h is None else self.ids.setdefault(h, len(self.ids) + 1)


def event_json(e: Any, num: Numbering) -> list[Any]:
    """["S", group, parent, hashes, tokens] for a BlockStored (its kind and window are the group's, in the
    scenario's `groups`; checked here), ["R", group, hashes] for a BlockRemoved."""
    assert e.medium == "GPU"
    if type(e).__name__ == "BlockStored":
        assert e.block_size == BLOCK
        return ["S", e.group_idx, num(e.parent_block_hash), [num(h) for h in e.block_hashes], list(e.token_ids),
                e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window]
    assert type(e).__name__ == "BlockRemoved"
    return ["R", e.group_idx, [num(h) for h in e.block_hashes]]


def merged(events: list[list[Any]]) -> list[list[Any]]:
    """Consecutive removals of one group as one (vLLM sends one per block; their order is kept)."""
    out: list[list[Any]] = []
    for e in events:
        if e[0] == "R" and out and out[-1][0] == "R" and out[-1][1] == e[1]:
            out[-1][2].extend(e[2])
        else:
            out.append(e)
    return out


def scenario(name: str, groups: list[tuple[str, int | None]], num_blocks: int, requests: int, seed: int,
             retention: int | None) -> dict[str, Any]:
    rng = random.Random(seed)
    layers = [KVCacheGroupSpec([f"layer{i}"], spec(k, w)) for i, (k, w) in enumerate(groups)]
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=layers,
                        prefix_cache_retention_interval=retention)
    mgr = KVCacheManager(cfg, max_model_len=512, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                         enable_kv_cache_events=True)
    hasher = get_request_block_hasher(BLOCK, sha256)
    systems = [[rng.randrange(1000, 2000) for _ in range(rng.randrange(10, 30))] for _ in range(3)]
    conversations: list[list[int]] = []
    steps = []
    num = Numbering()
    for i in range(requests):
        roll = rng.random()
        if conversations and roll < 0.45:  # the next turn of a conversation: its whole history, then a new message
            prompt = rng.choice(conversations) + [rng.randrange(2000, 3000) for _ in range(rng.randrange(3, 20))]
        elif roll < 0.8:  # a new conversation on a shared system prompt
            prompt = rng.choice(systems) + [rng.randrange(2000, 3000) for _ in range(rng.randrange(3, 20))]
        elif conversations and roll < 0.9:  # a repeat
            prompt = list(rng.choice(conversations))
        else:  # unrelated
            prompt = [rng.randrange(3000, 4000) for _ in range(rng.randrange(5, 60))]
        prompt = prompt[:120]
        req = Request(str(i), prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher)
        blocks, hit, boundary = mgr.get_computed_blocks(req)
        steps.append({"prompt": prompt, "hit_tokens": hit})
        req.shared_prefix_boundary = boundary
        if mgr.allocate_slots(req, len(prompt) - hit, hit, blocks) is None:
            steps[-1]["events"] = merged([event_json(e, num) for e in mgr.take_events()])
            steps[-1]["skipped"] = True  # the pool could not hold it: not run
            continue
        req.num_computed_tokens = len(prompt)
        for _ in range(rng.randrange(1, 9)):  # decode, one token a step
            req.append_output_token_ids(rng.randrange(4000, 5000))
            if mgr.allocate_slots(req, 1) is None:
                break
            req.num_computed_tokens += 1
        mgr.free(req)
        steps[-1]["events"] = merged([event_json(e, num) for e in mgr.take_events()])
        conversations.append(list(req.all_token_ids))
    return {"name": name, "block_size": BLOCK, "groups": [{"kind": k, "sliding_window": w} for k, w in groups],
            "num_blocks": num_blocks, "retention_interval": retention, "steps": steps}


def main() -> None:
    init_none_hash(sha256)
    import vllm
    out = {"vllm": vllm.__version__, "generator": "tests/vectors/hybrid_hits_gen.py", "scenarios": [
        # Gemma 3's layout (sliding window first, full attention second), the engine's default sparse retention.
        scenario("gemma3", [("sliding_window", 9), ("full_attention", None)], 48, 40, 1, 0),
        # The same with dense retention (every block cached in both groups).
        scenario("gemma3_dense", [("sliding_window", 9), ("full_attention", None)], 40, 30, 2, None),
        # Two windows and full attention: the coordinator's fixed-point loop.
        scenario("two_windows", [("sliding_window", 6), ("full_attention", None), ("sliding_window", 13)], 72, 40,
                 3, 0),
        # Full attention alone (the unitary coordinator).
        scenario("full_only", [("full_attention", None)], 24, 24, 4, None),
    ]}
    json.dump(out, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
