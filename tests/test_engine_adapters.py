"""Conformance of every engine adapter (cortex/engines, docs/engines.md): each declares every fact of the interface
itself, reproduces its engine's golden block hashes, reads its engine's real load format, and agrees with the
config and the simulator. A new adapter runs here as soon as its file exists; the tables below then name what
it must add (its golden vectors and a load fixture)."""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any, get_args

import aiohttp
import pytest

from cortex import engines
from cortex.config import ConfigError, ModelConfig, PdConfig, WorkerConfig, parse_config
from cortex.engine_hashes import LoraRef, vllm_event_extra_keys, vllm_extra_keys
from cortex.engines import ENGINE_NAMES, EngineAdapter, NotReproducible, RankLoad, adapter, all_adapters
from cortex.kv_events import TIER_GPU, TIERS
from cortex.media import MediaSpan
from cortexsim.config import ENGINES as SIM_ENGINES
from cortexsim.config import SimConfig
from tests.sim import simkit

FIXTURES = Path(__file__).parent / "fixtures" / "engines"
U64 = (1 << 64) - 1
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]
ADAPTERS = pytest.mark.parametrize("eng", all_adapters(), ids=lambda a: a.name)

# Golden facts per engine. Page sizes are the engines' own defaults (vLLM --block-size 16, SGLang --page-size 1
# on CUDA); hashes are the literal vectors tests/test_engine_hashes.py and tests/test_ledger.py pin
# (kv-events.md §9.1, §9.3): (hash_algo, hash_seed, tokens, page size, salt) -> wire hashes as ingest holds them.
PAGE_SIZE = {"vllm": 16, "sglang": 1}
DEFAULT_HASH_ALGO = {"vllm": "sha256", "sglang": None}
HASHES: dict[str, list[tuple[str | None, str | None, list[int], int, str | None, list[int]]]] = {
    "vllm": [
        (None, None, TOKENS, 4, None, [1882140585328457242, 15284023028817948126]),
        ("sha256_cbor", None, TOKENS, 4, None, [9561501211280363793, 15292913576410714033]),
        ("sha256_cbor", None, TOKENS, 4, "tenant-a", [4280308768446823598, 5400091051297473476]),
        ("sha256_cbor", "0", TOKENS, 4, None, [2164874634404590027, 17270480062156288726]),
        ("xxhash", "0", TOKENS, 4, None, [5138823041740264343, 1324190186712315504]),
        ("xxhash_cbor", "0", TOKENS, 4, None, [1560721706249274670, 16652244415917022755]),
    ],
    "sglang": [
        (None, None, TOKENS, 4, None, [-3488128144981237669 & U64, 5674439469042975057]),
        (None, None, [1, 2, 3, 4], 4, "s1", [8751685944416650314]),
        (None, None, [1, 2, 3], 1, None, [7470307888890966271, -1634645291211865391 & U64, 7325169757385981536]),
    ],
}
# (hash_algo, hash_seed, words the reason must contain): configurations no one outside the engine can hash.
NOT_REPRODUCIBLE: dict[str, list[tuple[str | None, str | None, str]]] = {
    "vllm": [("xxhash", None, "PYTHONHASHSEED"), ("xxhash_cbor", None, "PYTHONHASHSEED"),
             ("md5", None, "not reproduced")],
    "sglang": [],
}
# The fixture's readings: (running, waiting, activity, KV usage) per DP rank.
LOADS = {
    # The pool: vLLM's cache_config_info labels every DP rank with the sum of their blocks (54 000 x 16 / 2).
    # Then the tokens computed (queries less hits) and the requests finished for any reason (None: not reported).
    "vllm": {0: (3.0, 2.0, 48213.0, 0.4212, 432000.0, 48213.0 - 30112.0, 54.0),
             1: (1.0, 0.0, 1607.0, 0.0815, 432000.0, 1607.0 - 640.0, 3.0)},
    "sglang": {0: (5.0, 7.0, 902211.0, 0.197, 412345.0, None, None), 1: (0.0, 0.0, 31.0, 0.0, 412345.0, None, None)},
}
RANK = {"vllm": ({"x-data-parallel-rank": "3"}, {}), "sglang": ({}, {"routed_dp_rank": 3})}
LORA = {"vllm": (True, False, False), "sglang": (False, True, True)}  # as model, as suffix, lora_path
PD = {"vllm": ("sequential", True, False, True), "sglang": ("concurrent", False, True, False)}
COUNTED_MEDIA = {"vllm": {"CPU", "STORAGE"}, "sglang": set()}  # lower tiers reported in cached_tokens
TOKENIZE = {"vllm": ("/tokenize", {"add_generation_prompt": True}), "sglang": ("/v1/tokenize", {})}


