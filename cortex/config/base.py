"""What every section of cortex.yaml shares: the strict base model, the port type, and the error a bad file raises."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Port = Annotated[int, Field(ge=1, le=65535)]


class ConfigError(ValueError):
    """Raised with a readable, multi-line explanation of what is wrong in cortex.yaml."""


# Every section's base: unknown keys are errors (a typo never falls back to a default), a loaded config never changes,
# and each field's docstring is its description, which cortex/config/reference.py turns into docs/configuration.md.
class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
