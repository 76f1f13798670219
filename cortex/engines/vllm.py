"""vLLM 0.33 (../shared/reference/engines.md §2-§5, kv-events.md §2-§3).

Blocks of 16 tokens (`--block-size`), hashed by `--prefix-caching-hash-algo` (SHA-256 of a pickle by default)
from a NONE_HASH seeded by PYTHONHASHSEED; events carry the salt and LoRA name untagged in `extra_keys`. Load is
read from the Prometheus /metrics (one `engine` label per DP rank), a DP rank is picked by header, and PD runs
the NIXL proxy flow: prefill first, then decode with its kv_transfer_params.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from cortex import headers
from cortex.api_paths import CHAT, COMPLETIONS, COUNT_TOKENS, EMBEDDINGS, MESSAGES, RERANK, RESPONSES, SCORE
from cortex.engine_hashes import (
    VLLM_HASH_ALGOS,
    VllmBlockHasher,
    none_hash_reproducible,
    vllm_mm_keys,
    vllm_wire_hash,
)
from cortex.engines.base import ChainStartHasher, EngineAdapter, NotReproducible, PdTimeouts, RankLoad
from cortex.kv_events import TIER_CPU, TIER_STORAGE
from cortex.media import MediaSpan

DP_RANK_HEADER = headers.DP_RANK
"""vLLM's selector of the engine inside a DP deployment (one API server, `--data-parallel-size` engines)."""

_SERIES = ((b"vllm:num_requests_running", 0), (b"vllm:num_requests_waiting", 1),
           (b"vllm:prefix_cache_queries_total", 2), (b"vllm:kv_cache_usage_perc", 3),
           (b"vllm:prefix_cache_hits_total", 4), (b"vllm:request_success_total", 5))
"""The only series Cortex reads, and where each lands (summed per rank over their other labels)."""
_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_metrics(text: bytes) -> dict[int, RankLoad]:
    """(running, waiting, activity, KV usage, pool, uncached, finished) per DP rank (vLLM's `engine` label; 0
    when absent). Activity is a cumulative counter (prompt tokens looked up in the prefix cache) that moves
    whenever a request ran; uncached is that less the hits, finished the requests ended for any reason (None
    where the engine does not report them).

    A real vLLM's exposition is mostly histograms (tens of families, buckets per model and rank): this looks
    for the six names with bytes.find and reads only their sample lines, so the cost is a few passes of
    C-speed search over the body plus a few lines of Python, not a parse of every family (issue 14)."""
    out: dict[int, list[float]] = {}
    usage: dict[int, float] = {}
    seen: set[int] = set()
    for name, index in _SERIES:
        at = text.find(name)
        while at >= 0:
            end = text.find(b"\n", at)
            if end < 0:
                end = len(text)
            # A sample line starts with the name; a HELP/TYPE comment or a label value that contains it does not.
            if at == 0 or text[at - 1] == 0x0A:
                sample = _sample(text[at + len(name):end])
                if sample is not None:
                    rank, value = sample
                    seen.add(index)
                    if index == 3:  # a ratio: one per rank, never summed
                        usage[rank] = value
                    else:
                        out.setdefault(rank, [0.0] * 6)[index] += value
            at = text.find(name, end)
    pool = _pool_tokens(text)
    counted = {2, 4, 5} <= seen  # queries, hits and finished requests, or no proof of a stored block from them
    return {r: RankLoad(v[0], v[1], v[2], usage.get(r), pool, v[2] - v[4] if counted else None,
                        v[5] if counted else None) for r, v in out.items()}


_CACHE_INFO = b"vllm:cache_config_info"


def _pool_tokens(text: bytes) -> float | None:
    """One rank's KV pool in tokens from `vllm:cache_config_info` (labels num_gpu_blocks and block_size; with
    DP the front end sums every engine's blocks into the one config that labels each rank's sample, so the sum
    is divided by the ranks that report it). None when the series or its labels are absent."""
    at = text.find(_CACHE_INFO)
    ranks: set[bytes] = set()
    blocks = block_size = 0
    while at >= 0:
        end = text.find(b"\n", at)
        if end < 0:
            end = len(text)
        rest = text[at + len(_CACHE_INFO):end]
        if (at == 0 or text[at - 1] == 0x0A) and rest[:1] == b"{":
            labels = dict(_LABEL.findall(rest[1:rest.rfind(b"}")]))
            try:
                blocks, block_size = int(labels[b"num_gpu_blocks"]), int(labels[b"block_size"])
            except (KeyError, ValueError):
                return None
            ranks.add(labels.get(b"engine", b"0"))
        at = text.find(_CACHE_INFO, end)
    if not ranks or blocks <= 0 or block_size <= 0:
        return None
    return blocks * block_size / len(ranks)


def _sample(rest: bytes) -> tuple[int, float] | None:
    """(rank, value) from what follows the series name on its line: `{labels} value [timestamp]` or
    ` value [timestamp]`. None for another series that shares the prefix (`..._running_other`) or a line
    without a value; a value that is not a number raises ValueError (the poll counts a failed reading)."""
    rank = 0
    if rest[:1] == b"{":
        close = rest.rfind(b"}")  # label values may hold "}"; nothing after the label set does
        if close < 0:
            return None
        for key, value in _LABEL.findall(rest[1:close]):
            if key == b"engine" and value.isdigit():
                rank = int(value)
        rest = rest[close + 1:]
    elif rest[:1] not in (b" ", b"\t"):
        return None
    fields = rest.split()
    return (rank, float(fields[0])) if fields else None


