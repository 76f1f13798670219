"""What Cortex needs to know about an engine family, in one interface (docs/engines.md).

Everything that differs between vLLM and SGLang is a member of `EngineAdapter`; the rest of Cortex asks the
adapter (`cortex.engines.adapter(name)`) instead of comparing engine names. Members are plain facts (class
attributes) where the difference is a fact, and small pure functions where it is a rule; no member does I/O,
so each is tested with vectors (tests/test_engine_adapters.py).

This module imports nothing from `ingest` or `extproc` (both import it), nor `cortex.config` (which imports it):
a member that needs a config section or an event takes the values it reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple, Protocol

from cortex.conversation.template_args import ToolStyle
from cortex.media import MediaSpan


class PdTimeouts(Protocol):
    """The two timeouts of cortex.yaml's `pd` section an adapter chooses between (`PdConfig` is one): a fact
    instead of the config class, so that engines/ stays a leaf that cortex/config/ imports."""

    @property
    def prefill_timeout_s(self) -> float: ...

    @property
    def dispatch_timeout_s(self) -> float: ...


class RankLoad(NamedTuple):
    """One DP rank's load reading."""

    running: float
    waiting: float
    activity: float
    """A cumulative counter that moves whenever the rank did prefill work, so ingest can tell an idle worker from
    a busy one between readings."""
    kv_usage: float | None = None
    """Share of the rank's KV-cache pool in use, 0..1 (vLLM kv_cache_usage_perc, SGLang token_usage); None when
    the engine did not report it. Claims on a nearly full pool are withheld (extproc/policies/claims.py)."""
    kv_capacity_tokens: float | None = None
    """The rank's KV pool in tokens (vLLM `vllm:cache_config_info` num_gpu_blocks x block_size, per rank; SGLang
    `max_total_num_tokens`); None when not reported."""
    uncached: float | None = None
    """Cumulative prompt tokens the rank had to compute (vLLM: prefix-cache queries less hits, counted once per
    admission; hits are whole blocks, so a request's uncached tokens start at a block boundary). None: not
    reported. With `finished`, proof that a block was stored (ingest/silence.py, `stored_a_block`)."""
    finished: float | None = None
    """Cumulative requests finished, for any reason (vLLM `request_success`, every `finished_reason`); None: not
    reported."""

PdLegs = Literal["sequential", "concurrent"]


class NotReproducible(Exception):
    """The engine's block hashes cannot be recomputed outside it for this configuration (the reason is the
    message): hash parity is `unchecked`, never `failed`."""


@dataclass(frozen=True, slots=True)
class ChainStartHasher:
    """Recomputes the wire hashes an engine publishes for a chain start (a BlockStored without parent)."""

    how: str
    """The algorithm and seed, for the parity reason shown in /cortex/workers."""
    wire_hashes: Callable[[Sequence[int], int, str | None], list[int]]
    """(token ids, page size, cache salt) -> the hashes of the full pages, as ingest holds them (unsigned
    64-bit ints, whatever sign the engine puts on the wire)."""


