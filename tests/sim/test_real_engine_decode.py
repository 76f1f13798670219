"""The simulator's KV-event bytes decoded and re-encoded by the engines' own event classes.

kv-events.md §8 C: only the real source files are loaded (vLLM's ``distributed/kv_events.py`` and
``config/kv_events.py``, SGLang's ``disaggregation/kv_events.py`` and ``utils/network.py``), with the few
imported names they need stubbed. The files come from the released wheels, fetched at test time with
``pip download --no-deps`` into a cache directory ($CORTEX_ENGINE_WHEELS, default ~/.cache/cortex/engine-wheels)
and never committed. Where the download is impossible this one test module skips; the golden-vector tests in
test_kv_events / test_radix_cache / test_engine_hashes still pin the bytes.

The check is strict in both directions: the real ``msgspec`` decoder for the engine's ``KVEventBatch`` must
accept the simulator's payload (field names, tags and types), and the engine's encoder must reproduce the
simulator's bytes exactly from what it decoded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cortex.engine_hashes import LoraRef
from cortex.kv_events import decode_batch, decode_sglang_batch, encode_batch
from cortexsim.kv_events import now_batch
from cortexsim.prefix_cache import PrefixCache
from cortexsim.radix_cache import RadixCache
from tests.engine_wheels import PUBLISHER_FILES as FILES
from tests.engine_wheels import PUBLISHER_STUBS as STUBS
from tests.engine_wheels import SGLANG, VLLM, extract

# Runs in a child interpreter so the stub packages never shadow anything in the test process.
CHECK = r"""
import json, sys, types
try:
    import psutil  # noqa: F401  (imported by sglang's network.py, unused by the event classes)
except ImportError:
    sys.modules["psutil"] = types.ModuleType("psutil")
import msgspec
from vllm.distributed.kv_events import KVEventBatch as VllmBatch
from sglang.srt.disaggregation.kv_events import KVEventBatch as SglBatch
cases = json.load(sys.stdin)
out = []
for engine, payload_hex in cases:
    cls = VllmBatch if engine == "vllm" else SglBatch
    payload = bytes.fromhex(payload_hex)
    batch = msgspec.msgpack.Decoder(cls).decode(payload)
    again = msgspec.msgpack.Encoder().encode(batch)
    out.append({"same": again == payload, "types": [type(e).__name__ for e in batch.events]})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def engine_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("engine-src")
    extract(root, VLLM, FILES["vllm"], {k: v for k, v in STUBS.items() if k.startswith("vllm/")})
    return extract(root, SGLANG, FILES["sglang"], {k: v for k, v in STUBS.items() if k.startswith("sglang/")})


def _vllm_payloads() -> list[bytes]:
    cache = PrefixCache(5, 4, kv_cache_spec_kind="full_attention")
    lora = LoraRef("sql-lora", "/adapters/sql", int_id=3)
    out: list[bytes] = []
    assert cache.admit("a", list(range(1, 10)), cache_salt="tenant-a", lora=lora) is not None
    cache.commit("a", 9)
    cache.free("a")
    out.append(encode_batch(now_batch(cache.take_events(), 0)))
    assert cache.admit("b", list(range(100, 116))) is not None  # evicts a's blocks
    cache.commit("b", 16)
    out.append(encode_batch(now_batch(cache.take_events(), 1)))
    cache.free("b")
    assert cache.reset()
    out.append(encode_batch(now_batch(cache.take_events(), 0)))
    return out


def _sglang_payloads() -> list[bytes]:
    cache = RadixCache(6, 4)
    out = [encode_batch(now_batch(cache.take_events(), 0))]
    lora = LoraRef("sql", "/adapters/sql")
    for rid, kw in (("a", {"cache_salt": "s1"}), ("b", {"lora": lora}), ("c", {})):
        assert cache.admit(rid, list(range(1, 10)), **kw) is not None
        cache.commit(rid, 9)
        cache.free(rid)
    out.append(encode_batch(now_batch(cache.take_events(), 0)))
    assert cache.admit("d", list(range(500, 520))) is not None  # evicts and coalesces removals
    out.append(encode_batch(now_batch(cache.take_events(), 2)))
    return out


def test_real_engine_classes_decode_and_reencode_the_simulator_bytes(engine_sources: Path) -> None:
    cases = [("vllm", p.hex()) for p in _vllm_payloads()] + [("sglang", p.hex()) for p in _sglang_payloads()]
    env = {**os.environ, "PYTHONPATH": str(engine_sources)}
    proc = subprocess.run([sys.executable, "-c", CHECK], input=json.dumps(cases), capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    ours = [[type(e).__name__.removeprefix("Sgl") for e in
             (decode_batch if engine == "vllm" else decode_sglang_batch)(bytes.fromhex(h)).events]
            for engine, h in cases]
    assert [r["types"] for r in results] == ours
    assert {t for types in ours for t in types} == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert all(r["same"] for r in results), results
