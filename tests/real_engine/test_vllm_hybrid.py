"""Two real vLLM engines with a Gemma 3 layout (a sliding-window layer beside a full-attention one) behind `cortex run`.

vLLM keeps one KV-cache group per kind of layer and publishes each apart: the sliding-window group's BlockStored
carries only the blocks inside its window at the end of each request, with no parent. A hit needs the full-attention
group's leading run *and* the window's blocks back from the hit point (cortex/hit_rule.py). These tests check
Cortex's claims against the engine's own `cached_tokens` on every response: never above it, and equal to it.

The pool is the fixture's 512 blocks, counted over both groups: the mix evicts. Predictions are off
(`extproc.prediction_ttl_s: 0`) so a reason code says what the ledger proved, not what a recent choice predicts;
`settle` waits before each request until ingest has applied every batch the engines published (docs/ledger.md,
window 2), so a claim is compared with the state the engine decided on.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import MODEL, Gateway
from tests.real_engine.vllm_engine import (
    BLOCK,
    VllmEngine,
    cached,
    chat,
    claimed,
    gateway,
    new_engine,
    running,
    settle,
)

WINDOW_BLOCKS = 4  # ceil((128 - 1) / 32): the blocks a hit must end with in the sliding-window group


@pytest.fixture(scope="module")
def pair(vllm_available: None, gemma3_hybrid: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        list[VllmEngine]]:
    logs = tmp_path_factory.mktemp("hybrid-logs")
    engines = [new_engine(f"gemma-{i}", gemma3_hybrid, logs) for i in (1, 2)]
    with running(engines):
        yield engines


@pytest.fixture(scope="module")
def gw(pair: list[VllmEngine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway(tmp_path_factory.mktemp("hybrid-gw"), pair,
                 extra_config={"extproc": {"prediction_ttl_s": 0}}) as g:
        yield g


def system_prompt(tag: str, rules: int = 40) -> str:
    return " ".join(f"Rule {i} of the {tag} policy: answer about topic {i * 7} briefly and precisely."
                    for i in range(rules))


def long_question(tag: str, n: int = 40) -> str:
    """A question longer than the window (128 tokens), so the window moves past the system prompt."""
    return f"Question {tag}: " + " ".join(f"consider item {tag}-{i} and its neighbours;" for i in range(n))


def ask(gw: Gateway, messages: list[dict[str, str]]) -> dict[str, Any]:
    settle(gw)
    headers, usage = chat(gw, messages)
    return {"claim": claimed(headers), "cached": cached(usage), "prompt": usage["prompt_tokens"],
            "worker": headers["x-cortex-assigned-worker"], "mode": headers["x-cortex-match-mode"],
            "reason": headers["x-cortex-route-reason"]}


def test_the_layout_is_learned_and_parity_holds_on_the_full_attention_group(gw: Gateway) -> None:
    r = ask(gw, [{"role": "system", "content": system_prompt("layout")}, {"role": "user", "content": "Hello."}])
    assert r["claim"] == r["cached"] == 0
    settle(gw)
    for t in gw.targets().values():
        assert t["exact_kv"], t["reason"]
        if t["kv_lanes"]:  # the engine that served it (the other has seen no event yet)
            assert sorted((g["kind"], g["need"]) for g in t["groups"]) == [("full", 0), ("window", WINDOW_BLOCKS)]
            assert t["parity"]["status"] == "ok", t["parity"]
            assert not t["dropped_events"] and t["kv_layout_unsupported"] is None


def test_a_new_question_after_a_long_turn_is_not_claimed_where_the_window_moved_on(gw: Gateway) -> None:
    """The issue's case: the full-attention group holds every block of the system prompt, but the sliding window
    holds only the blocks at the end of the first request: a new question after the same system prompt gets
    `cached_tokens: 0` from the engine. A full-attention-only match would claim the system prompt; Cortex claims
    nothing and says why. The engine then keeps the window at the junction it found (its shared-prefix boundary),
    and the next such question is a hit, claimed exactly."""
    system = {"role": "system", "content": system_prompt("window")}
    first = ask(gw, [system, {"role": "user", "content": long_question("a")}])
    assert first["claim"] == first["cached"] == 0
    settle(gw)
    b = [system, {"role": "user", "content": long_question("b")}]
    doc = httpx.post(gw.explain_url, timeout=30, headers=gw.admin_headers, json={"model": MODEL, "messages": b}).json()
    holder = next(w for w in doc["workers"] if w["id"] == first["worker"])
    # The full-attention group holds the system prompt's blocks; the window does not: nothing is claimed.
    assert doc["cache_hit_tokens"] == 0 and holder["matched_tokens"] == 0, doc
    assert holder.get("window_withheld_tokens", 0) >= 10 * BLOCK and doc["reason"] == "window_not_cached", doc
    second = ask(gw, b)
    assert second["cached"] == 0 and second["claim"] == 0, second
    third = ask(gw, [system, {"role": "user", "content": long_question("c")}])
    assert third["claim"] == third["cached"], third


def mix(gw: Gateway, seed: int, n: int, tag: str) -> None:
    """New conversations on shared system prompts, next turns, repeats and unrelated prompts, seeded: on every
    response the claim equals the engine's cached_tokens (so it is never above it)."""
    rng = random.Random(seed)
    systems = [system_prompt(f"{tag}-{s}", rng.randrange(25, 45)) for s in range(3)]
    convs: list[list[dict[str, str]]] = []
    rows = []
    for i in range(n):
        roll = rng.random()
        if convs and roll < 0.4:
            msgs = [*rng.choice(convs), {"role": "user", "content": f"Follow-up {i}: and item {rng.randrange(999)}?"}]
        elif roll < 0.6:
            msgs = [{"role": "system", "content": rng.choice(systems)},
                    {"role": "user", "content": f"Question {i}: tell me about {rng.randrange(999)}."}]
        elif roll < 0.75:
            msgs = [{"role": "system", "content": rng.choice(systems)},
                    {"role": "user", "content": long_question(f"{tag}{i}", rng.randrange(10, 40))}]
        elif convs and roll < 0.9:
            msgs = list(rng.choice(convs))
        else:
            words = " ".join(f"w{rng.randrange(10**4)}" for _ in range(rng.randrange(30, 200)))
            msgs = [{"role": "user", "content": words}]
        r = ask(gw, msgs)
        rows.append(r)
        convs.append([*msgs, {"role": "assistant", "content": f"Answer {i}."}])
    over = [r for r in rows if r["claim"] > r["cached"]]
    exact = [r for r in rows if r["claim"] == r["cached"]]
    hits = [r for r in rows if r["cached"] > 0]
    print(f"\nhybrid mix ({tag}): {len(rows)} requests, {sum(r['cached'] for r in rows)} cached tokens reported by "
          f"the engines, {sum(r['claim'] for r in rows)} claimed, {len(over)} over-claims, {len(exact)} exact, "
          f"{len(hits)} engine hits")
    assert not over, over
    assert len(exact) == len(rows), [r for r in rows if r["claim"] != r["cached"]]
    assert len(hits) >= len(rows) // 3  # the mix does exercise hits
    assert all(r["claim"] % BLOCK == 0 for r in rows)


def test_a_multi_turn_mix_claims_exactly_what_the_engines_serve(gw: Gateway) -> None:
    mix(gw, seed=25, n=48, tag="mix")


def test_event_shards_learn_the_layout_and_claim_exactly(pair: list[VllmEngine],
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same engines behind a gateway whose streams run in an event shard (`ingest.event_shards`, docs/ledger.md):
    the shard's ledgers take the window group's slots from the reserve ingest grants them, the target is shown once
    ingest has published that layout, and the claims stay exact."""
    with gateway(tmp_path_factory.mktemp("hybrid-shard-gw"), pair,
                 extra_config={"extproc": {"prediction_ttl_s": 0}, "ingest": {"event_shards": 1}}) as g:
        mix(g, seed=26, n=24, tag="shard-mix")
        targets = g.targets().values()
        assert all(t["event_shard"] == 0 and t["exact_kv"] for t in targets), [t["reason"] for t in targets]
        served = [t for t in targets if t["kv_lanes"]]
        assert served
        for t in served:
            assert sorted((grp["kind"], grp["need"]) for grp in t["groups"]) == [("full", 0), ("window", WINDOW_BLOCKS)]
            assert len({grp["slot"] for grp in t["groups"]}) == 2  # the window's slot, from the shard's reserve