class VllmAdapter(EngineAdapter):
    name = "vllm"

    default_page_size = 16
    page_size_flag = "--block-size"
    default_hash_algo = "sha256"

    def chain_start_hasher(self, hash_algo: str | None, hash_seed: str | None) -> ChainStartHasher:
        algo = hash_algo or self.default_hash_algo
        if algo not in VLLM_HASH_ALGOS:
            raise NotReproducible(f"hash algorithm {algo!r} is not reproduced")
        if not none_hash_reproducible(algo, hash_seed):
            # vLLM seeds the xxhash pair's NONE_HASH from os.urandom unless PYTHONHASHSEED is set: no one
            # outside the engine process can recompute a chain start (the page size is still checked).
            raise NotReproducible(
                f"{algo} without PYTHONHASHSEED has a random NONE_HASH per engine process; set "
                "PYTHONHASHSEED on the workers and the model's hash_seed to check hash parity")
        hasher = VllmBlockHasher(algo, hash_seed)

        def wire_hashes(tokens: Sequence[int], page_size: int, salt: str | None) -> list[int]:
            return [vllm_wire_hash(h) for h in hasher.block_hashes(tokens, page_size, cache_salt=salt)]

        return ChainStartHasher(f"{algo} with seed {hasher.seed!r}", wire_hashes)

    event_layout = "msgpack-kv-events"

    def event_salt(self, cache_salt: str | None, extra_keys: Sequence[Any] | None,
                   lora_name: str | None) -> str | None:
        if cache_salt is not None or not extra_keys:
            return cache_salt
        # vLLM publishes extra keys untagged, per block: [lora_name?, ..., salt?] with the salt on block 0.
        first = extra_keys[0]
        if isinstance(first, list):
            rest = [k for k in first if isinstance(k, str) and k != lora_name]
            return rest[-1] if rest else None
        return None

    def media_page_extras(self, items: Sequence[MediaSpan], n_pages: int, page_size: int) -> list[list[Any]] | None:
        # vllm/v1/core/kv_cache_utils.py: _gen_mm_extra_hash_keys puts ("mm", identifier, offset - page start) on
        # every page its placeholder run touches, in the items' order; to_event_extra_keys publishes
        # (identifier, offset). tests/fixtures/media_vectors.json holds vLLM 0.32's own output.
        return [[list(k) for k in vllm_mm_keys(items, p * page_size, (p + 1) * page_size)] for p in range(n_pages)]

    # A connector's hit (OffloadingConnector's CPU / storage tiers, LMCache) is the request's external hit, and
    # `cached_tokens` is `prefill_stats.num_cached_tokens` = local + external (vllm/v1/metrics/stats.py:
    # PrefillStats.set, set by the scheduler with num_external_computed_tokens; v1/engine/output_processor.py).
    counted_media = frozenset({TIER_CPU, TIER_STORAGE})

    load_path = "/metrics"

    def parse_load(self, raw: bytes) -> dict[int, RankLoad]:
        return parse_metrics(raw)

    # `--lora-modules NAME=PATH`: the adapter is served under its own model name.
    lora_as_model = True
    lora_as_suffix = False
    lora_path_field = False

    # Its OpenAI server's inference routes (vLLM 0.32 has no /generate; count_tokens is
    # vllm/entrypoints/anthropic/api_router.py).
    inference_paths = frozenset({CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS, EMBEDDINGS, RERANK, SCORE})
    tokenizer_paths = frozenset({"/tokenize", "/detokenize"})  # vllm/entrypoints/serve/tokenize/api_router.py
    tool_style = "vllm"

    def cache_read_limit(self, api: str, body: Mapping[str, Any]) -> int | None:
        # vLLM 0.32: SamplingParams.skip_reading_prefix_cache defaults to `prompt_logprobs is not None`, and the
        # OpenAI layer sets prompt_logprobs from top_logprobs (chat) or logprobs (completions) when `echo` is on
        # (chat_completion/protocol.py, completion/protocol.py: to_sampling_params).
        if api not in ("chat", "completion"):
            return None
        if body.get("prompt_logprobs") is not None:
            return 0
        if body.get("echo"):
            echoed = body.get("top_logprobs", 0) if api == "chat" else body.get("logprobs")
            if echoed is not None:
                return 0
        return None

    def rank_headers(self, rank: int) -> Mapping[str, str]:
        return {DP_RANK_HEADER: str(rank)}

    def rank_body(self, rank: int) -> Mapping[str, Any]:
        return {}

    pd_legs = "sequential"
    # NIXL workers are `kv_both`: a request without kv_transfer_params is an ordinary request on either role.
    pd_roles_serve_alone = True
    pd_prefill_needs_bootstrap_port = False
    bootstrap_port_info = None
    pd_single_consumer = True  # engines.md §2.2: one transfer, one decode

    def pd_prefill_wait_s(self, pd: PdTimeouts) -> float:
        return pd.prefill_timeout_s

    def tokenize_request(self, model: str, probe: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": model, **probe}
        if "messages" in probe:
            body["add_generation_prompt"] = True
        return "/tokenize", body


ADAPTER = VllmAdapter()