def golden(table: dict[str, Any], eng: EngineAdapter) -> Any:
    assert eng.name in table, f"engine {eng.name!r}: add its golden expectations to this table"
    return table[eng.name]


# -- the interface and the registry ------------------------------------------------------------------------------


@ADAPTERS
def test_declares_every_fact_and_method_itself(eng: EngineAdapter) -> None:
    cls = type(eng)
    facts = [n for n in EngineAdapter.__annotations__ if not n.startswith("_")]
    assert facts, "the interface lists its facts as annotations"
    missing = [n for n in facts if n not in vars(cls)]
    assert not missing, f"{cls.__name__} does not declare {missing} itself"
    methods = [n for n, f in vars(EngineAdapter).items() if getattr(f, "__isabstractmethod__", False)]
    assert methods and all(n in vars(cls) for n in methods)
    assert not cls.__abstractmethods__
    for n in methods:  # same parameters as the interface, so every caller can use any adapter
        assert list(inspect.signature(getattr(cls, n)).parameters) == list(
            inspect.signature(getattr(EngineAdapter, n)).parameters), n


@ADAPTERS
def test_facts_have_their_types(eng: EngineAdapter) -> None:
    assert isinstance(eng.name, str) and eng.name and adapter(eng.name) is eng
    assert isinstance(eng.default_page_size, int) and eng.default_page_size >= 1
    assert eng.page_size_flag.startswith("--")
    assert eng.default_hash_algo is None or isinstance(eng.default_hash_algo, str)
    assert eng.event_layout == "msgpack-kv-events", "ingest/events.py decodes only this layout"
    assert eng.load_path.startswith("/")
    for flag in (eng.lora_as_model, eng.lora_as_suffix, eng.lora_path_field, eng.pd_roles_serve_alone,
                 eng.pd_prefill_needs_bootstrap_port, eng.pd_single_consumer):
        assert isinstance(flag, bool)
    assert eng.pd_legs in get_args(engines.PdLegs)
    # A bootstrap port that must be known must be readable from the worker, and only then.
    assert (eng.bootstrap_port_info is not None) == eng.pd_prefill_needs_bootstrap_port
    if eng.bootstrap_port_info is not None:
        path, key = eng.bootstrap_port_info
        assert path.startswith("/") and key
    assert isinstance(eng.counted_media, frozenset) and eng.counted_media <= set(TIERS) - {TIER_GPU}


@ADAPTERS
def test_counted_media(eng: EngineAdapter) -> None:
    """Only lower tiers whose hits the engine reports in cached_tokens are claimed (vLLM: connector hits are its
    external hits, counted; SGLang: not proven, so never claimed)."""
    assert eng.counted_media == golden(COUNTED_MEDIA, eng)


def test_registry_is_what_the_config_accepts() -> None:
    assert ENGINE_NAMES[0] == engines.DEFAULT_ENGINE == "vllm"
    assert set(ENGINE_NAMES) == {a.name for a in all_adapters()} >= {"vllm", "sglang"}
    for model in (ModelConfig, WorkerConfig):
        field = model.model_fields["engine"]
        assert get_args(field.annotation) == ENGINE_NAMES and field.default == engines.DEFAULT_ENGINE
    with pytest.raises(KeyError, match="known: vllm, sglang"):
        adapter("trtllm")
    with pytest.raises(ConfigError, match=r"models\.0\.engine: Input should be 'vllm' or 'sglang'"):
        parse_config({"models": [{"name": "m", "engine": "trtllm", "tokenizer": "x"}]})


