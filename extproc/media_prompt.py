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

from cortex import media
from cortex.blockkeys import extras_suffix
from cortex.config import ModelConfig
from cortex.conversation.content_parts import media_refs
from cortex.engines import EngineAdapter
from cortex.media import MediaSpan
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


def build(req: ParsedRequest, bundle: ModelBundle, engine: EngineAdapter, model: ModelConfig,
          rendered_ids: list[int], block_size: int) -> MediaPrompt:
    """The engine's view of `rendered_ids` (the tokenized render of `req` with its media parts, prepare.prompt_text
    with media=True): placeholders expanded item by item, keyed up to the first item Cortex cannot compute."""
    rule = bundle.media_rule
    assert rule is not None and req.chat_source is not None
    source = req.inline_source if req.inline_system is not None and bundle.rejects_inline_system else req.chat_source
    body: dict[str, Any] = req.body or {}
    found = media.expand(rendered_ids, media_refs(source or []), rule, model.media.model_id or model.name,
                         model.media.hasher, kwargs=any(body.get(k) for k in KWARGS_FIELDS))
    extras = engine.media_page_extras(found.spans, found.keyed // block_size, block_size) or []
    suffixes = {i: extras_suffix(e) for i, e in enumerate(extras) if e}
    return MediaPrompt(found.ids, found.keyed, suffixes, found.spans, found.why_not)
