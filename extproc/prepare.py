"""Prepare: everything about a request's prompt that does not depend on which pool serves it.

resolve the model (registry: alias, LoRA) -> render the chat template -> tokenize piecewise -> block keys ->
the ledger's matches per target, computed once per request whatever pools then compete for it. Real traffic
stops tokenizing, hashing and looking up at the first block no worker holds or is predicted to hold
(extproc/prompt_walk.py): every target's match is the same as with the whole prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cortex import observation
from cortex.blockkeys import chain_keys, chain_keys_with, root_key
from cortex.chain_cache import ChainRun
from cortex.conversation import ConversationError
from cortex.conversation.content_parts import template_messages
from cortex.conversation.template_args import ToolStyle, for_template
from cortex.errors import ClientError
from cortex.model_bundle import ModelBundle, TemplateError
from cortex.piecewise.piece_cache import SegmentMismatch
from cortex.piecewise.segment_encoder import EncoderSet
from cortex.piecewise.token_cursor import TokenCursor
from extproc import engine_hits, inference_paths, media_prompt, pd, response_ids
from extproc.cluster_view import TargetInfo
from extproc.policies import session
from extproc.predictions import Predictions
from extproc.prompt_walk import DeferredTail, Tail, WalkResult, walk
from extproc.request import ParsedRequest
from extproc.snapshot import Snapshot


@dataclass(slots=True)
class Timings:
    tokenize_s: float = 0.0
    hash_s: float = 0.0
    lookup_s: float = 0.0
    score_s: float = 0.0


@dataclass(slots=True)
class Prepared:
    """The prompt as routing sees it, computed once per request whatever pools then compete for it."""

    model: str
    alias: str | None
    workers: list[TargetInfo]
    ids: list[int]
    truncated: bool
    """The prompt was longer than extproc.max_tokenize_chars; prompt_tokens counts only the routed prefix."""
    keys: list[int]
    matches: np.ndarray | None
    """Per slot, the leading blocks its engine will reuse from its GPU (the view's match through the engine's hit
    rule: extproc/engine_hits.py)."""
    why: str
    timings: Timings
    body: dict[str, Any] | None = None
    prompt_tokens: int = 0
    walked: bool = False
    """Tokenized only as far as routing needed (extproc/prompt_walk.py): `ids` is empty, `prompt_tokens` may be an
    estimate, and `tail` holds the rest, to become the chosen targets' predictions after the answer."""
    estimated: bool = False
    tail: Tail | None = None
    pools: pd.Pools | None = None
    """The model's workers by PD role (None in transparent mode, where roles are not Cortex's to use)."""
    lora: str | None = None
    transparent: bool = False
    """Another scheduler places this model: no cache, no PD (extproc/policies/transparent.py)."""
    head_ids: list[int] = field(default_factory=list)
    """The prompt's first ids (observation.FIRST_IDS_LOGGED), for the request log."""
    prompt_hash: str = ""
    """observation.prompt_hash of the whole prompt, for the request log."""
    key_array: np.ndarray | None = None
    """`keys` as uint64 when the walk had them so (a cached chain): spares the touch board a conversion."""
    session: int | None = None
    """The request's session key hashed (policies/session.py), None without one."""
    api: str = "chat"
    """The inference API it came in on (only chat completions and completions are paired for PD)."""
    response_holder: str | None = None
    """The tag of the worker holding the response it continues (extproc/response_ids.py)."""
    mint_response_id: bool = False
    """A Responses request without its own request_id: Cortex names the response after the chosen worker."""
    lower: dict[int, engine_hits.LowerHit] = field(default_factory=dict)
    """Per slot, the blocks a lower tier holds right after its GPU hit (extproc/engine_hits.py)."""
    withheld: dict[int, int] = field(default_factory=dict)
    """Per hybrid slot: blocks its full-attention run held that its sliding windows did not (never claimed)."""


