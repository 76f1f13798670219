"""What keying a chat's images costs extproc: per image given as a base64 data URL, decoding the URL, reading the
image's header (size, mode, EXIF orientation) and hashing its bytes as vLLM identifies it (cortex/media.py), by
image size; and a whole media prompt (render, tokenize, expand, per-block keys: extproc/media_prompt.py).

Run from the repository root: `python perf/bench_media.py`. Images are made here (noise PNGs and JPEGs, which do not
compress, so their bytes are what a client sends); runtime is a few seconds.
"""

from __future__ import annotations

import base64
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without installing the package

from cortex import engines, media
from cortex.blockkeys import chain_keys_with, root_key
from cortex.config import ModelConfig
from cortex.model_bundle import ModelBundle
from extproc import media_prompt
from extproc.prepare import prompt_text
from extproc.request import parse_body
from tests.test_media import write_qwen2_vl_dir

RNG = np.random.default_rng(25)


def data_url(side: int, fmt: str) -> str:
    pixels = RNG.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def per_image(url: str, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        data = media.data_url_bytes(url)
        assert data is not None
        facts = media.image_facts(data)
        assert facts is not None
        media.image_identifier(data, facts, "/models/qwen2-vl")
    return (time.perf_counter() - start) / repeat


def main() -> None:
    print("per image: data URL decode + header + vLLM identifier (blake3)")
    print(f"{'image':>16} {'URL bytes':>10} {'ms':>8}")
    for side, fmt in ((256, "JPEG"), (1024, "JPEG"), (2048, "JPEG"), (512, "PNG"), (1024, "PNG")):
        url = data_url(side, fmt)
        repeat = 20 if len(url) < 4_000_000 else 5
        print(f"{f'{side}x{side} {fmt}':>16} {len(url):>10,} {per_image(url, repeat) * 1e3:>8.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_qwen2_vl_dir(Path(tmp) / "vl")
        bundle = ModelBundle.load("vl", path)
        model = ModelConfig(name="vl", tokenizer=str(path), page_size=16)
        system = " ".join(f"Rule {i}: describe the picture plainly." for i in range(100))
        body = {"model": "vl", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "text", "text": "Compare these two: "},
                                         {"type": "image_url", "image_url": {"url": data_url(1024, "JPEG")}},
                                         {"type": "image_url", "image_url": {"url": data_url(1024, "JPEG")}},
                                         {"type": "text", "text": "Which is brighter?"}]}]}
        raw = json.dumps(body).encode()
        vllm = engines.adapter("vllm")
        repeat = 10
        start = time.perf_counter()
        for _ in range(repeat):
            req = parse_body("chat", raw)
            text, _ = prompt_text(req, bundle, media=True)
            shown = media_prompt.build(req, bundle, vllm, model, bundle.encode(text, add_special_tokens=False), 16)
            chain_keys_with(shown.ids, 16, root_key(), shown.suffixes, max_blocks=shown.keyed // 16)
        took = (time.perf_counter() - start) / repeat
        print(f"\nwhole prompt: {len(raw):,} body bytes, {len(shown.ids):,} tokens ({len(shown.spans)} images, "
              f"{sum(s.length for s in shown.spans)} placeholders): parse + render + tokenize + expand + keys "
              f"{took * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
