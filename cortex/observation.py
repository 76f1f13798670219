"""The contract of the response observation: what extproc, Envoy's Lua filter and `cortex observe` say to each
other about one request, through Envoy's dynamic metadata (docs/observability.md).

- extproc writes its facts into namespace `cortex` (ext_proc `metadata_options.receiving_namespaces`): on the
  routing answer the model, whether it asked the engine for a stream's usage on the client's behalf, and what
  the request looked like (prompt hash, first token ids); on the response-headers answer the worker that
  served and the claim that went out in the x-cortex-* headers (a retried request claims nothing).
- the Lua filter (cortex/observe.lua) writes what it saw of the response into `cortex.observed`.
- Envoy's gRPC access log carries both, with its own status, flags and timings, to `cortex observe`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np
import xxhash

NAMESPACE = "cortex"
"""extproc's facts about the request."""
OBSERVED = "cortex.observed"
"""What the Lua filter saw of the response."""

# Keys in NAMESPACE.
MODEL = "model"
ALIAS = "alias"
"""The public alias the client named, when it named one (MODEL is then the target it drew)."""
USAGE_INJECTED = "usage_injected"
STREAM = "stream"
PROMPT_HASH = "prompt_hash"
FIRST_IDS = "first_ids"
"""The prompt's first FIRST_IDS_LOGGED token ids, comma-separated (a string is far cheaper to send than a list)."""
PROMPT_TOKENS = "prompt_tokens"
"""Cortex's own count (an estimate when routing stopped early; the engine's usage is the exact one)."""
WORKER = "worker"
PREFILL = "prefill"
MODE = "mode"
REASON = "reason"
CLAIMED = "claimed_hit_tokens"
TENANT = "tenant"
RESERVED = "reserved_tokens"
"""Tokens the request holds reserved against its tenant's token limits (absent: none): the observer settles them."""
DROPPED = "dropped_reason"
"""Why Cortex refused it (x-cortex-dropped-reason), on every answer Cortex gives itself."""
QUEUED_MS = "queued_ms"
"""How long it waited in the waiting room before it was routed (absent: it did not wait)."""
PREDICTED_TTFT = "predicted_ttft_ms"
"""The time model's TTFT for the worker it chose (absent under another rule): the observer learns each worker's
observed / predicted ratio from it (cortex/calibration.py)."""
QUOTA_PERIOD = "quota_period_s"
"""The tenant's token-quota period in force when it was admitted (the observer charges that window)."""
FIRST_IDS_LOGGED = 64
"""How many of the prompt's first token ids the request log carries (never the text)."""


def prompt_hash(text: str | None, ids: Sequence[int] | None) -> str:
    """A fingerprint of the whole prompt for the request log: equal prompts (as rendered for the engine, or as
    token ids) share it, and the text cannot be read back from it. XXH3-64 of the UTF-8 text, else of the ids
    as little-endian uint32."""
    if text is not None:
        return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))
    if ids is not None:
        return xxhash.xxh3_64_hexdigest(np.asarray(ids, dtype="<u4").tobytes())
    return ""


@cache
def lua_source() -> str:
    return (Path(__file__).with_name("observe.lua")).read_text()
