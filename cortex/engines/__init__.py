"""Engine adapters: everything that differs between engine families, one module per engine (docs/engines.md).

`adapter(name)` returns the adapter for a configured `engine` value. Adapters are found, not listed: every
module of this package that defines `ADAPTER` (an `EngineAdapter`) is one, so a new engine is one new file.
`ENGINE_NAMES` is what cortex.yaml accepts (the default first, then by name).
"""

from __future__ import annotations

import importlib
import pkgutil

from cortex.engines.base import ChainStartHasher, EngineAdapter, NotReproducible, PdLegs, RankLoad

__all__ = ["DEFAULT_ENGINE", "ENGINE_NAMES", "ChainStartHasher", "EngineAdapter", "NotReproducible", "PdLegs",
           "RankLoad", "adapter", "all_adapters"]

DEFAULT_ENGINE = "vllm"
"""The engine of a model or worker that does not name one."""


def _discover() -> dict[str, EngineAdapter]:
    found: dict[str, EngineAdapter] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: (i.name != DEFAULT_ENGINE, i.name)):
        if info.name.startswith("_") or info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        candidate = getattr(module, "ADAPTER", None)
        if candidate is None:
            continue  # a helper module shared by adapters
        if not isinstance(candidate, EngineAdapter):
            raise TypeError(f"{module.__name__}.ADAPTER is a {type(candidate).__name__}, not an EngineAdapter")
        if candidate.name in found:
            raise ValueError(f"engine {candidate.name!r} is defined twice ({module.__name__})")
        found[candidate.name] = candidate
    return found


_ADAPTERS = _discover()
ENGINE_NAMES: tuple[str, ...] = tuple(_ADAPTERS)


def adapter(name: str) -> EngineAdapter:
    """The adapter of engine `name` (a validated config value); KeyError names the known engines otherwise."""
    try:
        return _ADAPTERS[name]
    except KeyError:
        raise KeyError(f"unknown engine {name!r}; known: {', '.join(ENGINE_NAMES)}") from None


def all_adapters() -> list[EngineAdapter]:
    return list(_ADAPTERS.values())
