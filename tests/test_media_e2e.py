"""Chats with images end to end: two simulated vLLM workers serving a Qwen2-VL model directory, the real Envoy,
ingest and extproc.

The simulated vLLM takes images as base64 data URLs the way vLLM 0.32 does (cortexsim/openai_api.py: rendered
with the model's template, each image's placeholders expanded, every block it touches hashed with `("mm",
identifier, offset)` and published untagged in `extra_keys`). These tests check the path around the rule: events
with media keys into the ledger, prompts with media keyed in extproc, routed to the holder and claimed equal to the
worker's `cached_tokens`. The rule itself is proven against vLLM's classes (tests/test_media.py) and a real engine
(tests/real_engine/test_vllm_media.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import Gateway, cluster, wait_for
from tests.test_media import IMAGES, write_qwen2_vl_dir

pytestmark = pytest.mark.timeout(240)

SYSTEM = " ".join(f"Rule {i}: describe each picture plainly." for i in range(10))


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("media-e2e")
    model_dir = write_qwen2_vl_dir(root / "qwen2-vl")
    with cluster(root, sim_args=("--tokenizer", str(model_dir)), model_extra={"tokenizer": str(model_dir)},
                 extra_config={"extproc": {"prediction_ttl_s": 0}}) as g:
        yield g


def image(name: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": IMAGES[name]["url"]}}


def turn(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": list(parts)}]


def post(gw: Gateway, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": gw.models()[0]["name"], "messages": messages,
                                                          "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return {"claim": int(r.headers["x-cortex-cache-hit-tokens"]), "worker": r.headers["x-cortex-assigned-worker"],
            "reason": r.headers["x-cortex-route-reason"], "prompt": usage["prompt_tokens"],
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


def explain(gw: Gateway, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = httpx.post(gw.explain_url, timeout=30, headers=gw.admin_headers,
                   json={"model": gw.models()[0]["name"], "messages": messages})
    assert r.status_code == 200, r.text
    return dict(r.json())


def held(gw: Gateway, messages: list[dict[str, Any]], tokens: int) -> None:
    """Wait until the ledger holds `tokens` of the prompt on some worker (its events were applied)."""
    wait_for(lambda: explain(gw, messages)["cache_hit_tokens"] >= tokens, timeout=20,
             what=f"{tokens} tokens of the prompt in the ledger")


def test_an_image_chat_is_routed_to_its_holder_and_claimed_exactly(gw: Gateway) -> None:
    before = {"type": "text", "text": "Look at this picture, please. "}
    first = post(gw, turn(before))
    with_image = turn(before, image("rgb_png"), " What colours does it hold?")
    held(gw, with_image, 16)
    second = post(gw, with_image)
    # The text before the image was stored by the text-only chat: the same blocks, claimed as the worker serves them.
    assert second["worker"] == first["worker"] and second["claim"] == second["cached"] > 0
    whole = (second["prompt"] - 1) // 16 * 16
    held(gw, with_image, whole)
    again = post(gw, with_image)
    assert again["worker"] == second["worker"] and again["claim"] == again["cached"] == whole
    other = turn(before, image("palette_png"), " What colours does it hold?")
    third = post(gw, other)
    # Another image after the same text: only the blocks before the image are shared.
    assert third["claim"] == third["cached"] and second["cached"] <= third["cached"] < whole


def test_an_image_cortex_cannot_compute_is_claimed_up_to_its_placeholders(gw: Gateway) -> None:
    before = {"type": "text", "text": "Here is another picture for you. "}
    stored = turn(before, image("rgb_jpeg"), " Describe it.")
    post(gw, stored)
    held(gw, stored, 32)
    doc = explain(gw, turn(before, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                           " Describe it."))
    full = explain(gw, stored)
    assert 0 < doc["cache_hit_tokens"] < full["cache_hit_tokens"]
    assert doc["mode"] == "exact_kv_events"


def test_the_simulator_refuses_what_it_cannot_serve(gw: Gateway, tmp_path: Path) -> None:
    worker = gw.sims[0]
    r = httpx.post(f"{worker.url}/v1/chat/completions", timeout=30, json={
        "model": gw.models()[0]["name"], "max_tokens": 2,
        "messages": turn({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})})
    assert r.status_code == 400 and "data URL" in json.dumps(r.json())
