"""The model registry: served models with their bundles, and public aliases over them (seed 004 §3.1).

An alias maps a name clients send (`chat-prod`) to weighted models (`qwen-7b-v3` 90, `qwen-7b-v2` 10)
with a fallback. By default the draw is per request, at random. An alias with `draw: session` draws per session
key instead (`session_draw`), so a conversation stays on one version and keeps its KV cache: weighted
rendezvous hashing of (alias, key, model), under which changing one target's weight moves only the sessions
that must move (raising a canary's weight only moves sessions onto the canary, lowering it only moves them off).
A request without a session key still draws at random. The worker receives the model it serves, so the request
body's `model` is rewritten when an alias was used.

A LoRA adapter resolves to the model that serves it, the way that model's engine reads the request (vLLM:
`model` is the adapter's name, from `models[].loras`; SGLang: `model: "<model>:<adapter>"` or `lora_path`), and
the body is forwarded unchanged: the worker needs the adapter's name, and Cortex needs it to match the adapter's
blocks (docs/ledger.md).

A registry is immutable; a config reload builds a new one off the request path (reusing bundles whose
files did not change: cortex/model_bundle.py, BundleCache) and swaps it in whole.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson
import xxhash

from cortex import engines
from cortex.config import CortexConfig
from cortex.errors import ClientError
from cortex.model_bundle import BundleCache, ModelBundle


@dataclass(frozen=True, slots=True)
class Alias:
    """A public name's weighted targets (config aliases[]), as resolution reads them."""

    models: list[str]
    weights: list[float]
    fallback: str | None
    by_session: bool
    """Draw per session key (aliases[].draw: session) when the request has one."""


@dataclass(frozen=True, slots=True)
class Resolved:
    model: str
    """The configured model that will serve the request."""
    alias: str | None
    """The public name the client used, when it was an alias."""
    lora: str | None = None
    """The LoRA adapter the request runs with (its blocks are namespaced by it), None for the base model."""


class ModelRegistry:
    def __init__(self, cfg: CortexConfig, bundles: BundleCache | None = None) -> None:
        """`bundles`: the process's loaded bundles, so a reload loads only the models whose files changed."""
        self.bundles: dict[str, ModelBundle] = (bundles or BundleCache()).load_all(cfg.bundle_sources())
        self.aliases = {a.name: Alias([t.model for t in a.targets], [t.weight for t in a.targets], a.fallback,
                                      a.draw == "session") for a in cfg.aliases}
        self.engines = {m.name: engines.adapter(m.engine) for m in cfg.models}
        self.configs = {m.name: m for m in cfg.models}
        # vLLM names an adapter by `model` itself; SGLang never does (its `model` is "<model>:<adapter>").
        self.loras_as_model = {a: m.name for m in cfg.models if self.engines[m.name].lora_as_model for a in m.loras}
        created = int(time.time())
        self.models_body = orjson.dumps({"object": "list", "data": [
            *({"id": m.name, "object": "model", "created": created, "owned_by": "cortex"} for m in cfg.models),
            *({"id": a, "object": "model", "created": created, "owned_by": "cortex", "root": a, "parent": m.name}
              for m in cfg.models for a in m.loras if self.engines[m.name].lora_as_model),
            *({"id": a.name, "object": "model", "created": created, "owned_by": "cortex",
               "root": a.targets[0].model} for a in cfg.aliases),
        ]})

    def resolve(self, name: str, serves: Callable[[str], bool], rng: random.Random | None = None,
                lora_path: str | None = None, session: str | None = None) -> Resolved:
        """The model (and LoRA adapter) for a request naming `name`; `serves(model)` says whether it has a healthy
        worker. The adapter is read the way the model's engine reads it, so the blocks Cortex looks up are the
        ones the engine will reuse: vLLM, `model` is the adapter's name (`lora_path` means nothing to vLLM);
        SGLang, `model: "<model>:<adapter>"`, else `lora_path`. `session`: the request's session key, for an alias
        that draws by session."""
        if name in self.bundles:
            return Resolved(name, None, self._body_lora(name, lora_path))
        base = self.loras_as_model.get(name)
        if base is not None:
            return Resolved(base, None, name)
        head, sep, adapter = name.partition(":")
        if sep and adapter:
            engine = self.engines.get(head)
            if engine is not None and engine.lora_as_suffix:
                return Resolved(head, None, adapter)
        alias = self.aliases.get(name)
        if alias is None:
            raise ClientError(404, f"The model `{name}` does not exist.", "model", reason="model_not_found")
        if alias.by_session and session is not None:
            drawn = session_draw(name, session, alias.models, alias.weights)
        else:
            drawn = (rng or random).choices(alias.models, alias.weights)[0]
        if not serves(drawn) and alias.fallback is not None:
            drawn = alias.fallback
        return Resolved(drawn, name, self._body_lora(drawn, lora_path))

    def _body_lora(self, model: str, lora_path: str | None) -> str | None:
        """The body's `lora_path`, for an engine that reads it (to vLLM it means nothing)."""
        engine = self.engines.get(model)
        return lora_path if engine is not None and engine.lora_path_field else None


def session_draw(alias: str, key: str, models: Sequence[str], weights: Sequence[float]) -> str:
    """The target of `alias` for session `key`: weighted rendezvous hashing. Each model scores -weight / ln(u),
    u in (0, 1) from a stable 64-bit hash of (alias, key, model); the highest score wins, which is model i with
    probability weight_i / sum(weights) over keys. A model's score depends only on its own weight, so raising it
    can only win sessions, and lowering it only lose them."""
    best, best_score = models[0], -math.inf
    for model, w in zip(models, weights, strict=True):
        h = xxhash.xxh3_64_intdigest(f"{alias}\x00{key}\x00{model}".encode("utf-8", "surrogatepass"))
        u = ((h >> 11) + 0.5) / 2**53  # 53 bits: exact in a float, strictly inside (0, 1)
        score = -w / math.log(u)
        if score > best_score:
            best, best_score = model, score
    return best