def prompt_text(req: ParsedRequest, bundle: ModelBundle, style: ToolStyle = "vllm",
                media: bool = False) -> tuple[str, bool]:
    """The prompt as text, and whether the tokenizer adds its special tokens (completions) or not (chat). `style`:
    how the model's engine hands tools to the template (EngineAdapter.tool_style). `media`: render the media
    parts as the engine does for the model's processor (extproc/media_prompt.py)."""
    try:
        if req.kind == "chat":
            assert req.messages is not None
            template = bundle.chat_template or ""
            inline = req.inline_system if bundle.rejects_inline_system else None
            messages = req.messages if inline is None else inline
            source = req.chat_source if inline is None else req.inline_source
            # A template that takes content as parts gets them, as vLLM gives them (cortex/template_format.py).
            if source is not None and (bundle.content_format == "openai" or (media and bundle.media_rule)):
                placeholders = bundle.media_rule.placeholders if media and bundle.media_rule else None
                messages = template_messages(source, bundle.content_format, placeholders)
            messages, tools = for_template(messages, req.tools, req.tool_choice, template, style)
            text = bundle.render_chat(messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
                                      continue_final_message=req.continue_final_message,
                                      chat_template_kwargs=req.chat_template_kwargs)
            special = False
        else:
            assert req.prompt_text is not None
            text, special = req.prompt_text, True
    except TemplateError as exc:
        raise ClientError(400, str(exc), "messages") from None
    except ConversationError as exc:
        raise ClientError(400, str(exc), exc.param) from None
    return text, special


def tokens(snap: Snapshot, req: ParsedRequest, bundle: ModelBundle, segments: EncoderSet,
           style: ToolStyle = "vllm") -> tuple[list[int], bool]:
    """The prompt's token ids, and whether they were cut short for routing.

    Routing needs the prefix a cache can hold, not a prompt longer than any context window: text past
    `max_tokenize_chars` is not tokenized. The tokens at the cut may differ from the engine's, so one
    block more is dropped; a wrong token there could only turn a hit into a miss, never the reverse.
    Pieces between special tokens seen before (system prompt, earlier turns) come from a cache.
    """
    ids, truncated, _ = _tokens(snap, req, bundle, segments, style)
    return ids, truncated


def _tokens(snap: Snapshot, req: ParsedRequest, bundle: ModelBundle, segments: EncoderSet,
            style: ToolStyle) -> tuple[list[int], bool, str]:
    """tokens(), and the prompt's observation.prompt_hash."""
    if req.prompt_ids is not None:
        return req.prompt_ids, False, observation.prompt_hash(None, req.prompt_ids)
    seg = segments.get(bundle)
    text, special = prompt_text(req, bundle, style)
    fingerprint = observation.prompt_hash(text, None)
    cap = snap.cfg.extproc.max_tokenize_chars
    if len(text) <= cap:
        return seg.encode(text, add_special_tokens=special), False, fingerprint
    ids = seg.encode(text[:cap], add_special_tokens=special)
    return ids[: max(0, len(ids) - 2 * snap.block_size)], True, fingerprint


def _walk(snap: Snapshot, req: ParsedRequest, bundle: ModelBundle, workers: list[TargetInfo], root: int,
          timings: Timings, segments: EncoderSet, predictions: Predictions, deferred: DeferredTail,
          style: ToolStyle) -> tuple[WalkResult, bool, str, engine_hits.Detail | None]:
    """Tokenize, hash and look up only as far as some worker can hold the prompt (extproc/prompt_walk.py)."""
    t0 = time.perf_counter()
    bs = snap.block_size
    truncated = False
    chain: ChainRun | None = None
    full_text = ""
    if req.prompt_ids is not None:
        ids = req.prompt_ids
        cursor = TokenCursor.of_ids(ids)
        fingerprint = observation.prompt_hash(None, ids)

        def whole() -> list[int]:
            return ids
    else:
        text, special = prompt_text(req, bundle, style)
        full_text = text
        cap = snap.cfg.extproc.max_tokenize_chars
        if len(text) > cap:
            text, truncated = text[:cap], True
        seg = segments.get(bundle)
        cursor = seg.cursor(text, add_special_tokens=special)
        if len(cursor.parts) > 1:
            # Everything besides the text that changes ids or keys is the namespace (cortex/chain_cache.py).
            chain = seg.chains.run(cursor.parts, (root, bs, 1 + 2 * bs * truncated, int(special)), seg.serial)

        def whole() -> list[int]:
            return bundle.tokenizer.encode(text, add_special_tokens=special).ids
    timings.tokenize_s += time.perf_counter() - t0
    watched = [w.slot for w in workers]
    trusted = [w.slot for w in workers if w.exact_kv]
    detail: engine_hits.Detail | None = None
    slots = engine_hits.detail_slots(workers)

    def go(cursor: TokenCursor, chain: ChainRun | None) -> WalkResult:
        nonlocal detail
        detail = engine_hits.Detail(snap.match_detail, slots) if slots is not None else None
        # Past a cut the last tokens may differ from the engine's: two more blocks are left out, as in tokens().
        return walk(cursor, block_size=bs, root=root, holdback=1 + 2 * bs * truncated,
                    lookup=snap.match if detail is None else detail.lookup,
                    predictions=predictions, watched=watched, trusted=trusted, timings=timings,
                    catch_up=deferred.catch_up, whole=whole, chain=chain)
    try:
        result = go(cursor, chain)
        if req.prompt_ids is None:
            t1 = time.perf_counter()
            # From the restored boundary on: the earlier turns' text was hashed when they were (chain_cache.py).
            fingerprint = chain.fingerprint(full_text) if chain else observation.prompt_hash(full_text, None)
            timings.tokenize_s += time.perf_counter() - t1
    except SegmentMismatch:
        # Where encode() falls back to whole-text ids for this prompt, the walk starts over with them.
        t1 = time.perf_counter()
        cursor = TokenCursor.of_ids(whole())
        if req.prompt_ids is None:
            fingerprint = observation.prompt_hash(full_text, None)
        timings.tokenize_s += time.perf_counter() - t1
        result = go(cursor, None)
    if truncated:
        result.prompt_tokens = max(0, result.prompt_tokens - 2 * bs)
    return result, truncated, fingerprint, detail


