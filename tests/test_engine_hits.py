"""extproc/engine_hits.py: the view's matches through each target's hit rule, tiers apart, and what is claimed."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from cortex.blockkeys import chain_keys, root_key
from cortex.config import SchedulerConfig
from cortex.contract import GroupSlot, TierSlot
from cortex.ledger_view import ViewReader, ViewWriter
from extproc import candidates, engine_hits
from extproc.candidates import Hysteresis
from extproc.cluster_view import TargetInfo
from extproc.policies.base import EXACT, Facts
from extproc.policies.ttft import Ttft
from extproc.predictions import Predictions

BS = 4
TOKENS = list(range(1, 41))  # 10 blocks
KEYS = chain_keys(TOKENS, BS, root_key(), max_blocks=(len(TOKENS) - 1) // BS)  # 9 usable
WEIGHTS = {"CPU": 0.75, "STORAGE": 0.25}


def target(slot: int, engine: str = "vllm", **kw: object) -> TargetInfo:
    return TargetInfo(id=f"w{slot}", worker=f"w{slot}", rank=None, slot=slot, model="m", engine=engine,
                      address=f"h:{slot}", exact_kv=True, healthy=True, engine_load=0.0, **kw)  # type: ignore[arg-type]


@pytest.fixture
def view(tmp_path: Path) -> tuple[ViewWriter, ViewReader]:
    writer = ViewWriter(tmp_path / "view", max_workers=16, capacity=256)
    return writer, ViewReader(tmp_path / "view")


def resolve(reader: ViewReader, workers: list[TargetInfo], keys: list[int] = KEYS,
            chunks: int = 1) -> engine_hits.Hits:
    slots = engine_hits.detail_slots(workers)
    detail = engine_hits.Detail(reader.match_detail, slots) if slots is not None else None
    parts = np.array_split(np.arange(len(keys)), chunks)
    counts = None
    for part in parts:  # as the early-stopping walk looks keys up: piece by piece
        piece = [keys[i] for i in part]
        got = reader.match(piece) if detail is None else detail.lookup(piece)
        assert got is not None
        counts = got if counts is None else np.where(counts == part[0], counts + got, counts)
    assert counts is not None
    return engine_hits.resolve(counts, workers, detail, len(keys), WEIGHTS)


def test_plain_targets_are_left_as_the_view_says(view: tuple[ViewWriter, ViewReader]) -> None:
    writer, reader = view
    writer.add(0, KEYS[:5])
    hits = resolve(reader, [target(0)])
    assert hits.matches[0] == 5 and not hits.lower and not hits.withheld
    assert engine_hits.detail_slots([target(0)]) is None and not engine_hits.tiered([target(0)])


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_window_shortens_the_full_attention_run(view: tuple[ViewWriter, ViewReader], chunks: int) -> None:
    writer, reader = view
    writer.add(0, KEYS[:8])            # full attention: 8 blocks
    writer.add(5, KEYS[2:5])           # the window (2 blocks back) holds blocks 2..4 only
    t = target(0, groups=(GroupSlot(slot=0, kind="full"), GroupSlot(slot=5, kind="window", need=2)))
    hits = resolve(reader, [t], chunks=chunks)
    assert hits.matches[0] == 5 and hits.withheld == {0: 3}


def test_lower_tiers_after_the_gpu_hit(view: tuple[ViewWriter, ViewReader]) -> None:
    writer, reader = view
    writer.add(0, KEYS[:3])                       # GPU: blocks 0..2
    writer.add(7, KEYS[:6])                       # CPU: 0..5 (offloaded as computed)
    writer.add(8, KEYS[6:8])                      # STORAGE: 6..7
    tiers = (TierSlot(slot=7, medium="CPU"), TierSlot(slot=8, medium="STORAGE"))
    vllm, sglang = target(0, tiers=tiers), target(0, engine="sglang", tiers=tiers)
    assert engine_hits.tiered([vllm])
    hit = resolve(reader, [vllm]).lower[0]
    assert (hit.blocks, hit.by_medium, hit.credit) == (5, {"CPU": 3, "STORAGE": 2}, 3 * 0.75 + 2 * 0.25)
    assert hit.claimed == 5  # vLLM counts connector hits in cached_tokens
    assert resolve(reader, [sglang]).lower[0].claimed == 0  # not proven for SGLang: scored, never claimed


def test_lookahead_gives_up_its_blocks(view: tuple[ViewWriter, ViewReader]) -> None:
    writer, reader = view
    writer.add(0, KEYS[:6])
    assert resolve(reader, [target(0, lookahead_blocks=1)]).matches[0] == 5


def test_a_lower_tier_hit_is_claimed_whole_and_scored_at_its_weight(view: tuple[ViewWriter, ViewReader]) -> None:
    """Worker 0 holds 2 blocks on its GPU and 6 more on CPU; worker 1 holds 6 on its GPU. The claim on worker 0 is
    its 8 blocks (vLLM reports them all cached); its score counts the CPU ones at 0.75 (6.5 blocks' worth)."""
    writer, reader = view
    writer.add(0, KEYS[:2])
    writer.add(9, KEYS[:8])
    writer.add(1, KEYS[:6])
    workers = [target(0, tiers=(TierSlot(slot=9, medium="CPU"),)), target(1)]
    hits = resolve(reader, workers)
    cands = candidates.build(workers, matches=hits.matches, keys=KEYS, inflight=np.zeros(16), alive=True,
                             predictions=Predictions(ttl_s=0), hysteresis=Hysteresis(), scoring=SchedulerConfig(),
                             lower=hits.lower)
    by_id = {c.id: c for c in cands}
    assert by_id["w0"].matched_blocks == 8 and by_id["w0"].tier_claimed == 6
    assert by_id["w0"].affinity_blocks == pytest.approx(2 + 6 * 0.75)
    assert by_id["w1"].affinity_blocks == 6
    d = Ttft().decide(cands, Facts(block_size=BS, ledger_usable=True, why_not_exact="no_cached_prefix",
                                   prompt_tokens=len(TOKENS)), random.Random(1))
    assert d.mode == EXACT and d.chosen.id == "w0" and d.hit_tokens == 8 * BS
