"""The engine's cache-hit rule (cortex/hit_rule.py) and the path that applies it, against vLLM's own classes.

tests/fixtures/hybrid_hits.json was produced by vLLM 0.32's KVCacheManager (tests/vectors/hybrid_hits_gen.py):
per request, the events the engine published before it and the hit it then found. Replayed through Cortex's
decoder, ledger, shared view and extproc's hit resolution, every claim must equal the engine's hit: never above it
(a claim the engine will not serve) and not below it where the engine has it. The generator is re-run when vLLM is
installed (CORTEX_VLLM_VENV) and must still produce the committed vectors.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from cortex import hit_rule, kv_events
from cortex.blockkeys import chain_keys, root_key
from cortex.ledger_view import ViewReader, ViewWriter
from extproc import engine_hits
from extproc.cluster_view import TargetInfo
from ingest.events import AllBlocksCleared, decode_batch
from ingest.ledger import Ledger
from tests.test_ledger import SetSink

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT / "tests" / "fixtures" / "hybrid_hits.json"
GENERATOR = ROOT / "tests" / "vectors" / "hybrid_hits_gen.py"


def held(pattern: str) -> np.ndarray:
    return np.array([c == "x" for c in pattern], dtype=bool)


# --- the pure rule --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("pattern", "limit", "need", "hit"), [
    # vLLM's own docstring example: [NULL, NULL, 8, 3, NULL, 9] -> [NULL, NULL, 8, 3] with 2 contiguous blocks.
    ("..xx.x", 6, 2, 4),
    ("..xx.x", 3, 2, 0),   # the run ending at block 3 is past the limit; no run of 2 before it
    ("xxxxxx", 6, 4, 6),   # everything held: the hit is the limit
    ("x.....", 6, 4, 1),   # no run of 4: the leading run, shorter than the window
    ("xx.xxx", 6, 4, 2),   # a run of 3 at the end is not enough: back to the leading run
    ("....xxxx", 8, 4, 8),  # the blocks before the window may be gone: the window back from the hit is enough
    ("....xxxx..", 10, 4, 8),
    ("xxxx....xxxx..", 14, 4, 12),  # the last run wins
    ("", 0, 4, 0),
    (".x.x", 4, 1, 4),     # a window of one block: the last held block
])
def test_window_hit(pattern: str, limit: int, need: int, hit: int) -> None:
    assert hit_rule.window_hit(held(pattern), limit, need) == hit


def test_window_need_is_vllms_contiguous_blocks() -> None:
    # SlidingWindowManager._contiguous_blocks_for_hit: cdiv(window - 1, block).
    assert hit_rule.window_need(128, 32) == 4
    assert hit_rule.window_need(129, 32) == 4
    assert hit_rule.window_need(130, 32) == 5
    assert hit_rule.window_need(9, 4) == 2
    assert hit_rule.window_need(1, 4) == 1


def test_hybrid_hit_full_attention_bounds_then_the_window_shortens() -> None:
    full = hit_rule.Spec(hit_rule.FULL)
    window = hit_rule.Spec(hit_rule.WINDOW, need=4)
    # Full attention holds 12 blocks, the window only the last 4 of a 13-block request: the 12-block prefix of a
    # new question is not a hit (the engine.md §9 case: cached_tokens 0 although full attention held 12 blocks).
    assert hit_rule.hybrid_hit([(window, held("." * 9 + "xxxx")), (full, held("x" * 13))], 12) == 0
    assert hit_rule.hybrid_hit([(window, held("." * 9 + "xxxx")), (full, held("x" * 13))], 13) == 13
    # Two windows: the second shortens the candidate, the first is checked again at the shorter length.
    w2 = hit_rule.Spec(hit_rule.WINDOW, need=2)
    assert hit_rule.hybrid_hit([(full, held("x" * 10)), (w2, held("xxxxxxxx.x")), (window, held("xxxxxx.xxx"))],
                               10) == 6


# --- vLLM's KVCacheManager, replayed through Cortex --------------------------------------------------------------


class _Slots:
    def __init__(self, first: int) -> None:
        self.next = first

    def __call__(self) -> int:
        self.next += 1
        return self.next - 1


def _wire(events: list[list[Any]], block: int) -> bytes:
    """The vectors' events as vLLM publishes them (its msgspec layout, cortex/kv_events.py)."""
    out: list[Any] = []
    for e in events:
        if e[0] == "S":
            _, group, parent, hashes, tokens, kind, window = e
            out.append(kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                             block_size=block, lora_id=None, medium="GPU", lora_name=None,
                                             extra_keys=[None] * len(hashes), group_idx=group,
                                             kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window))
        else:
            out.extend(kv_events.BlockRemoved(block_hashes=[h], medium="GPU", group_idx=e[1]) for h in e[2])
    return kv_events.encode_batch(kv_events.KVEventBatch(ts=0.0, events=out, data_parallel_rank=0))