class EngineAdapter(ABC):
    """One engine family. Subclasses declare every annotated attribute below themselves (none is inherited,
    so a new engine cannot silently take another's fact) and implement every method; the conformance test
    checks both. Instances are stateless singletons, registered by their module's `ADAPTER`."""

    name: ClassVar[str]
    """The `engine` value in cortex.yaml (models[].engine, workers[].engine), metric labels and headers."""

    # -- KV blocks and their hashes ------------------------------------------------------------------------
    default_page_size: ClassVar[int]
    """Tokens per KV block (page) when the model's `page_size` is not set: the engine's own default."""
    page_size_flag: ClassVar[str]
    """The engine flag that sets it (named in docs and errors)."""
    default_hash_algo: ClassVar[str | None]
    """The block-hash algorithm assumed when the model's `hash_algo` is not set (None: the engine has one
    fixed algorithm and `hash_algo` does not apply)."""

    @abstractmethod
    def chain_start_hasher(self, hash_algo: str | None, hash_seed: str | None) -> ChainStartHasher:
        """The hasher that reproduces a worker's chain starts, given the model's `hash_algo` (None: the
        default) and `hash_seed`; raises NotReproducible with the reason when no one outside the engine can."""

    # -- KV events -----------------------------------------------------------------------------------------
    event_layout: ClassVar[str]
    """Which wire layout its KV-event batches use (ingest/events.py decodes `msgpack-kv-events`: the ZMQ +
    msgpack batches vLLM defined and SGLang publishes too). A new layout needs its own decoder there."""

    @abstractmethod
    def event_salt(self, cache_salt: str | None, extra_keys: Sequence[Any] | None,
                   lora_name: str | None) -> str | None:
        """The cache salt a BlockStored was stored under, from the event's fields (the Cortex key of a salted
        block is namespaced by it, docs/ledger.md)."""

    counted_media: ClassVar[frozenset[str]]
    """Lower tiers (cortex.kv_events TIERS other than the GPU) whose hits the engine reports in a response's
    `cached_tokens`: only those are claimed (extproc/engine_hits.py); hits on the others count in the score only."""

    # -- Media ---------------------------------------------------------------------------------------------
    @abstractmethod
    def media_page_extras(self, items: Sequence[MediaSpan], n_pages: int, page_size: int) -> list[list[Any]] | None:
        """For a prompt whose media items take `items` (sorted by offset), each of its first `n_pages` pages'
        content extra keys as the engine's KV events publish them (cortex/blockkeys.py: content_extras; [] for a
        page without media). None when Cortex does not reproduce the engine's media keys: its requests with media
        are then routed by load, never claimed."""

    # -- Load ----------------------------------------------------------------------------------------------
    load_path: ClassVar[str]
    """The GET endpoint ingest reads the worker's load from."""

    @abstractmethod
    def parse_load(self, raw: bytes) -> dict[int, RankLoad]:
        """That endpoint's body -> load per DP rank (rank 0 when the engine does not say). Raises ValueError
        on a body that is not the engine's format (the poll counts it as a failed reading)."""

    # -- LoRA adapters -------------------------------------------------------------------------------------
    lora_as_model: ClassVar[bool]
    """A client picks an adapter with `model: <adapter>` (so adapter names share the model namespace, are
    listed by /v1/models, and must be configured in models[].loras)."""
    lora_as_suffix: ClassVar[bool]
    """A client picks an adapter with `model: "<model>:<adapter>"`."""
    lora_path_field: ClassVar[bool]
    """A client picks an adapter with the body's `lora_path` (when `model` names the base model)."""

    # -- Inference APIs -----------------------------------------------------------------------------------
    inference_paths: ClassVar[frozenset[str]]
    """The public inference paths its OpenAI server serves (extproc/inference_paths.py): a request on another
    path is refused by Cortex (404) rather than sent to a worker that would not know it."""
    tokenizer_paths: ClassVar[frozenset[str]]
    """Which of api_paths.TOKENIZER_PATHS its server serves: a request on another is refused by Cortex (404)."""
    tool_style: ClassVar[ToolStyle]
    """How its server dumps a request's tools for the chat template (template_tools in
    cortex/conversation/template_args.py)."""

    @abstractmethod
    def cache_read_limit(self, api: str, body: Mapping[str, Any]) -> int | None:
        """The most prompt tokens the engine will read from its prefix cache for this request (`api` as
        extproc/request.py names it, `body` its parsed JSON): None for no limit beyond its own, 0 when it reads
        none (a request that asks for the prompt's logprobs is computed whole). Cortex then claims no more."""

    # -- Data-parallel ranks -------------------------------------------------------------------------------
    @abstractmethod
    def rank_headers(self, rank: int) -> Mapping[str, str]:
        """Request headers that pin a request to DP rank `rank` behind one URL (empty if the body does it)."""

    @abstractmethod
    def rank_body(self, rank: int) -> Mapping[str, Any]:
        """Body fields that pin a request to DP rank `rank` (empty if a header does it)."""

    # -- Prefill/decode disaggregation ---------------------------------------------------------------------
    pd_legs: ClassVar[PdLegs]
    """`sequential`: the prefill leg is answered first and its answer is handed to the decode leg (vLLM's
    kv_transfer_params). `concurrent`: both legs are sent at once and meet through a bootstrap room (SGLang)."""
    pd_roles_serve_alone: ClassVar[bool]
    """A `prefill` or `decode` worker can serve a whole request on its own (no PD fields): a PD model can then
    skip the prefill leg to a decoder, and fall back to either role when a pair fails."""
    pd_prefill_needs_bootstrap_port: ClassVar[bool]
    """A prefill worker is paired only once its bootstrap port is known (config or `bootstrap_port_info`)."""
    bootstrap_port_info: ClassVar[tuple[str, str] | None]
    """(GET path, JSON field) where a prefill worker reports its bootstrap port, read by ingest's health
    probe when the config does not give it; None when the engine needs no bootstrap port."""
    pd_single_consumer: ClassVar[bool]
    """A KV handoff has one consumer, so a request asking for n > 1 samples is not paired."""

    @abstractmethod
    def pd_prefill_wait_s(self, pd: PdTimeouts) -> float:
        """How long one attempt at the prefill leg may hold the request's start: its whole answer for
        `sequential` legs, its dispatch for `concurrent` ones (the start budget is two attempts)."""

    # -- Tokenizer parity ----------------------------------------------------------------------------------
    @abstractmethod
    def tokenize_request(self, model: str, probe: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) asking the worker to tokenize `probe` ({"messages": ..., "tools"?: ...} or
        {"prompt": ...}) exactly as a chat or completions request would be, generation prompt included."""
