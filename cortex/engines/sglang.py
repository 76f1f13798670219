"""SGLang 0.5.23 (../shared/reference/engines.md §1, §3-§5, kv-events.md §4).

Pages of 1 token on CUDA (`--page-size`), hashed as one fixed SHA-256 chain over the token ids (a salt seeds
the chain); events carry the salt in its own field. Load is read from /v1/loads (one entry per DP rank), a DP
rank is picked by the body's `routed_dp_rank`, and PD sends both legs at once, meeting through a bootstrap room
on the prefill worker's bootstrap port.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from cortex.api_paths import (
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    EMBEDDINGS,
    GENERATE,
    MESSAGES,
    RERANK,
    RESPONSES,
    SCORE,
    TOKENIZER_PATHS,
)
from cortex.engine_hashes import sglang_page_hashes, sglang_wire_hash
from cortex.engines.base import ChainStartHasher, EngineAdapter, PdTimeouts, RankLoad
from cortex.media import MediaSpan

DP_RANK_FIELD = "routed_dp_rank"
"""SGLang pins a DP rank from the body only (engines.md §1.8)."""

_U64 = (1 << 64) - 1


def parse_loads(doc: Any) -> dict[int, RankLoad]:
    """(running, waiting, activity, KV usage, pool) per DP rank from /v1/loads; activity is its cumulative
    prefill-token count, KV usage its `token_usage` (0..1), the pool its `max_total_num_tokens`."""
    loads = doc.get("loads", []) if isinstance(doc, dict) else []
    out: dict[int, RankLoad] = {}
    for e in loads:
        if isinstance(e, dict):
            rank = int(e.get("dp_rank") or 0)
            prev = out.get(rank, RankLoad(0.0, 0.0, 0.0))
            usage = e.get("token_usage")
            kv = float(usage) if isinstance(usage, (int, float)) and not isinstance(usage, bool) else None
            pool = e.get("max_total_num_tokens")
            cap = float(pool) if isinstance(pool, (int, float)) and not isinstance(pool, bool) and pool > 0 else None
            out[rank] = RankLoad(prev.running + float(e.get("num_running_reqs", 0)),
                                 prev.waiting + float(e.get("num_waiting_reqs", 0)),
                                 prev.activity + float(e.get("total_prefill_uncached_tokens", 0)),
                                 kv if prev.kv_usage is None else max(prev.kv_usage, kv or 0.0),
                                 cap if prev.kv_capacity_tokens is None else prev.kv_capacity_tokens)
    return out


def _wire_hashes(tokens: Sequence[int], page_size: int, salt: str | None) -> list[int]:
    # Signed on the wire; ingest holds every hash unsigned (ingest/events.py).
    return [sglang_wire_hash(h) & _U64 for h in sglang_page_hashes(tokens, page_size, cache_salt=salt)]


class SglangAdapter(EngineAdapter):
    name = "sglang"

    default_page_size = 1
    page_size_flag = "--page-size"
    default_hash_algo = None

    def chain_start_hasher(self, hash_algo: str | None, hash_seed: str | None) -> ChainStartHasher:
        return ChainStartHasher("SGLang's SHA-256 page chain", _wire_hashes)

    event_layout = "msgpack-kv-events"

    def event_salt(self, cache_salt: str | None, extra_keys: Sequence[Any] | None,
                   lora_name: str | None) -> str | None:
        if cache_salt is not None or not extra_keys:
            return cache_salt
        # RFC sgl-project/sglang#39991 (vLLM's schema): the salt also rides in `extra_keys`, `[(salt,), None,
        # ...]` lined up with the blocks, on a chain start's first block.
        first = extra_keys[0]
        if isinstance(first, list | tuple) and len(first) == 1 and isinstance(first[0], str):
            return first[0]
        return None

    # Not claimed until SGLang's accounting of host and storage hits in `cached_tokens` is proven: HiCache hits
    # are scored at their tier weight only.
    counted_media = frozenset[str]()

    load_path = "/v1/loads"

    def parse_load(self, raw: bytes) -> dict[int, RankLoad]:
        # As aiohttp's resp.json() reads it: an empty body is no document.
        text = raw.decode().strip()
        return parse_loads(json.loads(text) if text else None)

    # `--lora-paths NAME=PATH`, loaded at run time: `model: "<model>:NAME"` or `lora_path: NAME`.
    lora_as_model = False
    lora_as_suffix = True
    lora_path_field = True

    # Its OpenAI server's inference routes (vLLM 0.32 has no /generate; SGLang 0.5.23 serves all nine, count_tokens
    # in sglang/srt/entrypoints/http_server.py).
    inference_paths = frozenset({CHAT, COMPLETIONS, RESPONSES, MESSAGES, COUNT_TOKENS, GENERATE, EMBEDDINGS, RERANK,
                                 SCORE})
    tokenizer_paths = frozenset(TOKENIZER_PATHS)  # /v1/tokenize and /v1/detokenize, each also unprefixed
    tool_style = "sglang"

    def media_page_extras(self, items: Sequence[MediaSpan], n_pages: int, page_size: int) -> list[list[Any]] | None:
        # SGLang keys a media item by writing pad values derived from its hash into the token ids themselves
        # (mm_utils.pad_input_tokens); Cortex does not reproduce them, so media requests are routed by load.
        return None

    def cache_read_limit(self, api: str, body: Mapping[str, Any]) -> int | None:
        # SGLang 0.5.23: Req._compute_max_prefix_len caps the prefix match at logprob_start_len when the request
        # returns logprobs from there (schedule_batch.py); /v1/completions sets it to 0 with echo + logprobs
        # (serving_completions.py), /generate takes it from the body (io_struct.py: -1, the default, is none).
        if api == "completion":
            return 0 if body.get("echo") and body.get("logprobs") else None
        if api != "generate" or not body.get("return_logprob"):
            return None
        start = body.get("logprob_start_len")
        if isinstance(start, list):
            start = start[0] if start else None
        if isinstance(start, int) and not isinstance(start, bool) and start >= 0:
            return start
        return None

    def rank_headers(self, rank: int) -> Mapping[str, str]:
        return {}

    def rank_body(self, rank: int) -> Mapping[str, Any]:
        return {DP_RANK_FIELD: rank}

    pd_legs = "concurrent"
    # A decode-mode server waits for a bootstrap that never comes; a prefill-mode one waits for its decode.
    pd_roles_serve_alone = False
    pd_prefill_needs_bootstrap_port = True
    bootstrap_port_info = ("/server_info", "disaggregation_bootstrap_port")  # engines.md §1.3
    pd_single_consumer = False

    def pd_prefill_wait_s(self, pd: PdTimeouts) -> float:
        return pd.dispatch_timeout_s

    def tokenize_request(self, model: str, probe: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        # add_generation_prompt omitted: SGLang then renders exactly as a chat completion does (engines.md §5.2).
        return "/v1/tokenize", {"model": model, **probe}


ADAPTER = SglangAdapter()
