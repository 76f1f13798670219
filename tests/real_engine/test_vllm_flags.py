"""Real vLLM 0.32 engines whose flags differ from the shared pair's (test_vllm_pair.py): one per prefix-caching
hash algorithm other than the default, and one of them also runs two data-parallel ranks and serves a LoRA
adapter made at test time. Three engines started together, each served as a model of its own behind one
`cortex run` whose config names the model's algorithm and seed; the cases read different things of them (the
parity self-test, the rank a repeat is pinned to, the blocks stored under the adapter), so sharing an engine
costs no clarity and saves a start.

* Hash algorithms: Cortex's parity self-test (ingest/hash_parity.py) recomputes the engine's hash of each chain
  start it sees and reports it in /cortex/workers; claims must be exact. `sha256`, vLLM's default, is proven on
  the pair. The xxhash pair needs PYTHONHASHSEED on the engine (without it vLLM seeds their root hash from
  os.urandom: nobody else can recompute it) and the `xxhash` package in the engine's venv (vLLM keeps it optional
  and refuses the algorithm without it; scripts/setup-vllm.sh installs it).
* Data parallelism: `--data-parallel-size 2` runs two engine cores behind one URL, each with its own KV cache and
  KV-event stream (base ports + rank). Cortex sees two targets, `<worker>@0` and `<worker>@1`, and pins a request
  to a rank with `x-data-parallel-rank`.
* LoRA: `--enable-lora --lora-modules NAME=DIR` with a random-weight adapter in the PEFT layout
  (tests/real_engine/lora.py); vLLM puts the adapter into every block's hash, Cortex keys its blocks apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Gateway, long_chat, wait_for
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
    venv_has,
)

pytestmark = pytest.mark.timeout(900)

# algorithm -> PYTHONHASHSEED on its engine (None: unset, vLLM's fixed seed "vllm-none-hash")
ALGOS: dict[str, str | None] = {"sha256_cbor": None, "xxhash": "0", "xxhash_cbor": "4242"}
DP_ALGO = "xxhash_cbor"
"""The engine that also runs two DP ranks and the adapter."""
ADAPTER = "sql-lora"
NO_XXHASH = ("vLLM 0.32 refuses --prefix-caching-hash-algo xxhash/xxhash_cbor without the optional `xxhash` "
             "package (\"xxhash is required for the 'xxhash' prefix caching hash algorithms\"); "
             "scripts/setup-vllm.sh installs it")


def runnable(algo: str) -> bool:
    return not algo.startswith("xxhash") or venv_has("xxhash")


def served(algo: str) -> str:
    return f"tiny-{algo}"


@pytest.fixture(scope="module")
def engines(vllm_available: None, qwen2_tiny: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, VllmEngine]]:
    root = tmp_path_factory.mktemp("flags")
    adapter = write_adapter(root / ADAPTER, QWEN2_TINY)
    dp_flags = ("--enable-lora", "--max-lora-rank", str(RANK), "--lora-modules", f"{ADAPTER}={adapter}")
    out = {algo: new_engine(f"vllm-{algo.replace('_', '-')}", qwen2_tiny, root, served_model_name=served(algo),
                            flags=("--prefix-caching-hash-algo", algo, *(dp_flags if algo == DP_ALGO else ())),
                            env={"PYTHONHASHSEED": seed} if seed is not None else {},
                            dp=2 if algo == DP_ALGO else 1)
           for algo, seed in ALGOS.items() if runnable(algo)}
    with running(list(out.values())):
        yield out


@pytest.fixture(scope="module")
def gw(engines: dict[str, VllmEngine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    models: list[dict[str, Any]] = [
        model_entry(served(algo), hash_algo=algo,
                    **({"hash_seed": ALGOS[algo]} if ALGOS[algo] is not None else {}),
                    **({"loras": [ADAPTER]} if algo == DP_ALGO else {}))
        for algo in engines]
    with gateway(tmp_path_factory.mktemp("flags-gw"), list(engines.values()), models=models) as g:
        yield g


@pytest.fixture(scope="module")
def dp(engines: dict[str, VllmEngine]) -> VllmEngine:
    if DP_ALGO not in engines:
        pytest.skip(NO_XXHASH)
    return engines[DP_ALGO]


def ranks(e: VllmEngine) -> tuple[str, str]:
    return f"{e.id}@0", f"{e.id}@1"


@pytest.mark.parametrize("algo", list(ALGOS))
def test_parity_self_test_reproduces_the_engines_hashes_and_claims_are_exact(
        algo: str, engines: dict[str, VllmEngine], gw: Gateway) -> None:
    if not runnable(algo):
        pytest.skip(NO_XXHASH)
    model = served(algo)
    messages = long_chat(220, seed=500)
    h, usage = chat(gw, messages, model=model)
    target = h["x-cortex-assigned-worker"]  # the worker, or one rank of the DP engine
    assert target.split("@")[0] == engines[algo].id
    parity = wait_for(lambda: (lambda p: p if p["status"] != "unknown" else None)(gw.targets()[target]["parity"]),
                      what="the first chain start judged")
    seed = ALGOS[algo] if ALGOS[algo] is not None else "vllm-none-hash"
    assert parity["status"] == "ok" and parity["checked"] >= 1, parity
    assert f"{algo} with seed {seed!r}" in parity["reason"], parity
    assert gw.targets()[target]["exact_kv"]

    wait_for(lambda: matched(gw, messages, model=model)[target] > 0, what="the chat in the ledger")
    h, usage = chat(gw, messages, model=model)
    assert h["x-cortex-assigned-worker"] == target
    assert h["x-cortex-match-mode"] == "exact_kv_events"
    assert claimed(h) == cached(usage) > 0, (dict(h), usage)


def test_data_parallel_ranks_are_two_targets_and_repeats_are_pinned_to_the_holding_rank(
        gw: Gateway, dp: VllmEngine) -> None:
    model = dp.served_model_name
    assert set(ranks(dp)) <= set(gw.targets())
    chats = [long_chat(220, seed=600 + i) for i in range(2)]
    # Two at once, long enough to overlap: the in-flight count puts them on both ranks.
    with ThreadPoolExecutor(2) as pool:
        heads = list(pool.map(lambda m: chat(gw, m, model=model, max_tokens=32)[0], chats))
    holders = [h["x-cortex-assigned-worker"] for h in heads]
    assert sorted(holders) == list(ranks(dp)), holders
    for messages, holder in zip(chats, holders, strict=True):
        wait_for(lambda m=messages, t=holder: matched(gw, m, model=model)[t] > 0, what=f"{holder}'s blocks")
        other = next(t for t in ranks(dp) if t != holder)
        assert matched(gw, messages, model=model)[other] == 0  # each rank has a cache of its own
        h, usage = chat(gw, messages, model=model)
        assert h["x-cortex-assigned-worker"] == holder
        assert h["x-cortex-match-mode"] == "exact_kv_events"
        assert claimed(h) == cached(usage) > 0, (dict(h), usage)


def test_lora_requests_claim_exactly_the_blocks_stored_under_the_adapter(gw: Gateway, dp: VllmEngine) -> None:
    messages = long_chat(220, seed=700)
    h, usage = chat(gw, messages, model=ADAPTER)
    assert claimed(h) == cached(usage) == 0
    holder = h["x-cortex-assigned-worker"]
    wait_for(lambda: matched(gw, messages, model=ADAPTER)[holder] > 0, what="the adapter's blocks in the ledger")
    # The same messages on the base model are other blocks to the engine (the adapter is in every block's hash):
    # nothing to claim for them, and the engine agrees.
    assert matched(gw, messages, model=dp.served_model_name) == dict.fromkeys(ranks(dp), 0)
    h, usage = chat(gw, messages, model=dp.served_model_name)
    assert claimed(h) == cached(usage) == 0, (dict(h), usage)

    h, usage = chat(gw, messages, model=ADAPTER)
    assert h["x-cortex-assigned-worker"] == holder
    assert h["x-cortex-match-mode"] == "exact_kv_events"
    assert claimed(h) == cached(usage) > 0, (dict(h), usage)
