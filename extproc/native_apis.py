"""SGLang's native /generate and the pooling APIs (/v1/embeddings, /v1/rerank, /v1/score) as Cortex's one parsed form.

/generate carries a text or token-id prompt (or a batch of them, routed by the first) and no `model` field: a
`model` in its body is read as the gateway's own extension (SGLang ignores unknown top-level fields), else the
model is the only one configured that serves /generate (extproc/inference_paths.py: default_model). Its answer
may hold `sampling_params.max_new_tokens` per prompt (SGLang's default is 128), times `n`.

The pooling APIs compute a prompt and generate nothing. Cortex routes them by load among the workers of their
model and never claims a hit (a pooling model's prefix cache is its engine's business, and a claim must be one
the engine will use); their prompt tokens are estimated for token limits from the texts and token ids they
carry (CHARS_PER_TOKEN), and settled by the engine's usage like any other request.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from cortex.errors import ClientError
from extproc.request import (
    CHARS_PER_TOKEN,
    MAX_TOKEN_ID,
    NonNegInt,
    ParsedRequest,
    _cache_salt,
    _expectations,
    _expects,
    _lora_path,
    load_object,
    model_of,
    prompt_of,
    validated,
)

GENERATE_DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's SamplingParams.max_new_tokens when a /generate request leaves it out (sglang/api/v1/api_types.py)."""
POOLING = "pooling_request"
"""The unroutable reason of a pooling request: routed by load, never claimed."""


class _SamplingParams(BaseModel):
    model_config = ConfigDict(extra="ignore")
    max_new_tokens: NonNegInt | None = _expects("an integer >= 0 or null")
    n: NonNegInt | None = _expects("an integer >= 0 or null")


class _Generate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    stream: bool | None = _expects("a boolean")
    sampling_params: _SamplingParams | list[_SamplingParams] | None = _expects(
        "an object (or one per prompt) with integer max_new_tokens and n")


_EXPECTED_GENERATE = _expectations(_Generate)
_MEDIA_FIELDS = ("image_data", "video_data", "audio_data", "input_embeds")


def _budget(params: _SamplingParams | None) -> int:
    if params is None:
        return GENERATE_DEFAULT_MAX_NEW_TOKENS
    limit = params.max_new_tokens if params.max_new_tokens is not None else GENERATE_DEFAULT_MAX_NEW_TOKENS
    return limit * (params.n if params.n is not None else 1)


def parse_generate(raw: bytes) -> ParsedRequest:
    """POST /generate: `text` or `input_ids` (exactly one, as SGLang requires), one or a batch."""
    body = load_object(raw)
    model = model_of(body, required=False)
    fields = validated(_Generate, body, _EXPECTED_GENERATE)
    req = ParsedRequest(kind="completion", model=model or "", stream=bool(fields.stream), api="generate", body=body,
                        lora_path=_lora_path(body.get("lora_path")))
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        if text is None and body.get("input_embeds") is not None:
            req.prompt_text, req.unroutable = "", "prompt_embeds"
        else:
            raise ClientError(400, "exactly one of 'text' and 'input_ids' is required", "text")
    elif ids is not None:
        prompt_of(req, ids, "input_ids")
    else:
        prompt_of(req, text, "text")
    items = text if text is not None else ids
    batch = len(items) if isinstance(items, list) and items and isinstance(items[0], str | list) else 1
    params = fields.sampling_params
    req.max_output = sum(_budget(p) for p in params) if isinstance(params, list) else _budget(params) * batch
    salt = body.get("cache_salt")
    if isinstance(salt, list):
        req.cache_salts = [_cache_salt(s) for s in salt]
        req.cache_salt = req.cache_salts[0] if req.cache_salts else None
    else:
        req.cache_salt = _cache_salt(salt)
    if any(body.get(k) is not None for k in _MEDIA_FIELDS[:3]):
        req.unroutable = "non_text_content"
    return req


def _estimate(value: Any, depth: int = 0) -> int:
    """Tokens of the texts and token ids in a pooling request's inputs (nested a few levels: batches, documents
    as objects with a `text`, chat messages' content)."""
    if isinstance(value, str):
        return -(-len(value) // CHARS_PER_TOKEN)
    if depth > 4:
        return 0
    if isinstance(value, list):
        if value and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value):
            return len(value)
        return sum(_estimate(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return sum(_estimate(value.get(k), depth + 1) for k in ("text", "content"))
    return 0


# Per pooling API: the fields holding its inputs, and the sets of them a request must carry one of.
_POOLING_INPUTS: dict[str, tuple[tuple[str, ...], ...]] = {
    "embeddings": (("input",), ("messages",)),
    "rerank": (("query", "documents"),),
    # vLLM's score forms, then SGLang's (query + items).
    "score": (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"),
              ("query", "items")),
}


def _pooling(api: str, raw: bytes) -> ParsedRequest:
    body = load_object(raw)
    model = model_of(body)
    assert model is not None
    forms = _POOLING_INPUTS[api]
    form = next((f for f in forms if all(body.get(k) is not None for k in f)), None)
    if form is None:
        wanted = " or ".join("+".join(f"'{k}'" for k in f) for f in forms)
        raise ClientError(400, f"{wanted} is required", forms[0][0])
    req = ParsedRequest(kind="completion", model=model, stream=False, api=api, body=body,  # type: ignore[arg-type]
                        cache_salt=_cache_salt(body.get("cache_salt")), prompt_text="", unroutable=POOLING,
                        max_output=0)
    req.more_prompt_tokens = sum(_estimate(body[k]) for k in form)
    return req


def parse_embeddings(raw: bytes) -> ParsedRequest:
    """POST /v1/embeddings: `input` (texts or token ids, one or a batch), or vLLM's chat `messages`."""
    return _pooling("embeddings", raw)


def parse_rerank(raw: bytes) -> ParsedRequest:
    """POST /v1/rerank: a `query` and its `documents`."""
    return _pooling("rerank", raw)


def parse_score(raw: bytes) -> ParsedRequest:
    """POST /v1/score: vLLM's pairs (text_1/text_2, data_1/data_2, queries with documents or items) or SGLang's
    (query with items)."""
    return _pooling("score", raw)