def _claim(reader: ViewReader, target: TargetInfo, prompt: list[int], block: int) -> tuple[int, int]:
    """(claimed tokens, the full-attention run in tokens) for `prompt` on `target`, as extproc computes them."""
    keys = chain_keys(prompt, block, root_key(), max_blocks=max(0, (len(prompt) - 1) // block))
    if not keys:
        return 0, 0
    slots = engine_hits.detail_slots([target])
    detail = engine_hits.Detail(reader.match_detail, slots) if slots is not None else None
    matches = reader.match(keys) if detail is None else detail.lookup(keys)
    assert matches is not None
    hits = engine_hits.resolve(matches, [target], detail, len(keys), {})
    return int(hits.matches[target.slot]) * block, int(matches[target.slot]) * block


def _scenarios() -> list[dict[str, Any]]:
    return json.loads(VECTORS.read_text())["scenarios"]


@pytest.mark.parametrize("scenario", _scenarios(), ids=lambda s: s["name"])
def test_claims_equal_the_engines_hits(scenario: dict[str, Any], tmp_path: Path) -> None:
    block = scenario["block_size"]
    writer = ViewWriter(tmp_path / "view", max_workers=8, capacity=1 << 10)
    ledger = Ledger(slot=0, engine="vllm", block_size=block, alloc=_Slots(1))
    reader = ViewReader(tmp_path / "view")
    over = exact = hits = full_only_over = 0
    for i, step in enumerate(scenario["steps"]):
        groups, tiers = ledger.layout()
        target = TargetInfo(id="w", worker="w", rank=None, slot=0, model="m", engine="vllm", address="h:1",
                            exact_kv=True, healthy=True, engine_load=0.0, groups=groups, tiers=tiers)
        claimed, full_run = _claim(reader, target, step["prompt"], block)
        engine = step["hit_tokens"]
        assert claimed <= engine, f"step {i}: claimed {claimed} tokens, the engine reused {engine}"
        over += claimed > engine
        exact += claimed == engine
        hits += engine > 0
        full_only_over += full_run > engine
        batch = decode_batch(_wire(step["events"], block))
        assert not batch.errors and not batch.unknown
        ledger.apply(batch.events, writer)
    assert not ledger.unsupported
    assert exact == len(scenario["steps"]), f"{len(scenario['steps']) - exact} claims below the engine's hit"
    assert hits > len(scenario["steps"]) // 4  # the vectors do exercise hits
    if len(scenario["groups"]) > 1 and scenario["retention_interval"] == 0:
        # A match on the full-attention group alone (what a gateway that reads only that group claims) would have
        # claimed more than the engine served: the window rule is what keeps these exact.
        assert full_only_over > 0


def test_a_window_store_is_placed_through_the_full_attention_store_of_the_same_batch(tmp_path: Path) -> None:
    """Gemma 3 publishes its sliding-window group (0) before its full-attention group (1) in one batch; the window
    store has no parent and fewer hashes than blocks, so only the full-attention store says where they are."""
    block = 4
    tokens = list(range(100, 124))  # 6 blocks
    sink = ViewWriter(tmp_path / "view", max_workers=4, capacity=64)
    ledger = Ledger(slot=0, engine="vllm", block_size=block, alloc=_Slots(1))
    ledger.apply(decode_batch(_wire([["S", 0, None, [5, 6], tokens, "sliding_window", 9],
                                     ["S", 1, None, [1, 2, 3, 4, 5, 6], tokens, "full_attention", None]],
                                    block)).events, sink)
    groups, _ = ledger.layout()
    assert [(g.kind, g.need) for g in groups] == [("window", 2), ("full", 0)]
    keys = chain_keys(tokens, block, root_key())
    reader = ViewReader(tmp_path / "view")
    window = next(g.slot for g in groups if g.kind == "window")
    counts, bits = reader.match_detail(keys, np.array([window]))
    assert int(counts[0]) == 6 and bits[:, 0].tolist() == [False] * 4 + [True] * 2
    assert ledger.dropped == {}


def test_a_clear_drops_what_waited_before_it(tmp_path: Path) -> None:
    """A window store waits for the batch's other events; a clear later in the same batch came after it, so what
    waited is dropped with everything else, not applied after the clear."""
    tokens = list(range(100, 124))
    sink = SetSink()
    ledger = Ledger(slot=0, engine="vllm", block_size=4, alloc=_Slots(1))
    ledger.apply(decode_batch(_wire([["S", 0, None, [5, 6], tokens, "sliding_window", 9],
                                     ["S", 1, None, [1, 2, 3, 4, 5, 6], tokens, "full_attention", None]], 4)).events,
                 sink)
    window = ledger.slots()[1]
    assert len(sink.held[window]) == 2
    more = [*tokens, 1, 2, 3, 4]
    before, after = (decode_batch(_wire([e], 4)).events for e in (
        ["S", 0, None, [8], more, "sliding_window", 9],                       # waits: 8 is not placed yet
        ["S", 1, None, [1, 2, 3, 4, 5, 6, 8], more, "full_attention", None]))  # after the clear, places 8
    ledger.apply([*before, AllBlocksCleared(), *after], sink)
    assert not sink.held.get(window) and ledger.lanes() == {"GPU/0": 0, "GPU/1": 7}


def test_an_unknown_group_kind_is_not_routed_exactly() -> None:
    ledger = Ledger(slot=0, engine="vllm", block_size=4, alloc=_Slots(1))
    ledger.apply(decode_batch(_wire([["S", 0, None, [1], [1, 2, 3, 4], "mamba", None]], 4)).events, SetSink())
    assert "mamba" in ledger.unsupported and ledger.dropped["unsupported_group"] == 1


def _vllm_python() -> Path | None:
    venv = os.environ.get("CORTEX_VLLM_VENV", str(ROOT / ".venv-vllm"))
    py = Path(venv) / "bin" / "python"
    return py if py.exists() else None


def test_the_vectors_are_what_vllm_produces() -> None:
    """Run the generator with vLLM's interpreter: the committed file is exactly what vLLM's classes give."""
    py = _vllm_python()
    if py is None:
        pytest.skip("no vLLM install (set CORTEX_VLLM_VENV, or run scripts/setup-vllm.sh)")
    out = subprocess.run([str(py), str(GENERATOR)], capture_output=True, timeout=600, check=True, cwd=ROOT)
    assert msgspec.json.decode(out.stdout) == json.loads(VECTORS.read_text())