# -- pages and hashes --------------------------------------------------------------------------------------------


@ADAPTERS
def test_page_size_default(eng: EngineAdapter) -> None:
    assert eng.default_page_size == golden(PAGE_SIZE, eng)
    assert ModelConfig(name="m", engine=eng.name, tokenizer="x").engine_page_size() == eng.default_page_size
    assert ModelConfig(name="m", engine=eng.name, tokenizer="x", page_size=32).engine_page_size() == 32
    if eng.name in SIM_ENGINES:  # the simulator models the engine's own default independently
        assert SimConfig(engine=eng.name).page_size == eng.default_page_size


@ADAPTERS
def test_chain_start_hashes_match_the_golden_vectors(eng: EngineAdapter) -> None:
    assert eng.default_hash_algo == golden(DEFAULT_HASH_ALGO, eng)
    vectors = golden(HASHES, eng)
    assert vectors, "at least one golden vector"
    for algo, seed, tokens, page, salt, wire in vectors:
        hasher = eng.chain_start_hasher(algo, seed)
        got = hasher.wire_hashes(tokens, page, salt)
        assert got == wire, (algo, seed, salt)
        assert all(0 <= h <= U64 for h in got)
        assert hasher.how
        if page > 1:  # a partial page is never hashed (no engine caches one)
            assert hasher.wire_hashes([*tokens, 9], page, salt) == wire


@ADAPTERS
def test_unreproducible_configurations_say_why(eng: EngineAdapter) -> None:
    for algo, seed, why in golden(NOT_REPRODUCIBLE, eng):
        with pytest.raises(NotReproducible, match=why):
            eng.chain_start_hasher(algo, seed)


# -- events --------------------------------------------------------------------------------------------------------


@ADAPTERS
def test_event_salt_field_wins_and_absence_is_none(eng: EngineAdapter) -> None:
    assert eng.event_salt("tenant-a", None, None) == "tenant-a"
    assert eng.event_salt("tenant-a", [["other"]], None) == "tenant-a"
    assert eng.event_salt(None, None, None) is None
    assert eng.event_salt(None, [], "sql") is None


def test_vllm_salt_is_read_from_its_untagged_extra_keys() -> None:
    vllm = adapter("vllm")
    lora = LoraRef("sql-lora", "/adapters/sql")

    def published(salt: str | None, ref: LoraRef | None) -> list[Any]:
        # vLLM's own per-block extra keys, as its events publish them (lists after msgpack).
        return [list(k) if (k := vllm_event_extra_keys(vllm_extra_keys(i * 4, cache_salt=salt, lora=ref)))
                else None for i in range(2)]

    assert vllm.event_salt(None, published("tenant-a", None), None) == "tenant-a"
    assert vllm.event_salt(None, published("tenant-a", lora), "sql-lora") == "tenant-a"
    assert vllm.event_salt(None, published(None, lora), "sql-lora") is None
    assert vllm.event_salt(None, ["not-a-list"], None) is None


def test_sglang_salt_is_its_field_or_the_rfc_extra_key() -> None:
    """SGLang 0.5.23 sends `cache_salt`; RFC sgl-project/sglang#39991 (vLLM's schema) also sends the salt as the
    one element of block 0's extra key, `[(salt,), None, ...]` (lists after msgpack). Anything else is no salt."""
    sgl = adapter("sglang")
    assert sgl.event_salt("tenant-a", None, None) == "tenant-a"
    assert sgl.event_salt(None, [["tenant-a"], None], None) == "tenant-a"
    assert sgl.event_salt("field", [["extra"]], None) == "field"  # both sent (the RFC keeps the field): the field
    assert sgl.event_salt(None, [None, ["tenant-a"]], None) is None  # not on the first block
    assert sgl.event_salt(None, [["a", "b"]], None) is None
    assert sgl.event_salt(None, [[7]], None) is None


