"""Two real vLLM engines serving a tiny Qwen2-VL behind `cortex run`: chats with images as base64 data URLs.

vLLM folds each image's `(identifier, offset)` into the hash of every KV block its placeholder tokens fill. Cortex
computes the same identifiers, placeholder counts and block keys (extproc/media_prompt.py), so a chat with an image
is routed to the engine that holds its blocks and claimed exactly: the text before the image as text, the image's
blocks and the text after them only where the same image sits at the same place. Checked here against the
engines' own answers: `/v1/chat/completions/render` (token ids, each item's hash and placeholder range) and
`cached_tokens` on every response (claims equal it, so never above it).

vLLM CPU needs the `torchvisionless/` shim to load Qwen2-VL's processor (tests/real_engine/models.py). Predictions
are off (`extproc.prediction_ttl_s: 0`) and `settle` waits for every published event before each request, as in
the other real-engine modules, so each claim is compared with the state the engine decided on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cortex import engines
from cortex.config import ModelConfig
from cortex.model_bundle import ModelBundle
from extproc import media_prompt
from extproc.prepare import prompt_text
from extproc.request import parse_body
from tests.harness import MODEL, Gateway
from tests.real_engine.models import QWEN2_VL_ENV
from tests.real_engine.vllm_engine import (
    BLOCK,
    VllmEngine,
    cached,
    chat,
    claimed,
    gateway,
    model_entry,
    new_engine,
    running,
    settle,
)

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "media_vectors.json").read_text())
IMAGES = {i["name"]: i["url"] for i in VECTORS["images"]}
SYSTEM = " ".join(f"Rule {i}: describe what you see in plain words, item by item." for i in range(12))


@pytest.fixture(scope="module")
def pair(vllm_available: None, qwen2_vl_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        list[VllmEngine]]:
    logs = tmp_path_factory.mktemp("media-logs")
    engines_ = [new_engine(f"vl-{i}", qwen2_vl_tiny, logs, env=dict(QWEN2_VL_ENV),
                           flags=("--enable-scale-out", "--limit-mm-per-prompt", '{"image": 4, "video": 0}'))
                for i in (1, 2)]
    with running(engines_):
        yield engines_


@pytest.fixture(scope="module")
def model(qwen2_vl_tiny: Path) -> dict[str, Any]:
    # The engines run `serve <dir>`: vLLM hashes that path into every image's identifier.
    return model_entry(tokenizer=str(qwen2_vl_tiny), media={"model_id": str(qwen2_vl_tiny)})


@pytest.fixture(scope="module")
def gw(pair: list[VllmEngine], model: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with gateway(tmp_path_factory.mktemp("media-gw"), pair, models=[model],
                 extra_config={"extproc": {"prediction_ttl_s": 0}}) as g:
        yield g


def image(name: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": IMAGES[name]}}


def turn(*parts: Any, system: str = SYSTEM) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": list(parts)}]


def ask(gw: Gateway, messages: list[dict[str, Any]]) -> dict[str, Any]:
    settle(gw)
    headers, usage = chat(gw, messages)
    return {"claim": claimed(headers), "cached": cached(usage), "prompt": usage["prompt_tokens"],
            "worker": headers["x-cortex-assigned-worker"], "reason": headers["x-cortex-route-reason"]}


def cortex_view(model: dict[str, Any], messages: list[dict[str, Any]]) -> media_prompt.MediaPrompt:
    cfg = ModelConfig(**model)
    bundle = ModelBundle.load(cfg.name, cfg.tokenizer_dir())
    req = parse_body("chat", json.dumps({"model": cfg.name, "messages": messages}).encode())
    text, _ = prompt_text(req, bundle, media=True)
    return media_prompt.build(req, bundle, engines.adapter("vllm"), cfg, bundle.encode(text, add_special_tokens=False),
                              BLOCK)


@pytest.mark.parametrize("layout", ["text_image_text", "two_images", "image_first"])
def test_cortex_renders_and_identifies_as_the_engine_does(pair: list[VllmEngine], model: dict[str, Any],
                                                          layout: str) -> None:
    """Token ids, each image's identifier and its placeholder range, as the engine's /render reports them (RGB,
    RGBA and grayscale PNGs, a JPEG turned by its EXIF orientation, one past the pixel bound)."""
    messages = {
        "text_image_text": turn("Look at this: ", image("rgba_png"), " and name its colours."),
        "two_images": turn("First ", image("rotated_jpeg"), " then ", image("large_png"), " compare them."),
        "image_first": [{"role": "user", "content": [image("gray_png"), {"type": "text", "text": "What is it?"}]}],
    }[layout]
    r = httpx.post(f"{pair[0].url}/v1/chat/completions/render", timeout=120,
                   json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    rendered = r.json()
    features = rendered["features"]
    got = cortex_view(model, messages)
    assert got.ids == rendered["token_ids"] and got.keyed == len(got.ids)
    assert [s.identifier for s in got.spans] == features["mm_hashes"]["image"]
    assert [(s.offset, s.length) for s in got.spans] == \
        [(p["offset"], p["length"]) for p in features["mm_placeholders"]["image"]]


def test_images_are_claimed_exactly_where_the_engine_serves_them(gw: Gateway) -> None:
    """Text alone, then the same text before an image, the same chat again, another image after the same text,
    and a next turn: every claim equals the engine's cached_tokens, repeats go to the engine that holds them."""
    rows = []
    first = ask(gw, turn({"type": "text", "text": "Look at this picture, please. "}))
    rows.append(first)
    with_image = turn({"type": "text", "text": "Look at this picture, please. "}, image("rgb_png"),
                      " What colours does it hold?")
    rows.append(ask(gw, with_image))
    again = ask(gw, with_image)
    rows.append(again)
    other = ask(gw, turn({"type": "text", "text": "Look at this picture, please. "}, image("palette_png"),
                         " What colours does it hold?"))
    rows.append(other)
    follow = [*with_image, {"role": "assistant", "content": "Green and blue."},
              {"role": "user", "content": [{"type": "text", "text": "And this one? "}, image("rgb_jpeg")]}]
    rows.append(ask(gw, follow))
    rows.append(ask(gw, follow))
    print("\nmedia rows:", rows)
    assert all(r["claim"] == r["cached"] for r in rows), rows
    # The system prompt and the text before each image are served from cache and claimed ...
    assert rows[1]["cached"] >= 3 * BLOCK and rows[1]["worker"] == first["worker"]
    # ... the repeat of the image chat is whole (all but the block holding the last prompt token) ...
    assert again["cached"] == (again["prompt"] - 1) // BLOCK * BLOCK and again["worker"] == rows[1]["worker"]
    # ... another image after the same text shares only the blocks before it.
    assert rows[1]["cached"] <= other["cached"] < again["cached"]
    assert rows[5]["cached"] == (rows[5]["prompt"] - 1) // BLOCK * BLOCK


def test_the_ledger_holds_media_blocks_without_dropping_or_failing_parity(gw: Gateway) -> None:
    ask(gw, turn(image("tiny_png"), {"type": "text", "text": " An image first in the user's turn."}))
    settle(gw)
    for t in gw.targets().values():
        assert t["exact_kv"], t["reason"]
        assert t["parity"]["status"] in ("ok", "unknown"), t["parity"]
        assert not t["dropped_events"], t["dropped_events"]
