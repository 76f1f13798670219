"""The configuration reference in docs/configuration.md, generated from the models' fields and docstrings."""

from __future__ import annotations

from pydantic import BaseModel

from cortex.config.fleet import AliasConfig, AliasTarget, KubernetesPool, ModelConfig, WorkerConfig
from cortex.config.tenancy import TenantConfig
from cortex.config.toplevel import CortexConfig


def reference_markdown() -> str:
    """Every field with its default and meaning, generated from the schema (docs/configuration.md)."""
    lines: list[str] = []

    def section(title: str, model: type[BaseModel], prefix: str) -> None:
        lines.extend([f"### `{title}`", "", (model.__doc__ or "").strip(), "",
                      "| field | default | meaning |", "|---|---|---|"])
        nested = []
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                nested.append((f"{prefix}{name}", ann))
                continue
            if field.is_required():
                default = "required"
            elif field.default_factory is not None:
                default = f"`{field.default_factory()!r}`"  # type: ignore[call-arg]
            else:
                default = f"`{field.default!r}`"
            desc = " ".join((field.description or "").split())
            lines.append(f"| `{prefix}{name}` | {default} | {desc} |")
        lines.append("")
        for sub_prefix, sub in nested:
            section(sub_prefix, sub, f"{sub_prefix}.")

    section("cortex.yaml (top level)", CortexConfig, "")
    section("models[]", ModelConfig, "")
    section("workers[]", WorkerConfig, "")
    section("aliases[]", AliasConfig, "")
    section("aliases[].targets[]", AliasTarget, "")
    section("tenants[]", TenantConfig, "")
    section("discovery.kubernetes[]", KubernetesPool, "")
    return "\n".join(lines)
