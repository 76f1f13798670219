"""Media parts as a vLLM engine keys them: each image's identifier and its number of placeholder tokens.

vLLM 0.32 turns each media item of a prompt into a run of placeholder tokens (the processor's rule: for Qwen2-VL,
one token per 28x28 pixels of the resized image) and folds `(identifier, offset)` into the block hash of every
KV block that run touches (vllm/v1/core/kv_cache_utils.py: `_gen_mm_extra_hash_keys`). The identifier is
vLLM's `MultiModalHasher.hash_kwargs(model_id=<the engine's --model>, image=<the item>)` (vllm/multimodal/
hasher.py, processing/inputs.py: `get_mm_hashes`), and for an image fetched from a data URL the item is the URL's
decoded bytes (`MediaWithBytes.original_bytes`), with the decoder's settings when they changed the image
(`io_config`: an image whose mode is not RGB is converted). So Cortex can compute both exactly for a data URL, with
no pixel decoded: the identifier from the bytes, the token count from the header's size.

What Cortex does not compute (and then keys nothing from that item on): http(s) and file URLs (Cortex never
fetches), video, audio, embeddings, a request's `mm_processor_kwargs` / `media_io_kwargs`, a processor it has no
rule for. Proven against vLLM 0.32's own classes (tests/fixtures/media_vectors.json, tests/vectors/media_gen.py)
and a real engine (tests/real_engine/test_vllm_media.py). Pure functions; nothing here does I/O but reading a model
directory's JSON at load time.
"""

from __future__ import annotations

import binascii
import hashlib
import io
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import blake3
import numpy as np
import pybase64
from PIL import Image

HasherAlgorithm = Literal["blake3", "sha256", "sha512"]
"""vLLM's `--mm-hasher-algorithm` (MultiModalConfig.mm_hasher_algorithm; blake3 by default)."""

ALLOWED_IMAGE_FORMATS: tuple[str, ...] = (
    "AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF", "ICNS", "ICO", "IM", "IMT",
    "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX", "PIXAR", "PNG", "PPM", "PSD", "QOI", "SGI", "SPIDER",
    "SUN", "TGA", "TIFF", "WEBP", "XBM", "XPM", "XVTHUMB")
"""vllm/multimodal/image.py: the formats vLLM opens (others it refuses, so Cortex keys nothing for them)."""
RGBA_BACKGROUND = (255, 255, 255)
"""ImageMediaIO's default background for an image converted to RGB (part of the identifier when it converts)."""
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})
"""EXIF orientations whose transpose (vLLM's normalize_image) swaps width and height."""
_EXIF_ORIENTATION = 0x0112


if TYPE_CHECKING:
    from cortex.conversation.content_parts import MediaRef


class MediaSpan(NamedTuple):
    """One media item of a prompt: where its placeholder tokens start, how many there are, and its identifier."""

    offset: int
    length: int
    identifier: str


class MediaRuleError(ValueError):
    """A model directory's processor files cannot be read as a known rule (a config-time error)."""


# -- vLLM's MultiModalHasher (vllm/multimodal/hasher.py) -------------------------------------------------------

_TAG_NONE, _TAG_SEQUENCE, _TAG_MAPPING, _TAG_LEAF = b"\x00", b"\x01", b"\x02", b"\x03"


def _framed(chunk: bytes) -> Iterable[bytes]:
    yield len(chunk).to_bytes(8, "little")
    yield chunk


def _leaf(obj: Any) -> Iterable[bytes]:
    """serialize_item for the values a data-URL image's identifier holds (bytes, str, int)."""
    if isinstance(obj, bytes):
        return _framed(obj)
    if isinstance(obj, str):
        return _framed(obj.encode())
    if isinstance(obj, int | float):
        return _framed(np.array(obj).tobytes())
    raise TypeError(f"no vLLM serialization for {type(obj).__name__}")


