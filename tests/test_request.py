"""Bad bodies are refused with the right status and a message naming the field."""

from __future__ import annotations

import orjson
import pytest

from cortex.errors import ClientError
from extproc.request import parse_body


def body(**kw: object) -> bytes:
    return orjson.dumps({"model": "m", **kw})


@pytest.mark.parametrize(("kind", "raw", "param"), [
    ("chat", b"{not json", None),
    ("chat", b"[1, 2]", None),
    ("chat", orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), "model"),
    ("chat", body(), "messages"),
    ("chat", body(messages=[]), "messages"),
    ("chat", body(messages="hi"), "messages"),
    ("chat", body(messages=[{"content": "x"}]), "messages"),
    ("chat", body(messages=[{"role": "user", "content": 5}]), "messages"),
    ("chat", body(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]), "messages"),
    ("chat", body(messages=[{"role": "user", "content": "x"}], stream="yes"), "stream"),
    ("chat", body(messages=[{"role": "user", "content": "x"}], tools={}), "tools"),
    ("chat", body(messages=[{"role": "user", "content": "x"}], cache_salt=""), "cache_salt"),
    ("chat", body(messages=[{"role": "user", "content": "x"}], cache_salt="a/b"), "cache_salt"),
    ("chat", body(messages=[{"role": "user", "content": "x"}], cache_salt="x" * 129), "cache_salt"),
    ("completion", body(), "prompt"),
    ("completion", body(prompt=5), "prompt"),
    ("completion", body(prompt=[]), "prompt"),
    ("completion", body(prompt=[1, "a"]), "prompt"),
    ("completion", body(prompt=[-1]), "prompt"),
])
def test_refused_with_400(kind: str, raw: bytes, param: str | None) -> None:
    with pytest.raises(ClientError) as info:
        parse_body(kind, raw)  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == param
    err = orjson.loads(info.value.body())["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and err["message"]


def test_accepted_shapes() -> None:
    r = parse_body("chat", body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}],
                                cache_salt="t1", stream=True))
    assert r.messages == [{"role": "user", "content": "a\nb"}] and r.cache_salt == "t1" and r.stream
    img = parse_body("chat", body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]))
    assert img.unroutable == "non_text_content"
    assert parse_body("completion", body(prompt=[[1, 2], [3]])).prompt_ids == [1, 2]
    assert parse_body("completion", body(prompt=["a", "b"])).prompt_text == "a"
