"""The model registry: served models with their bundles, and public aliases over them (seed 004 §3.1).

An alias maps a name clients send (`chat-prod`) to weighted models (`qwen-7b-v3` 90, `qwen-7b-v2` 10)
with a fallback. The draw is per request, at random, not per user: a per-user hash would reshuffle users
between versions whenever the weights change, turning caches cold, while random draws at small canary
shares disturb little. The worker receives the model it serves, so the request body's `model` is
rewritten when an alias was used.

A registry is immutable; a config reload builds a new one off the request path (reusing bundles whose
files did not change) and swaps it in whole.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from cortex.bundle import ModelBundle
from cortex.config import CortexConfig
from cortex.errors import ClientError


@dataclass(frozen=True, slots=True)
class Resolved:
    model: str
    """The configured model that will serve the request."""
    alias: str | None
    """The public name the client used, when it was an alias."""


class ModelRegistry:
    def __init__(self, cfg: CortexConfig, previous: ModelRegistry | None = None) -> None:
        reuse = previous._bundles_by_source if previous is not None else {}
        self.bundles: dict[str, ModelBundle] = {}
        self._bundles_by_source: dict[tuple[str, str | None], ModelBundle] = {}
        for m in cfg.models:
            key = (str(m.tokenizer_dir()), m.chat_template)
            bundle = reuse.get(key) or ModelBundle.load(m.name, m.tokenizer_dir(), m.chat_template)
            self.bundles[m.name] = bundle
            self._bundles_by_source[key] = bundle
        self.aliases = {a.name: ([t.model for t in a.targets], [t.weight for t in a.targets], a.fallback)
                        for a in cfg.aliases}
        created = int(time.time())
        self.models_body = orjson.dumps({"object": "list", "data": [
            *({"id": m.name, "object": "model", "created": created, "owned_by": "cortex"} for m in cfg.models),
            *({"id": a.name, "object": "model", "created": created, "owned_by": "cortex",
               "root": a.targets[0].model} for a in cfg.aliases),
        ]})

    def resolve(self, name: str, serves: Callable[[str], bool], rng: random.Random | None = None) -> Resolved:
        """The model for a request naming `name`; `serves(model)` says whether it has a healthy worker."""
        if name in self.bundles:
            return Resolved(name, None)
        alias = self.aliases.get(name)
        if alias is None:
            raise ClientError(404, f"The model `{name}` does not exist.", "model")
        models, weights, fallback = alias
        drawn = (rng or random).choices(models, weights)[0]
        if not serves(drawn) and fallback is not None:
            drawn = fallback
        return Resolved(drawn, name)