def _value(obj: Any) -> Iterable[bytes]:
    """iter_value_to_bytes: containers tagged with their kind and length, leaves framed."""
    if obj is None:
        yield _TAG_NONE
    elif isinstance(obj, list | tuple):
        yield _TAG_SEQUENCE
        yield len(obj).to_bytes(8, "little")
        for elem in obj:
            yield from _value(elem)
    elif isinstance(obj, dict):
        yield _TAG_MAPPING
        yield len(obj).to_bytes(8, "little")
        for k, v in obj.items():
            yield from _framed(str(k).encode())
            yield from _value(v)
    else:
        yield _TAG_LEAF
        yield from _leaf(obj)


def _item(key: str, obj: Any) -> Iterable[bytes]:
    """iter_item_to_bytes."""
    yield from _framed(key.encode())
    yield from _value(obj)


class _Image:
    """MediaWithBytes of an image, as serialize_item writes it: its original bytes (and the decoder's settings when
    they changed the image), tagged "image"."""

    def __init__(self, data: bytes, io_config: dict[str, Any] | None) -> None:
        self.chunks = list(_item("image", {"io_config": io_config, "data": data} if io_config else data))


def _hasher(algorithm: HasherAlgorithm) -> Callable[[], Any]:
    if algorithm == "blake3":
        return blake3.blake3
    return hashlib.sha256 if algorithm == "sha256" else hashlib.sha512


def hash_kwargs(algorithm: HasherAlgorithm, **kwargs: Any) -> str:
    """MultiModalHasher.hash_kwargs for string and image values: the keys sorted, each item framed."""
    h = _hasher(algorithm)()
    for key, value in sorted(kwargs.items()):
        if isinstance(value, _Image):
            h.update(b"".join(_framed(key.encode())))
            h.update(_TAG_LEAF)
            for chunk in value.chunks:
                h.update(chunk)
        else:
            for chunk in _item(key, value):
                h.update(chunk)
    return str(h.hexdigest())


# -- images from data URLs (vllm/multimodal/media/connector.py, media/image.py) --------------------------------

def data_url_bytes(url: str) -> bytes | None:
    """The decoded bytes of a base64 data URL (`_load_data_url`: the part after the comma, strict base64), None
    for any other URL or a malformed one (the engine refuses those or fetches them; Cortex keys nothing)."""
    if url[:5].lower() != "data:":
        return None
    spec, sep, data = url[5:].partition(",")
    if not sep or spec.rpartition(";")[1:] != (";", "base64"):
        return None
    try:
        return pybase64.b64decode(data, validate=True)  # vLLM's own call (ImageMediaIO.load_base64); SIMD-fast
    except (binascii.Error, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class ImageFacts:
    """What the engine derives from an image's bytes without processing its pixels."""

    width: int
    height: int
    """After EXIF orientation (vLLM's normalize_image transposes before the processor sees the size)."""
    mode: str
    """The mode PIL opens it in; anything but RGB is converted, and the conversion joins the identifier."""


def image_facts(data: bytes) -> ImageFacts | None:
    """Size and mode from the image's header, as vLLM's ImageMediaIO opens it (its format allowlist); None when
    it cannot be opened (the engine refuses it: nothing to key)."""
    try:
        with Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS) as im:
            width, height = im.size
            mode = im.mode
            try:
                # Pillow's PNG getexif decodes the pixels to find metadata after the image data; with none there
                # (nearly every PNG) the header's is all there is, read without decoding.
                header_only = im.format == "PNG" and not _png_chunks_after_data(data)
                exif = Image.Image.getexif(im) if header_only else im.getexif()
                orientation = exif.get(_EXIF_ORIENTATION)
            except Exception:  # vLLM ignores malformed EXIF (contextlib.suppress): no transpose
                orientation = None
    except Exception:  # Pillow raises many kinds for bad input (and DecompressionBombError for huge images)
        return None
    if orientation in _SWAPPING_ORIENTATIONS:
        width, height = height, width
    return ImageFacts(width, height, mode)


def _png_chunks_after_data(data: bytes) -> bool:
    """Whether a PNG holds chunks other than image data after its first IDAT (metadata Pillow reads on load)."""
    at, seen_data = 8, False
    while at + 8 <= len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        kind = data[at + 4:at + 8]
        if kind == b"IDAT":
            seen_data = True
        elif seen_data and kind != b"IEND":
            return True
        at += 12 + length
    return False


