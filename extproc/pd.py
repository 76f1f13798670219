"""PD orchestration, the decision rules: pools, the skip rule, the fallback pool, the pair as a value (pure, no I/O).

A model's healthy workers split into three pools by role (docs/pd.md):
  whole    role `both`: serves a request alone (a mixed pool);
  prefill  role `prefill`: the KV ledger and load pick it (where the prompt's prefix is cached);
  decode   role `decode`: load picks it (and its own cache where the engine keeps one).

A pair is used when both PD pools have a worker, unless the prefill leg would not pay for itself. Skipping
needs a worker that can serve the whole request: a `both` worker, or for vLLM a decoder (NIXL workers are
`kv_both` and prefill locally when no transfer params come). SGLang PD servers refuse requests without a
bootstrap room, so an SGLang model can only skip to a `both` worker.

extproc/plan.py applies these rules in order for one request (the PD planner step of its plan); the sending of
the legs, their failures and the pair's state machine are `extproc.pd_dispatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cortex import engines
from cortex.config import PdConfig
from extproc.cluster_view import TargetInfo
from extproc.policies.base import Decision

# Why a PD model's request went to one worker instead of a pair (the x-cortex-pd header and metrics).
SKIP_SHORT = "short_uncached_part"
SKIP_HELD = "decode_holds_prefix"
SKIP_N = "n_gt_1"  # vLLM's KV handoff has one consumer; n samples would each need their own (engines.md §2.2)
SKIP_BATCH = "batched_prompts"
SKIP_API = "api_not_paired"  # the PD legs speak chat completions and completions; other APIs are served alone


@dataclass(frozen=True, slots=True)
class Pools:
    engine: str
    whole: list[TargetInfo]
    prefill: list[TargetInfo]
    """Prefill workers that can be paired now (an SGLang one only once its bootstrap port is known)."""
    decode: list[TargetInfo]

    @property
    def pd_ready(self) -> bool:
        return bool(self.prefill and self.decode)

    @property
    def single(self) -> list[TargetInfo]:
        """Workers that can serve a request alone."""
        return self.whole + (self.decode if engines.adapter(self.engine).pd_roles_serve_alone else [])


def split_pools(workers: Sequence[TargetInfo]) -> Pools:
    engine = workers[0].engine if workers else engines.DEFAULT_ENGINE
    return Pools(
        engine=engine,
        whole=[w for w in workers if w.role == "both"],
        prefill=[w for w in workers if w.role == "prefill"
                 and (w.bootstrap_port or not engines.adapter(w.engine).pd_prefill_needs_bootstrap_port)],
        decode=[w for w in workers if w.role == "decode"],
    )


def no_pool_message(model: str, pools: Pools) -> str:
    if pools.prefill and not pools.decode:
        return f"model `{model}` has prefill workers but no healthy decode worker, and no worker serving alone"
    if pools.decode and not pools.prefill:
        return f"model `{model}` has decode workers but no healthy prefill worker, and no worker serving alone"
    return f"no healthy worker serves model `{model}`"


def skip_reason(*, prompt_tokens: int, prefill_cached_tokens: int, single_cached_tokens: int,
                cfg: PdConfig) -> str | None:
    """Why the prefill leg would not help this request (None: use the pair). Pure; tested with vectors.

    `prefill_cached_tokens`: what the chosen prefill worker holds (proven or just sent); `single_cached_tokens`:
    what the worker that would serve the request alone holds. The rule compares costs in prompt tokens
    (docs/pd.md, "Skipping the prefill leg"):

        alone = prompt - single_cached                       tokens the lone worker computes
        pair  = (prompt - prefill_cached) + transfer         the prefill's uncached tokens, plus the handoff
        skip when  INTERFERENCE * alone <= pair

    `transfer` is `pd.skip_prefill_uncached_tokens`: a handoff's fixed cost, in prompt tokens. A token computed
    alone is weighed INTERFERENCE (2) times: the lone worker is also decoding, and its prefill stalls those
    decode steps, the cost a pair exists to remove. With nothing cached anywhere this is the old threshold (a
    prompt of at most `transfer` tokens goes alone); the uncached part is measured on the worker that would
    serve, so a prompt cached only on the prefill side keeps its pair instead of landing on a cold worker.
    """
    if prompt_tokens <= 0:
        return SKIP_SHORT
    if single_cached_tokens / prompt_tokens >= cfg.skip_prefill_decode_hit_ratio:
        return SKIP_HELD
    if skip_by_cost(prompt_tokens=prompt_tokens, prefill_cached_tokens=prefill_cached_tokens,
                    single_cached_tokens=single_cached_tokens, transfer_tokens=cfg.skip_prefill_uncached_tokens):
        return SKIP_SHORT
    return None


INTERFERENCE = 2
"""How much a prompt token computed by a worker that also decodes costs, against one computed by a prefill
worker: its compute, plus the decode steps of that worker's other requests it holds up."""


def skip_by_cost(*, prompt_tokens: int, prefill_cached_tokens: int, single_cached_tokens: int,
                 transfer_tokens: int) -> bool:
    """True when serving alone costs no more than the pair (see skip_reason)."""
    alone = max(0, prompt_tokens - single_cached_tokens)
    pair = max(0, prompt_tokens - prefill_cached_tokens) + transfer_tokens
    return INTERFERENCE * alone <= pair


def fallback_pool(pools: Pools, exclude: frozenset[str] = frozenset()) -> list[TargetInfo]:
    """Where a request whose pair failed before its first byte is served alone, from a cold start (seed 000
    §2.4). Pure. `exclude`: workers (ids without a rank) of the failed pair, used only when nothing else is left.

    A `both` worker first. Without one: vLLM decode and prefill workers can each serve alone (NIXL workers are
    `kv_both`; a request without `kv_transfer_params` is an ordinary request, and a prefill worker may still hold
    the prompt it just computed); SGLang PD servers cannot (a decode-mode server waits for a bootstrap that never
    comes, a prefill-mode one computes the prompt, samples one token and waits for its decode), so an SGLang
    model without a `both` worker has no fallback and the client gets the pair's error.
    """
    if pools.whole:
        candidates = pools.whole
    elif engines.adapter(pools.engine).pd_roles_serve_alone:
        candidates = pools.decode + pools.prefill
    else:
        return []
    kept = [w for w in candidates if w.worker not in exclude]
    return kept or list(candidates)


def request_shape_skip(body: dict[str, Any] | None, engine: str) -> str | None:
    """Requests a pair cannot carry: several samples sharing one vLLM transfer, or batched prompts."""
    if body is None:
        return None
    n = body.get("n")
    if isinstance(n, int) and n > 1 and engines.adapter(engine).pd_single_consumer:
        return SKIP_N
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return SKIP_BATCH
    return None


@dataclass(frozen=True, slots=True)
class Pair:
    prefill: Decision
    decode: Decision
    targets: dict[str, TargetInfo]
    """Target info by id, for the legs' addresses, bootstrap ports and ranks."""


@dataclass(frozen=True, slots=True)
class PdPlan:
    """A PD model's part of a request's plan: the pair, or why it goes to one worker."""

    pair: Pair | None
    skip: str
    """Why no pair ('' when there is one)."""
    engine: str
    model: str
    cfg: PdConfig
    """The model's PD settings of the config generation the plan was made with."""
    stream: bool
    """The client asked for a stream (an SGLang decode then answers its headers at once)."""
