"""Hash parity end to end for each of vLLM's four --prefix-caching-hash-algo values (issue 11, defect 10):
the simulator publishes with the algorithm, ingest recomputes the engine's hashes, and the gateway routes by
the ledger. Real simulated worker, real ZMQ, real Envoy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import cluster, long_chat, wait_for
from tests.test_gateway import chat

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(("algo", "seed", "status"), [
    ("sha256", None, "ok"),
    ("sha256_cbor", "0", "ok"),
    ("xxhash", "0", "ok"),
    ("xxhash_cbor", "vllm-none-hash", "ok"),
    # No PYTHONHASHSEED: the worker's NONE_HASH is random, parity cannot be checked, routing still works.
    ("xxhash_cbor", None, "unchecked"),
])
def test_parity_and_routing_per_hash_algo(tmp_path: Path, algo: str, seed: str | None, status: str) -> None:
    sim_args = ("--hash-algo", algo) + (("--hash-seed", seed) if seed is not None else ())
    model_extra = {"hash_algo": algo} | ({"hash_seed": seed} if seed is not None else {})
    with cluster(tmp_path, n_sims=1, sim_args=sim_args, model_extra=model_extra) as gw:
        messages = long_chat(300, seed=17)
        chat(gw, messages)
        target = wait_for(lambda: (lambda t: t if t["cached_blocks"] > 0 and t["parity"]["status"] != "unknown"
                                   else None)(gw.targets()["sim-1"]), what="first chain start judged")
        assert target["parity"]["status"] == status, target["parity"]
        assert target["exact_kv"], target
        if status == "ok":
            assert target["parity"]["checked"] >= 1 and algo in target["parity"]["reason"]
        else:
            assert "PYTHONHASHSEED" in target["parity"]["reason"]
        h, usage = chat(gw, messages)
        assert h["x-cortex-match-mode"] == "exact_kv_events", h
        assert int(h["x-cortex-cache-hit-tokens"]) == usage["prompt_tokens_details"]["cached_tokens"] > 0