def image_identifier(data: bytes, facts: ImageFacts, model_id: str, algorithm: HasherAlgorithm = "blake3") -> str:
    """vLLM's identifier of an image loaded from `data` (no LoRA tower, no processor or media-io kwargs)."""
    io_config = None
    if facts.mode != "RGB":
        io_config = {"image_mode": "RGB", "rgba_background_color": RGBA_BACKGROUND}
    return hash_kwargs(algorithm, model_id=model_id, image=_Image(data, io_config))


# -- processors: how many placeholder tokens an item becomes -------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int] | None:
    """transformers' Qwen2-VL smart_resize (the PIL and torchvision processors share it); None where it raises
    (an aspect ratio over 200: the engine refuses the image)."""
    if min(height, width) <= 0 or max(height, width) / min(height, width) > 200:
        return None
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class ProcessorRule:
    """A model family's placeholder rule, read from its directory (config.json, preprocessor_config.json)."""

    family: str
    """The HF model_type it was read for (qwen2_vl, qwen2_5_vl)."""
    image_token_id: int
    """The token the chat template writes once per image and the processor repeats (Qwen2-VL: <|image_pad|>)."""
    marker_token_ids: frozenset[int]
    """Every token that stands for a media item in the rendered prompt (image and video pads)."""
    placeholders: dict[str, str]
    """Per modality, the text vLLM puts for an item when the template takes string content (get_placeholder_str)."""
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    def image_tokens(self, facts: ImageFacts) -> int | None:
        """Qwen2VLImageProcessor: the image resized to multiples of patch*merge within the pixel bounds, one token
        per merge x merge patches (an image is one temporal patch). None when the processor refuses it."""
        size = smart_resize(facts.height, facts.width, self.patch_size * self.merge_size, self.min_pixels,
                            self.max_pixels)
        if size is None:
            return None
        return (size[0] // self.patch_size) * (size[1] // self.patch_size) // (self.merge_size ** 2)


_QWEN_VL = frozenset({"qwen2_vl", "qwen2_5_vl"})


def _json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MediaRuleError(f"{path} cannot be read as JSON: {exc}") from exc
    if not isinstance(loaded, dict):
        raise MediaRuleError(f"{path} is not a JSON object")
    return loaded


def _int(config: Mapping[str, Any], key: str, default: int, where: Path) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise MediaRuleError(f"{where}: {key} must be a positive integer")
    return value


def load_rule(directory: Path, token_id: Callable[[str], int | None]) -> ProcessorRule | None:
    """The processor rule of the model in `directory`, None for a model Cortex has no media rule for (text-only
    models, other processors: their media requests are routed by load). Raises MediaRuleError for a known family
    whose files are unreadable or inconsistent with its tokenizer."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        return None
    config = _json(config_file)
    family = config.get("model_type")
    if family not in _QWEN_VL:
        return None
    pre_file = directory / "preprocessor_config.json"
    if not pre_file.is_file():
        raise MediaRuleError(f"{directory}: a {family} model needs its preprocessor_config.json")
    pre = _json(pre_file)
    if pre.get("do_resize", True) is not True:
        return None  # the size is then the image's own; no rule proven for it
    size: dict[str, Any] = pre["size"] if isinstance(pre.get("size"), dict) else {}
    # Qwen2VLImageProcessor.__init__: min_pixels / max_pixels override size.shortest_edge / longest_edge.
    min_pixels = pre.get("min_pixels", size.get("shortest_edge", 56 * 56))
    max_pixels = pre.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280))
    bounds = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    image = token_id("<|image_pad|>")
    video = token_id("<|video_pad|>")
    if image is None:
        raise MediaRuleError(f"{directory}: the tokenizer has no <|image_pad|> token for its {family} processor")
    image_id = _int(config, "image_token_id", image, config_file)
    if image_id != image:
        raise MediaRuleError(f"{config_file}: image_token_id {image_id} is not the tokenizer's <|image_pad|> ({image})")
    return ProcessorRule(
        family=family, image_token_id=image,
        marker_token_ids=frozenset(t for t in (image, video) if t is not None),
        placeholders={"image": "<|vision_start|><|image_pad|><|vision_end|>",
                      "video": "<|vision_start|><|video_pad|><|vision_end|>"},
        patch_size=_int(pre, "patch_size", 14, pre_file), merge_size=_int(pre, "merge_size", 2, pre_file),
        min_pixels=_int(bounds, "min_pixels", 0, pre_file), max_pixels=_int(bounds, "max_pixels", 0, pre_file))


# -- a rendered prompt with its items expanded -----------------------------------------------------------------

@dataclass(slots=True)
class Expanded:
    """A rendered prompt as the engine's processor makes it, as far as Cortex can compute it."""

    ids: list[int]
    """Token ids with every computed item's placeholder run; past `keyed` the rest as rendered."""
    spans: list[MediaSpan]
    keyed: int
    """Leading tokens known exactly (all of them when every item was computed)."""
    why_not: str = ""
    """Why `keyed` stops short ('' when it does not)."""


def item_facts(ref: MediaRef, rule: ProcessorRule, model_id: str, hasher: HasherAlgorithm,
               kwargs: bool) -> tuple[str, int] | str:
    """(identifier, placeholder tokens) of one item as the engine computes them, or why Cortex cannot."""
    if ref.modality != "image":
        return f"{ref.modality} items are not keyed"
    if kwargs:
        return "mm_processor_kwargs / media_io_kwargs change the engine's keys"
    data = data_url_bytes(ref.url) if ref.url else None
    if data is None:
        return "an image that is not a base64 data URL (Cortex never fetches one)"
    facts = image_facts(data)
    if facts is None:
        return "an image the engine cannot open"
    tokens = rule.image_tokens(facts)
    if tokens is None:
        return "an image the processor refuses"
    identifier = ref.uuid if ref.uuid is not None else image_identifier(data, facts, model_id, hasher)
    return identifier, tokens


def expand(rendered: list[int], refs: list[MediaRef], rule: ProcessorRule, model_id: str,
           hasher: HasherAlgorithm, kwargs: bool = False) -> Expanded:
    """The processor's prompt: each item's marker token (in the rendered prompt, in order, one per item) repeated
    into its placeholder run, item by item, up to the first item Cortex cannot compute. `kwargs`: the request
    carries processor or media-io kwargs (they join every identifier)."""
    video = next(iter(rule.marker_token_ids - {rule.image_token_id}), None)
    markers = [i for i, t in enumerate(rendered) if t in rule.marker_token_ids]
    images = [r for r in refs if r.modality == "image"]
    videos = [r for r in refs if r.modality == "video"]
    n_images = sum(1 for i in markers if rendered[i] == rule.image_token_id)
    if n_images != len(images) or len(markers) - n_images != len(videos) or len(refs) != len(markers):
        # Not one marker per item (the template dropped one, or the text holds a marker): the engine refuses the
        # prompt or places the items elsewhere; only the text before the first marker is certain.
        return Expanded(list(rendered), [], markers[0] if markers else 0,
                        "the rendered prompt does not hold one marker per item")
    queues = {rule.image_token_id: iter(images), video: iter(videos)}
    ids: list[int] = []
    spans: list[MediaSpan] = []
    prev = 0
    why_not = ""
    for pos in markers:
        token = rendered[pos]
        found = item_facts(next(queues[token]), rule, model_id, hasher, kwargs)
        ids += rendered[prev:pos]
        prev = pos
        if isinstance(found, str):
            why_not = found
            break
        identifier, n = found
        spans.append(MediaSpan(len(ids), n, identifier))
        ids += [token] * n
        prev = pos + 1
    keyed = len(ids) if why_not else len(ids) + len(rendered) - prev
    ids += rendered[prev:]
    return Expanded(ids, spans, keyed, why_not)
