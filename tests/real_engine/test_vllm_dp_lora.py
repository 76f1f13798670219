"""One real vLLM 0.32 engine with two data-parallel ranks (`--data-parallel-size 2`: two engine cores behind one
URL, each with its own KV cache and its own KV-event stream on the base ports + rank) that also serves a LoRA
adapter made at test time (tests/real_engine/lora.py, `--enable-lora --lora-modules`). One engine for both cases
keeps the tier to one more start; the two cases read different things (the rank a repeat is pinned to, and the
blocks stored under the adapter).

Cortex sees the engine as two targets, `vllm-dp@0` and `vllm-dp@1`, and pins a request to a rank with
`x-data-parallel-rank` (vLLM's DP-rank header, engines.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.harness import MODEL, Gateway, long_chat, wait_for
from tests.real_engine.lora import RANK, write_adapter
from tests.real_engine.models import QWEN2_TINY
from tests.real_engine.vllm_engine import (
    VllmEngine,
    cached,
    chat,
    claimed,
    gateway,
    matched,
    model_entry,
    new_engine,
    running,
)

pytestmark = pytest.mark.timeout(900)

ADAPTER = "sql-lora"
RANKS = ("vllm-dp@0", "vllm-dp@1")


@pytest.fixture(scope="module")
def engine(vllm_available: None, qwen2_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    root = tmp_path_factory.mktemp("dp-lora")
    adapter = write_adapter(root / ADAPTER, QWEN2_TINY)
    e = new_engine("vllm-dp", qwen2_tiny, root, dp=2,
                   flags=("--enable-lora", "--max-lora-rank", str(RANK), "--lora-modules", f"{ADAPTER}={adapter}"))
    with running([e]):
        yield e


@pytest.fixture(scope="module")
def gw(engine: VllmEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway(tmp_path_factory.mktemp("dp-lora-gw"), [engine], models=[model_entry(loras=[ADAPTER])]) as g:
        yield g


def test_data_parallel_ranks_are_two_targets_and_repeats_are_pinned_to_the_holding_rank(gw: Gateway) -> None:
    assert set(gw.targets()) == set(RANKS)
    chats = [long_chat(220, seed=600 + i) for i in range(2)]
    # Two at once, long enough to overlap: the in-flight count puts them on both ranks.
    with ThreadPoolExecutor(2) as pool:
        heads = list(pool.map(lambda m: chat(gw, m, max_tokens=32)[0], chats))
    holders = [h["x-cortex-assigned-worker"] for h in heads]
    assert sorted(holders) == list(RANKS), holders
    for messages, holder in zip(chats, holders, strict=True):
        wait_for(lambda m=messages, t=holder: matched(gw, m)[t] > 0, what=f"{holder}'s blocks in the ledger")
        other = next(t for t in RANKS if t != holder)
        assert matched(gw, messages)[other] == 0  # each rank has a cache of its own
        h, usage = chat(gw, messages)
        assert h["x-cortex-assigned-worker"] == holder
        assert h["x-cortex-match-mode"] == "exact_kv_events"
        assert claimed(h) == cached(usage) > 0, (dict(h), usage)


def test_lora_requests_claim_exactly_the_blocks_stored_under_the_adapter(gw: Gateway) -> None:
    messages = long_chat(220, seed=700)
    h, usage = chat(gw, messages, model=ADAPTER)
    assert claimed(h) == cached(usage) == 0
    holder = h["x-cortex-assigned-worker"]
    wait_for(lambda: matched(gw, messages, model=ADAPTER)[holder] > 0, what="the adapter's blocks in the ledger")
    # The same messages on the base model are other blocks to the engine (the adapter is in every block's hash):
    # nothing to claim for them, and the engine agrees.
    assert matched(gw, messages) == dict.fromkeys(RANKS, 0)
    h, usage = chat(gw, messages, model=MODEL)
    assert claimed(h) == cached(usage) == 0, (dict(h), usage)

    h, usage = chat(gw, messages, model=ADAPTER)
    assert h["x-cortex-assigned-worker"] == holder
    assert h["x-cortex-match-mode"] == "exact_kv_events"
    assert claimed(h) == cached(usage) > 0, (dict(h), usage)