# -- load ----------------------------------------------------------------------------------------------------------


@ADAPTERS
def test_load_parser_reads_the_engines_real_metric_names(eng: EngineAdapter) -> None:
    fixture = FIXTURES / f"{eng.name}_load.txt"
    assert fixture.exists(), f"engine {eng.name!r}: add {fixture} (a real {eng.load_path} body)"
    assert eng.parse_load(fixture.read_bytes()) == golden(LOADS, eng)


@ADAPTERS
@pytest.mark.parametrize("body", [b"", b"<html><body>502 Bad Gateway</body></html>", b'{"loads": "x"}', b"\xff\xfe"])
def test_load_parser_refuses_foreign_bodies_cleanly(eng: EngineAdapter, body: bytes) -> None:
    """A proxy's error page or a truncated body reads as nothing, or as ValueError (a failed reading)."""
    with contextlib.suppress(ValueError):
        assert eng.parse_load(body) == {}


@pytest.mark.parametrize("name", [n for n in ENGINE_NAMES if n in SIM_ENGINES])
def test_load_parser_and_rank_placement_against_the_simulator(name: str) -> None:
    """The simulator's load endpoint, two DP ranks: a request pinned to rank 1 the adapter's way runs there."""
    eng = adapter(name)

    async def scenario(server: Any, http: aiohttp.ClientSession) -> None:
        async def load() -> dict[int, RankLoad]:
            async with http.get(eng.load_path) as resp:
                assert resp.status == 200
                return eng.parse_load(await resp.read())

        before = await load()
        assert set(before) == {0, 1} and all(v[0] == 0 and v[1] == 0 for v in before.values())
        body = {"model": simkit.MODEL, "prompt": "The quick brown fox " * 20, "max_tokens": 2,
                **eng.rank_body(1)}
        async with http.post("/v1/completions", json=body, headers=dict(eng.rank_headers(1))) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
        after = await load()
        assert after[1][2] > before[1][2], "the pinned rank did the prefill"
        assert after[0][2] == before[0][2], "the other rank did not"

    simkit.serve(scenario, simkit.config(engine=name, dp_size=2))


# -- LoRA, DP ranks, PD, tokenize ------------------------------------------------------------------------------------


@ADAPTERS
def test_lora_rules(eng: EngineAdapter) -> None:
    assert (eng.lora_as_model, eng.lora_as_suffix, eng.lora_path_field) == golden(LORA, eng)
    assert eng.lora_as_model or eng.lora_as_suffix or eng.lora_path_field, "a client can pick an adapter somehow"


@ADAPTERS
def test_rank_is_placed_one_way(eng: EngineAdapter) -> None:
    headers, body = eng.rank_headers(3), eng.rank_body(3)
    assert (dict(headers), dict(body)) == golden(RANK, eng)
    assert bool(headers) != bool(body), "exactly one of header and body carries the rank"
    assert (dict(eng.rank_headers(0)), dict(eng.rank_body(0))) != ({}, {})


@ADAPTERS
def test_pd_legs_and_start_budget(eng: EngineAdapter) -> None:
    assert (eng.pd_legs, eng.pd_roles_serve_alone, eng.pd_prefill_needs_bootstrap_port,
            eng.pd_single_consumer) == golden(PD, eng)
    pd = PdConfig(prefill_timeout_s=60, dispatch_timeout_s=2)
    wait = eng.pd_prefill_wait_s(pd)
    assert wait == (pd.prefill_timeout_s if eng.pd_legs == "sequential" else pd.dispatch_timeout_s)
    assert pd.start_budget_s(eng.name) == 2 * wait


