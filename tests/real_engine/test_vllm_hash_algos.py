"""Each of vLLM's `--prefix-caching-hash-algo` values on a real vLLM 0.32 engine, proven by Cortex's parity
self-test (ingest/hash_parity.py recomputes the engine's hash of each chain start it sees and reports the result
in /cortex/workers) and by exact claims. `sha256`, vLLM's default, is proven on the shared pair
(test_vllm_pair.py); here one engine per other algorithm, each served as a model of its own behind one
`cortex run`, whose config names the algorithm and seed. The xxhash pair needs PYTHONHASHSEED on the engine
(without it vLLM seeds their root hash from os.urandom: nobody else can recompute it) and the `xxhash` package
in the engine's venv (vLLM keeps it optional and refuses the algorithm without it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Gateway, long_chat, wait_for
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

# algorithm -> PYTHONHASHSEED on the engine (None: unset)
ALGOS: dict[str, str | None] = {"sha256_cbor": None, "xxhash": "0", "xxhash_cbor": "4242"}
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
    logs = tmp_path_factory.mktemp("hash-algos")
    out = {algo: new_engine(f"vllm-{algo.replace('_', '-')}", qwen2_tiny, logs, served_model_name=served(algo),
                            flags=("--prefix-caching-hash-algo", algo),
                            env={"PYTHONHASHSEED": seed} if seed is not None else {})
           for algo, seed in ALGOS.items() if runnable(algo)}
    with running(list(out.values())):
        yield out


@pytest.fixture(scope="module")
def gw(engines: dict[str, VllmEngine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    models: list[dict[str, Any]] = [
        model_entry(served(algo), hash_algo=algo, **({"hash_seed": ALGOS[algo]} if ALGOS[algo] is not None else {}))
        for algo in engines]
    with gateway(tmp_path_factory.mktemp("hash-algos-gw"), list(engines.values()), models=models) as g:
        yield g


@pytest.mark.parametrize("algo", list(ALGOS))
def test_parity_self_test_reproduces_the_engines_hashes_and_claims_are_exact(
        algo: str, engines: dict[str, VllmEngine], gw: Gateway) -> None:
    if not runnable(algo):
        pytest.skip(NO_XXHASH)
    worker, model = engines[algo].id, served(algo)
    messages = long_chat(220, seed=500)
    h, usage = chat(gw, messages, model=model)
    assert h["x-cortex-assigned-worker"] == worker
    parity = wait_for(lambda: (lambda p: p if p["status"] != "unknown" else None)(gw.targets()[worker]["parity"]),
                      what="the first chain start judged")
    seed = ALGOS[algo] if ALGOS[algo] is not None else "vllm-none-hash"
    assert parity["status"] == "ok" and parity["checked"] >= 1, parity
    assert f"{algo} with seed {seed!r}" in parity["reason"], parity
    assert gw.targets()[worker]["exact_kv"]

    wait_for(lambda: matched(gw, messages, model=model)[worker] > 0, what="the chat in the ledger")
    h, usage = chat(gw, messages, model=model)
    assert h["x-cortex-match-mode"] == "exact_kv_events"
    assert claimed(h) == cached(usage) > 0, (dict(h), usage)
