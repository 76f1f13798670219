"""A simulated SGLang server's load reports: /metrics (``sglang:`` names, labelled per DP rank) and the figures of
/v1/loads (one report per DP rank, as JSON or flattened to Prometheus text).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cortexsim.config import SimConfig
from cortexsim.engine import EngineCore
from cortexsim.sglang_pd import DISAGGREGATION_MODES, SglangPd
from cortexsim.vllm_api import TTFT_BUCKETS

ENGINE_TYPES = {"both": "unified", "prefill": "prefill", "decode": "decode"}
"""The `engine_type` label of each simulator role."""
LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
"""What /v1/loads?include= may name."""


def used_tokens(e: EngineCore, pool_tokens: int) -> int:
    return round(e.cache.usage * pool_tokens)


def hit_rate(e: EngineCore) -> float:
    return e.cache.hit_tokens / e.cache.query_tokens if e.cache.query_tokens else 0.0


class SglangCollector(Collector):
    """SGLang's scheduler gauges and counters, per DP rank at scrape time."""

    def __init__(self, engines: list[EngineCore], model: str, config: SimConfig, pd: SglangPd) -> None:
        self.engines = engines
        self.model = model
        self.engine_type = ENGINE_TYPES[config.role]
        self.pool_tokens = config.pool_tokens
        self.pd = pd

    def collect(self) -> Iterable[Any]:
        engines, pd = self.engines, self.pd
        dp = len(engines) > 1
        labels = ["model_name", "engine_type", "tp_rank", "pp_rank", *(["dp_rank"] if dp else [])]

        def values(e: EngineCore) -> list[str]:
            return [self.model, self.engine_type, "0", "0", *([str(e.rank)] if dp else [])]

        def family(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str,
                   value: Any) -> Any:
            fam = kind(name, doc, labels=labels)
            for e in engines:
                fam.add_metric(values(e), value(e))
            return fam

        G, C = GaugeMetricFamily, CounterMetricFamily
        now = time.monotonic()
        yield family(G, "sglang:num_running_reqs", "The number of running requests.", lambda e: len(e.running))
        yield family(G, "sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                     lambda e: len(e.waiting))
        yield family(G, "sglang:token_usage", "The token usage.", lambda e: e.cache.usage)
        yield family(G, "sglang:num_used_tokens", "The number of used tokens.",
                     lambda e: used_tokens(e, self.pool_tokens))
        yield family(G, "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
                     lambda e: self.pool_tokens)
        yield family(G, "sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate)
        yield family(G, "sglang:gen_throughput", "The generation throughput (token/s).",
                     lambda e: e.stats.gen_throughput(now))
        yield family(G, "sglang:utilization", "Share of the running-request limit in use.",
                     lambda e: len(e.running) / e.max_running)
        yield family(G, "sglang:num_prefill_bootstrap_queue_reqs", "Prefill requests waiting for their decode.",
                     lambda e: pd.bootstrap_waiting[e.rank])
        yield family(G, "sglang:num_decode_transfer_queue_reqs", "Decode requests waiting for their KV.",
                     lambda e: pd.transfer_waiting[e.rank])
        yield family(C, "sglang:prompt_tokens", "Number of prefill tokens processed.", lambda e: e.prompt_tokens)
        yield family(C, "sglang:generation_tokens", "Number of generation tokens processed.",
                     lambda e: e.generation_tokens)
        yield family(C, "sglang:num_requests", "The number of processed requests.",
                     lambda e: e.stats.num_requests)
        yield family(C, "sglang:num_aborted_requests", "The number of aborted requests.",
                     lambda e: e.stats.num_aborted)
        yield family(C, "sglang:num_bootstrap_failed_reqs", "PD requests whose bootstrap failed.",
                     lambda e: pd.bootstrap_failed[e.rank])
        yield family(C, "sglang:num_transfer_failed_reqs", "PD requests whose KV transfer failed.",
                     lambda e: pd.transfer_failed[e.rank])
        cached = CounterMetricFamily("sglang:cached_tokens", "Number of cached prompt tokens.",
                                     labels=[*labels, "cache_source"])
        for e in engines:
            cached.add_metric([*values(e), "device"], e.cache.hit_tokens)
        yield cached


def metrics_registry(engines: list[EngineCore], model: str, config: SimConfig, pd: SglangPd) -> CollectorRegistry:
    """What /metrics serves: the collector's series, and the time-to-first-token histogram each engine feeds."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SglangCollector(engines, model, config, pd))
    n = len(engines)
    engine_type = ENGINE_TYPES[config.role]
    ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                     ["model_name", "engine_type", "tp_rank", "pp_rank", *(["dp_rank"] if n > 1 else [])],
                     buckets=TTFT_BUCKETS, registry=registry)
    for e in engines:
        e.on_first_token = ttft.labels(model, engine_type, "0", "0", *([str(e.rank)] if n > 1 else [])).observe
    return registry


def load_report(e: EngineCore, config: SimConfig, pd: SglangPd, include: set[str] | None) -> dict[str, Any]:
    """One DP rank's /v1/loads entry, with the sections `include` names (None: the core figures only)."""
    now = time.monotonic()
    pool_tokens = config.pool_tokens
    waiting_uncached = sum(len(r.prompt_token_ids) for r in e.waiting)
    used = used_tokens(e, pool_tokens)
    load: dict[str, Any] = {
        "timestamp": time.time(), "dp_rank": e.rank, "num_running_reqs": len(e.running),
        "num_waiting_reqs": len(e.waiting), "num_waiting_uncached_tokens": waiting_uncached,
        "num_used_tokens": used, "num_total_tokens": used, "num_active_tokens": used,
        "num_prealloc_ready_tokens": 0, "max_total_num_tokens": pool_tokens,
        "max_running_requests": e.max_running, "token_usage": e.cache.usage,
        "gen_throughput": e.stats.gen_throughput(now), "cache_hit_rate": hit_rate(e),
        "utilization": len(e.running) / e.max_running,
        "total_prefill_uncached_tokens": e.stats.prefill_computed_tokens, "total_prefill_busy_us": 0,
    }
    sections: dict[str, tuple[str, dict[str, Any]]] = {
        "memory": ("memory", {"weight_gb": 15.2, "kv_cache_gb": 0.0, "graph_gb": 0.0,
                              "token_capacity": pool_tokens}),
        "disagg": ("disaggregation", {
            "mode": DISAGGREGATION_MODES[config.role], "prefill_bootstrap_queue_reqs": pd.bootstrap_waiting[e.rank],
            "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": pd.transfer_waiting[e.rank], "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}),
        "queues": ("queues", {"waiting": len(e.waiting), "grammar": 0, "paused": 0, "retracted": 0,
                              "prealloc_ready": 0}),
    }
    for key, (name, section) in sections.items():
        if include is None or "all" in include or key in include:
            load[name] = section
    return load


def loads_prometheus(loads: list[dict[str, Any]]) -> str:
    """/v1/loads?format=prometheus: every numeric figure of the reports as a gauge labelled by DP rank (a
    section's figures prefixed by the section's name). Takes each report's `dp_rank` out."""
    prefixes = {"disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        rank = load.pop("dp_rank")
        for key, value in load.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        samples.setdefault(f"sglang_{prefixes.get(key, key)}_{sub}", []).append((rank, v))
            elif isinstance(value, int | float) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines: list[str] = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values]
    return "\n".join(lines) + "\n"