class NoWorker(ClientError):
    """No healthy worker serves the model at all (scale from zero): a 503, unless the waiting room holds it."""

    def __init__(self, model: str, message: str) -> None:
        super().__init__(503, message, "model", reason="no_worker")
        self.model = model


def prepare(snap: Snapshot, req: ParsedRequest, *, full_tokens: bool, segments: EncoderSet,
            predictions: Predictions, deferred: DeferredTail) -> Prepared:
    """Model, tokens, keys, and how many leading blocks each routing target holds.

    Unless `full_tokens`, tokenizing, hashing and lookup stop at the first block no worker holds or is
    predicted to hold: every target's match is the same as with the whole prompt. A model with a PD pool
    ready gets the whole prompt, since its skip rule needs the exact prompt length.
    """
    registry = snap.gen.registry
    resolved = registry.resolve(req.model, lambda m: bool(snap.candidates(m)), lora_path=req.lora_path,
                                session=req.session_key)
    sess = session.key_hash(req.session_key) if req.session_key is not None else None
    # The chain starts where the engine's does: an adapter's blocks and a salted prompt's blocks are their own
    # namespaces, keyed by the ledger from the adapter name and salt the engine publishes with them.
    root = root_key(resolved.lora, req.cache_salt)
    inference_paths.check_served(inference_paths.PATH_OF[req.api], resolved.model, registry)
    bundle = registry.bundles[resolved.model]
    engine = registry.engines[resolved.model]
    style = engine.tool_style
    # A request the engine will not (fully) read from its cache, e.g. one asking for the prompt's logprobs: routed
    # by load when it reads none, its match cut to what it reads otherwise, so nothing above it is ever claimed.
    read_limit = engine.cache_read_limit(req.api, req.body or {})
    unroutable = req.unroutable or ("engine_skips_cache" if read_limit == 0 else None)
    # Media the engine keys like Cortex can (extproc/media_prompt.py): keyed up to the first item it cannot.
    model_cfg = registry.configs[resolved.model]
    with_media = media_prompt.keyable(req, bundle, engine, model_cfg, snap.block_size)
    if with_media and read_limit != 0:
        unroutable = None
    workers = snap.candidates(resolved.model)
    if not workers:
        raise NoWorker(resolved.model, f"no healthy worker serves model `{req.model}`")
    timings = Timings()
    transparent = snap.transparent(resolved.model)
    # A Responses request is named after its worker unless the client named it (extproc/response_ids.py).
    extra: dict[str, Any] = {"api": req.api, "response_holder": response_ids.tag_of(req.previous_response),
                             "mint_response_id": req.api == "responses" and not (req.body or {}).get("request_id")}
    pools = None if transparent else pd.split_pools(workers)
    # A lower tier's run starts where the GPU hit ends, past what the walk follows: such models are looked up whole.
    if not (full_tokens or pools is None or unroutable or not snap.alive or pools.pd_ready or with_media
            or engine_hits.tiered(workers)):
        walked, truncated, fingerprint, detail = _walk(snap, req, bundle, workers, root, timings, segments,
                                                       predictions, deferred, style)
        why = "no_cached_prefix"
        if not walked.keys:
            why = "prompt_shorter_than_a_block"
        elif walked.matches is None:
            why = "ledger_unavailable"
        found = _hits(snap, workers, _capped(walked.matches, read_limit, snap.block_size), detail,
                      len(walked.keys))
        why = _why(why, workers, found)
        return Prepared(model=resolved.model, alias=resolved.alias, workers=workers, ids=[], truncated=truncated,
                        keys=walked.keys, key_array=walked.array,
                        matches=found.matches if found else None, why=why, timings=timings,
                        body=req.body, prompt_tokens=walked.prompt_tokens, walked=True, estimated=walked.estimated,
                        tail=walked.tail, pools=pools, lora=resolved.lora,
                        head_ids=walked.head, prompt_hash=fingerprint, session=sess,
                        lower=found.lower if found else {}, withheld=found.withheld if found else {}, **extra)
    t0 = time.perf_counter()
    bs = snap.block_size
    shown: media_prompt.MediaPrompt | None = None
    if with_media and not unroutable and not transparent:
        text, _ = prompt_text(req, bundle, style, media=True)
        fingerprint = observation.prompt_hash(text, None)
        # Past the cap the markers left out make the items uncountable: keying stops at the first one, or earlier.
        truncated = len(text) > snap.cfg.extproc.max_tokenize_chars
        rendered = bundle.encode(text[:snap.cfg.extproc.max_tokenize_chars], add_special_tokens=False)
        shown = media_prompt.build(req, bundle, engine, model_cfg, rendered, bs)
        if truncated:
            shown.keyed = min(shown.keyed, max(0, len(shown.ids) - 2 * bs))
        ids = shown.ids
    else:
        ids, truncated, fingerprint = _tokens(snap, req, bundle, segments, style)
    t1 = time.perf_counter()
    timings.tokenize_s = t1 - t0
    # An engine always computes at least the last prompt token, so a hit never covers it.
    usable_blocks = max(0, (len(ids) - 1) // bs)
    if shown is not None:
        usable_blocks = min(usable_blocks, shown.keyed // bs)
    why = "no_cached_prefix"
    matches = None
    keys: list[int] = []
    hits: engine_hits.Hits | None = None
    if transparent:
        why = "transparent_proxy"
    elif unroutable:
        why = unroutable
    elif not snap.alive:
        why = "ledger_unavailable"
    elif usable_blocks == 0:
        why = "non_text_content" if shown is not None and shown.keyed < len(ids) else "prompt_shorter_than_a_block"
    else:
        keys = chain_keys_with(ids, bs, root, shown.suffixes, max_blocks=usable_blocks) if shown else \
            chain_keys(ids, bs, root, max_blocks=usable_blocks)
        t2 = time.perf_counter()
        timings.hash_s = t2 - t1
        slots = engine_hits.detail_slots(workers)
        detail = engine_hits.Detail(snap.match_detail, slots) if slots is not None else None
        matches = snap.match(keys) if detail is None else detail.lookup(keys)
        timings.lookup_s = time.perf_counter() - t2
        if matches is None:
            why = "ledger_unavailable"
        hits = _hits(snap, workers, _capped(matches, read_limit, bs), detail, len(keys))
        why = _why(why, workers, hits)
    return Prepared(model=resolved.model, alias=resolved.alias, workers=workers, ids=ids, truncated=truncated,
                    keys=keys, matches=hits.matches if hits else matches, why=why, timings=timings, body=req.body,
                    prompt_tokens=len(ids), pools=pools, lora=resolved.lora, transparent=transparent,
                    head_ids=ids[:observation.FIRST_IDS_LOGGED], prompt_hash=fingerprint, session=sess,
                    lower=hits.lower if hits else {}, withheld=hits.withheld if hits else {}, **extra)


def _capped(matches: np.ndarray | None, read_limit: int | None, block_size: int) -> np.ndarray | None:
    """The matches cut to the blocks an engine reading at most `read_limit` prompt tokens from cache uses."""
    if matches is None or read_limit is None:
        return matches
    capped: np.ndarray = np.minimum(matches, read_limit // block_size)
    return capped


def _why(why: str, workers: list[TargetInfo], hits: engine_hits.Hits | None) -> str:
    """`window_not_cached` when no trusted target has a hit but a hybrid one's full-attention group held the prefix:
    its sliding window lacks the blocks back from there, so the engine computes the prompt again."""
    if why != "no_cached_prefix" or hits is None or not hits.withheld:
        return why
    trusted = [w for w in workers if w.exact_kv]
    if any(hits.matches[w.slot] > 0 for w in trusted) or not any(w.slot in hits.withheld for w in trusted):
        return why
    return "window_not_cached"


def _hits(snap: Snapshot, workers: list[TargetInfo], matches: np.ndarray | None, detail: engine_hits.Detail | None,
          limit: int) -> engine_hits.Hits | None:
    """The view's matches through each target's engine hit rule (None when the view did not answer)."""
    if matches is None:
        return None
    return engine_hits.resolve(matches, workers, detail, limit, snap.cfg.scheduler.tier_weights)