@ADAPTERS
def test_bootstrap_port_only_where_the_engine_pairs_by_it(eng: EngineAdapter) -> None:
    def cfg(role: str) -> dict[str, Any]:
        return {"models": [{"name": "m", "engine": eng.name, "tokenizer": "x"}],
                "workers": [{"id": "w", "url": "http://127.0.0.1:9000", "model": "m", "engine": eng.name,
                             "role": role, "bootstrap_port": 8998}]}

    if eng.pd_prefill_needs_bootstrap_port:
        assert parse_config(cfg("prefill")).workers[0].bootstrap_port == 8998
    else:
        with pytest.raises(ConfigError, match="bootstrap_port"):
            parse_config(cfg("prefill"))
    with pytest.raises(ConfigError, match="bootstrap_port"):
        parse_config(cfg("decode"))


@ADAPTERS
def test_tokenize_request(eng: EngineAdapter) -> None:
    path, chat_extra = golden(TOKENIZE, eng)
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
    assert eng.tokenize_request("m", chat) == (path, {"model": "m", **chat, **chat_extra})
    assert eng.tokenize_request("m", {"prompt": "p"}) == (path, {"model": "m", "prompt": "p"})
    assert chat == {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}


# What each engine reads from its prefix cache, per request (sources in the adapters' comments): (api, body) -> limit.
CACHE_READS: dict[str, list[tuple[str, dict[str, Any], int | None]]] = {
    "vllm": [
        ("chat", {}, None),
        ("chat", {"prompt_logprobs": 0}, 0),  # any value, 0 included: the prompt is computed whole
        ("chat", {"prompt_logprobs": None}, None),
        ("chat", {"echo": True}, 0),  # top_logprobs defaults to 0, which becomes prompt_logprobs
        ("chat", {"echo": True, "top_logprobs": None}, None),
        ("chat", {"echo": False, "top_logprobs": 5}, None),
        ("completion", {"echo": True}, None),  # logprobs defaults to None
        ("completion", {"echo": True, "logprobs": 0}, 0),
        ("completion", {"prompt_logprobs": 2}, 0),
        ("responses", {"prompt_logprobs": 2}, None),  # not a field of that API
    ],
    "sglang": [
        ("chat", {"echo": True, "logprobs": True}, None),  # its chat server always starts logprobs at -1
        ("completion", {"echo": True, "logprobs": 1}, 0),
        ("completion", {"echo": True, "logprobs": 0}, None),
        ("completion", {"logprobs": 3}, None),
        ("generate", {"return_logprob": True}, None),  # logprob_start_len -1: output only
        ("generate", {"return_logprob": True, "logprob_start_len": 0}, 0),
        ("generate", {"return_logprob": True, "logprob_start_len": 300}, 300),
        ("generate", {"return_logprob": True, "logprob_start_len": [64, 8]}, 64),  # a batch: routed by the first
        ("generate", {"return_logprob": False, "logprob_start_len": 0}, None),
    ],
}


@ADAPTERS
def test_cache_read_limit(eng: EngineAdapter) -> None:
    for api, body, limit in golden(CACHE_READS, eng):
        assert eng.cache_read_limit(api, body) == limit, (api, body)


# Per engine: (media items as (offset, length, identifier), pages, page size) -> each page's media keys as its events
# publish them, or None where Cortex does not reproduce them (tests/test_media.py holds vLLM's own vectors).
MEDIA_PAGES: dict[str, Any] = {
    "vllm": [
        (([(5, 6, "a")], 4, 4), [[], [["a", 1]], [["a", -3]], []]),
        (([(2, 3, "a"), (5, 9, "b")], 4, 4), [[["a", 2]], [["a", -2], ["b", 1]], [["b", -3]], [["b", -7]]]),
        (([], 2, 16), [[], []]),
    ],
    "sglang": [(([(5, 6, "a")], 4, 4), None)],
}


@ADAPTERS
def test_media_page_extras(eng: EngineAdapter) -> None:
    for (items, pages, size), want in golden(MEDIA_PAGES, eng):
        assert eng.media_page_extras([MediaSpan(*i) for i in items], pages, size) == want, items
