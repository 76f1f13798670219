"""A chat request with media parts as the engine keys its blocks: the prompt's token ids with each item's
placeholders, and each block's media keys, as far as Cortex can compute them.

vLLM renders the conversation with the model's chat template (media parts become the template's markers, e.g.
Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>`), tokenizes it, and its processor repeats each item's
marker token into the item's placeholder run; every block that run touches is hashed with `(identifier, offset)`
(cortex/media.py, the adapter's media_page_extras). Cortex does the same for the items it can compute exactly (an
image from a data URL, for a processor it has a rule for) and keys the blocks up to the first item it cannot:
its placeholder count or identifier is unknown, so no later block can be keyed. The blocks before the first media
item are plain text blocks: they meet the same text sent without media.

Pure given the model bundle: no I/O. The result feeds prepare's whole-prompt path (media requests are not walked
piece by piece: the expansion needs the whole rendered prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cortex import conversation, media
from cortex.blockkeys import extras_suffix
from cortex.config import ModelConfig
from cortex.engines import EngineAdapter
from cortex.engines.base import MediaSpan
from cortex.model_bundle import ModelBundle
from extproc.request import ParsedRequest

KWARGS_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")
"""Request fields vLLM folds into every item's identifier (and that may change its placeholder count)."""


@dataclass(slots=True)
class MediaPrompt:
    """The prompt as the engine will see it, as far as Cortex knows it."""

    ids: list[int]
    """Token ids with every known item's placeholders; past `keyed` the rest as rendered (markers not expanded)."""
    keyed: int
    """Leading tokens whose blocks Cortex keys exactly (every token, when every item was computed)."""
    suffixes: dict[int, bytes] = field(default_factory=dict)
    """Per block index before `keyed`, the bytes its media keys add (cortex/blockkeys.py: chain_keys_with)."""
    spans: list[MediaSpan] = field(default_factory=list)
    why_not: str = ""
    """Why keying stops at `keyed` ('' when it does not stop): for explain and the tests."""


def keyable(req: ParsedRequest, bundle: ModelBundle, engine: EngineAdapter, model: ModelConfig,
            block_size: int) -> bool:
    """Whether this request's media can be keyed at all, up to its first item Cortex cannot compute: a chat
    request on a model whose processor Cortex has a rule for, on an engine whose media keys it reproduces, with
    engine pages as large as Cortex blocks (media keys are per engine page). Otherwise it is routed by load."""
    return (req.unroutable == "non_text_content" and req.chat_source is not None and bundle.media_rule is not None
            and engine.media_page_extras([], 0, block_size) is not None and model.engine_page_size() == block_size)


def _item(ref: conversation.MediaRef, rule: media.ProcessorRule, model_id: str, hasher: media.HasherAlgorithm,
          kwargs: bool) -> tuple[str, int] | str:
    """(identifier, placeholder tokens) of one item, or why Cortex cannot compute them."""
    if ref.modality != "image":
        return f"{ref.modality} items are not keyed"
    if kwargs:
        return "mm_processor_kwargs / media_io_kwargs change the engine's keys"
    data = media.data_url_bytes(ref.url) if ref.url else None
    if data is None:
        return "an image that is not a base64 data URL (Cortex never fetches one)"
    facts = media.image_facts(data)
    if facts is None:
        return "an image the engine cannot open"
    tokens = rule.image_tokens(facts)
    if tokens is None:
        return "an image the processor refuses"
    identifier = ref.uuid if ref.uuid is not None else media.image_identifier(data, facts, model_id, hasher)
    return identifier, tokens


def build(req: ParsedRequest, bundle: ModelBundle, engine: EngineAdapter, model: ModelConfig,
          rendered_ids: list[int], block_size: int) -> MediaPrompt:
    """The engine's view of `rendered_ids` (the tokenized render of `req` with its media parts, prepare.prompt_text
    with media=True): placeholders expanded item by item, keyed up to the first item Cortex cannot compute."""
    rule = bundle.media_rule
    assert rule is not None and req.chat_source is not None
    model_id, hasher = model.media.model_id or model.name, model.media.hasher
    source = req.inline_source if req.inline_system is not None and bundle.rejects_inline_system else req.chat_source
    refs = conversation.media_refs(source or [])
    body: dict[str, Any] = req.body or {}
    kwargs = any(body.get(k) for k in KWARGS_FIELDS)
    video = next(iter(rule.marker_token_ids - {rule.image_token_id}), None)
    markers = [i for i, t in enumerate(rendered_ids) if t in rule.marker_token_ids]
    images = [r for r in refs if r.modality == "image"]
    videos = [r for r in refs if r.modality == "video"]
    n_image_markers = sum(1 for i in markers if rendered_ids[i] == rule.image_token_id)
    if n_image_markers != len(images) or len(markers) - n_image_markers != len(videos) or len(refs) != len(markers):
        # The render does not hold one marker per item (the template dropped an item, or the text holds a marker):
        # the engine refuses such a prompt or places the items elsewhere; only the text before them is certain.
        keyed = markers[0] if markers else 0
        return MediaPrompt(list(rendered_ids), keyed, why_not="the rendered prompt does not hold one marker per item")
    queues = {rule.image_token_id: iter(images), video: iter(videos)}
    ids: list[int] = []
    spans: list[MediaSpan] = []
    prev = 0
    why_not = ""
    for pos in markers:
        token = rendered_ids[pos]
        found = _item(next(queues[token]), rule, model_id, hasher, kwargs)
        ids += rendered_ids[prev:pos]
        prev = pos
        if isinstance(found, str):
            why_not = found
            break
        identifier, n = found
        spans.append(MediaSpan(len(ids), n, identifier))
        ids += [token] * n
        prev = pos + 1
    keyed = len(ids) if why_not else len(ids) + len(rendered_ids) - prev
    ids += rendered_ids[prev:]
    n_blocks = keyed // block_size
    extras = engine.media_page_extras(spans, n_blocks, block_size) or []
    suffixes = {i: extras_suffix(e) for i, e in enumerate(extras) if e}
    return MediaPrompt(ids, keyed, suffixes, spans, why_not)
