"""Every inference path Cortex serves, in one table: path -> parser -> the one `ParsedRequest` the pipeline runs on.

From the parsed request on, every path runs the same code (extproc/server.py): the tenant's rate and concurrency
limits at the request headers, then parse, the tenant's cache salt, schema checks, the waiting room, model and
alias resolution (a request only ever goes to a worker of its model, and only to one whose engine serves the
path), routing, the token reservation (settled by the observer with the engine's usage), observation and the
request log. What differs per path is only what its parser makes of the body:

| path | parser | prompt routed on | cached by the engine |
|---|---|---|---|
| /v1/chat/completions | request.parse_body | messages + tools, rendered | yes |
| /v1/completions | request.parse_body | text or token ids | yes |
| /v1/responses | agent_apis.parse_responses | instructions + input + tools, rendered | yes |
| /v1/messages | agent_apis.parse_messages | system + messages + tools, rendered | yes |
| /v1/messages/count_tokens | agent_apis.parse_count_tokens | none (checked, not rendered) | no claim, computes no KV |
| /generate | native_apis.parse_generate | text or input_ids | yes |
| /v1/embeddings, /v1/rerank, /v1/score | native_apis.parse_* | none (estimated for token limits) | no claim |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cortex import api_paths
from cortex.errors import ClientError
from extproc import agent_apis, native_apis
from extproc.registry import ModelRegistry
from extproc.request import Api, ParsedRequest, load_object, model_of, parse_body


@dataclass(frozen=True, slots=True)
class InferencePath:
    path: str
    api: Api
    parse: Callable[[bytes], ParsedRequest]
    stream_options: bool = False
    """A stream's usage is asked for with `stream_options` (Cortex asks on the client's behalf, observe.lua cuts
    it out again); the other APIs always end a stream with their usage."""


PATHS: dict[str, InferencePath] = {p.path: p for p in (
    InferencePath(api_paths.CHAT, "chat", lambda raw: parse_body("chat", raw), stream_options=True),
    InferencePath(api_paths.COMPLETIONS, "completion", lambda raw: parse_body("completion", raw), stream_options=True),
    InferencePath(api_paths.RESPONSES, "responses", agent_apis.parse_responses),
    InferencePath(api_paths.MESSAGES, "messages", agent_apis.parse_messages),
    InferencePath(api_paths.COUNT_TOKENS, "count_tokens", agent_apis.parse_count_tokens),
    InferencePath(api_paths.GENERATE, "generate", native_apis.parse_generate),
    InferencePath(api_paths.EMBEDDINGS, "embeddings", native_apis.parse_embeddings),
    InferencePath(api_paths.RERANK, "rerank", native_apis.parse_rerank),
    InferencePath(api_paths.SCORE, "score", native_apis.parse_score),
)}
PATH_OF: dict[Api, str] = {p.api: p.path for p in PATHS.values()}
assert set(PATHS) == set(api_paths.INFERENCE_PATHS)


def default_model(path: str, registry: ModelRegistry) -> str:
    """The model of a request that names none (SGLang's /generate has no `model` field): the only configured model
    whose engine serves the path; a 400 when several do (the client must send `model`), a 404 when none does."""
    serving = [m for m, engine in registry.engines.items() if path in engine.inference_paths]
    if len(serving) == 1:
        return serving[0]
    if not serving:
        raise ClientError(404, f"No configured model is served on {path}.", "model")
    raise ClientError(400, f"{path} names no model and {len(serving)} configured models serve it: send `model` "
                           "in the body to pick one.", "model")


def check_served(path: str, model: str, registry: ModelRegistry) -> None:
    """A 404 when the model's engine has no such path: the request would reach a worker that cannot serve it."""
    engine = registry.engines.get(model)
    if engine is not None and path not in engine.inference_paths and path not in engine.tokenizer_paths:
        raise ClientError(404, f"The model `{model}` is served by {engine.name}, which has no {path} endpoint.",
                          "model")


def parse(path: str, raw: bytes, registry: ModelRegistry) -> ParsedRequest:
    """The request on an inference path (a KeyError for any other path), its model named or defaulted."""
    req = PATHS[path].parse(raw)
    if not req.model:
        req.model = default_model(path, registry)
    return req


def tokenizer_model(raw: bytes, registry: ModelRegistry) -> str:
    """The model a tokenizer endpoint's body names (api_paths.TOKENIZER_PATHS): its `model`, else the only
    configured model (the engines tokenize with their default model then); a 400 when several are configured,
    since another model's tokenizer would answer with ids that mean nothing to the client's model."""
    model = model_of(load_object(raw), required=False)
    if model is not None:
        return model
    if len(registry.bundles) == 1:
        return next(iter(registry.bundles))
    raise ClientError(400, f"The body names no model and {len(registry.bundles)} models are configured: send "
                           "`model` in the body to pick one.", "model")
