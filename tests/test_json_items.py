"""extproc/json_items.py: a body decoded through the element cache is the body orjson decodes, errors included, and
nothing downstream changes a cached element."""

from __future__ import annotations

import copy
import random
from typing import Any

import orjson
import pytest

from cortex import api_paths
from extproc import inference_paths, json_items
from extproc.json_items import MIN_BYTES, ItemCache
from tests.test_early_stop import MODEL, Fleet

PLAIN = ["lorem", "ipsum", "dolor", "sit", "amet"]
WIDE = ["ĉeĥoslovakio", "Ελλάδα", "東京", "naïve", "façade", *PLAIN]


def text(rng: random.Random, n: int, wide: bool = True) -> str:
    words = WIDE if wide else PLAIN
    return " ".join(rng.choice(words) for _ in range(n))


def chat_body(rng: random.Random, turns: int, wide: bool = True) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": text(rng, 300, wide)}]
    for i in range(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text(rng, rng.choice([3, 200]), wide)})
    if msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": "and?"})
    return {"model": MODEL, "messages": msgs, "max_tokens": 5, "temperature": 0.5, "stop": ["ü" if wide else "u"]}


@pytest.mark.parametrize("seed", range(8))
def test_the_decoded_body_is_orjsons(seed: int) -> None:
    rng = random.Random(seed)
    cache = ItemCache()
    doc = chat_body(rng, rng.randint(1, 12), wide=seed % 4 != 0)
    raw = orjson.dumps(doc)
    for _ in range(2):  # first seen, then from the cache
        assert json_items.load(raw, "messages", cache) == orjson.loads(raw) == doc
    long = sum(len(orjson.dumps(m)) >= MIN_BYTES for m in doc["messages"])
    if seed % 4 != 0:
        assert cache.hits == long and cache.misses == long
    else:  # ASCII: orjson alone, nothing cached
        assert cache.hits == cache.misses == 0


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "messages": "not a list"}',
    b'{"model": "m", "messages": {"role": "user"}}',
    b'{"model": "m", "messages": []}',
    b'{"messages": [1, "two", null, [3]], "model": "\xc3\xa9"}',
    b'{"model": "\xc3\xa9", "model": "second", "messages": [{"content": "x"}]}',
    b'  {"model" : "\xc3\xa9" ,\n "messages" : [ {"a": 1} , {"b": [2]} ] }  ',
    b'{"model": "\xc3\xa9", "n": 123456789012345678901234567890}',  # past 64 bits: a float, as orjson reads it
    b'["\xc3\xa9"]',  # no object: decoded whole (the request parser refuses it)
])
def test_odd_shapes_decode_as_orjson_does(raw: bytes) -> None:
    assert json_items.load(raw, "messages", ItemCache()) == orjson.loads(raw)


def error(fn: Any, raw: bytes) -> str:
    with pytest.raises(orjson.JSONDecodeError) as exc:
        fn(raw)
    return str(exc.value)


LONG = ("é" * MIN_BYTES).encode()


@pytest.mark.parametrize("raw", [
    b'{"model": "\xc3\xa9", "messages": [',  # cut
    b'{"model": "\xc3\xa9", "messages": [{"content": "' + LONG + b'"}]} trailing',
    b'{"model": "\xc3\xa9", "messages": [{"content": "' + LONG + b'\xff"}]}',  # invalid UTF-8 in an element
    b'{"model": "\xc3\xa9", "messages": [{"content": "' + LONG + b'\\ud800"}]}',  # a lone surrogate
    b'{"model": "\xc3\xa9", "messages": [{"content": NaN}]}',
    b'{"model": "\xc3\xa9\xff"}',
])
def test_what_orjson_refuses_is_refused_with_its_words(raw: bytes) -> None:
    cache = ItemCache()
    assert error(lambda r: json_items.load(r, "messages", cache), raw) == error(orjson.loads, raw)


def test_the_cache_holds_its_byte_bound_least_recently_used_out() -> None:
    cache = ItemCache(max_bytes=3 * 1024)
    elements = [orjson.dumps({"content": f"{i} " + "é" * 500}) for i in range(5)]
    size = len(elements[0])
    assert MIN_BYTES <= size <= 1024
    for e in elements[:3]:
        json_items.load(b'{"messages": [' + e + b"]}", "messages", cache)
    assert cache.bytes == 3 * size
    json_items.load(b'{"messages": [' + elements[0] + b"]}", "messages", cache)  # 0 is used again
    json_items.load(b'{"messages": [' + elements[3] + b"]}", "messages", cache)  # 1, the oldest, goes
    assert cache.bytes <= cache.max_bytes
    hits = cache.hits
    json_items.load(b'{"messages": [' + elements[0] + b"]}", "messages", cache)
    assert cache.hits == hits + 1
    json_items.load(b'{"messages": [' + elements[1] + b"]}", "messages", cache)
    assert cache.hits == hits + 1  # 1 was dropped


def bodies(rng: random.Random) -> dict[str, dict[str, Any]]:
    chat = chat_body(rng, 5)
    tool_call = {"type": "function_call", "call_id": "c1", "name": "grep", "arguments": orjson.dumps(
        {"pattern": text(rng, 150)}).decode()}
    return {
        api_paths.CHAT: chat,
        api_paths.RESPONSES: {"model": MODEL, "instructions": text(rng, 200), "input": [
            {"role": "user", "content": text(rng, 200)}, tool_call,
            {"type": "function_call_output", "call_id": "c1", "output": text(rng, 200)},
            {"role": "user", "content": [{"type": "input_text", "text": text(rng, 200)}]}]},
        api_paths.MESSAGES: {"model": MODEL, "max_tokens": 4, "system": text(rng, 200), "messages": [
            {"role": "user", "content": text(rng, 200)},
            {"role": "assistant", "content": [{"type": "text", "text": text(rng, 150)},
                                              {"type": "tool_use", "id": "t1", "name": "grep",
                                               "input": {"pattern": text(rng, 100)}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": text(rng, 200)}]}]},
    }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    return Fleet(tmp_path_factory.mktemp("fleet"))


@pytest.mark.parametrize("path", [api_paths.CHAT, api_paths.RESPONSES, api_paths.MESSAGES])
def test_routing_never_changes_a_cached_element(fleet: Fleet, path: str) -> None:
    doc = bodies(random.Random(5))[path]
    raw = orjson.dumps(doc)
    pristine = copy.deepcopy(doc)
    json_items.ITEMS.clear()
    for _ in range(3):  # the first decodes and caches, the next take the cached elements
        req = inference_paths.parse(path, raw, fleet.router.registry)
        fleet.router.commit(fleet.router.decide(req))
        fleet.router.deferred.run_pending()
        assert req.body == pristine
    assert json_items.ITEMS.hits > 0
