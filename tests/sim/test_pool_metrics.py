"""The KV pool's size on /metrics, under the names and labels the real engines use: vLLM's
``vllm:cache_config_info`` (an info gauge, vllm/v1/metrics/loggers.py ``log_metrics_info``, labels from
``CacheConfig.metrics_info()``) and SGLang's ``sglang:max_total_num_tokens``."""

from __future__ import annotations

from typing import Any

import aiohttp

from cortexsim.server import SimServer
from tests.sim.simkit import config, metric_samples, serve


def samples(found: list[tuple[str, dict[str, str], float]], name: str) -> list[dict[str, str]]:
    return [labels for n, labels, value in found if n == name and value == 1]


def test_vllm_reports_its_cache_config_as_vllm_does() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        (info,) = samples(await metric_samples(http), "vllm:cache_config_info")
        assert info == {
            "engine": "0", "block_size": "16", "num_gpu_blocks": "2048", "enable_prefix_caching": "True",
            "cache_dtype": "auto", "gpu_memory_utilization": "0.92", "prefix_caching_hash_algo": "sha256",
            "num_gpu_blocks_override": "None", "num_cpu_blocks": "0", "is_attention_free": "False",
            "sliding_window": "None", "kv_cache_memory_bytes": "None",
            # max_model_len min(32768, 2047 x 16) = 32752: 2047 blocks a request; 2048 / 2047 of them fit.
            "kv_cache_size_tokens": str(int(2048 / 2047 * 32752)), "kv_cache_max_concurrency": str(2048 / 2047)}

    serve(scenario)


def test_vllm_cache_config_with_dp_and_explicit_pool() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        infos = samples(await metric_samples(http), "vllm:cache_config_info")
        assert sorted(i["engine"] for i in infos) == ["0", "1"]
        for info in infos:
            # vLLM's front end sums the engines' blocks into the one CacheConfig every rank's sample carries.
            assert info["num_gpu_blocks"] == "258" and info["num_gpu_blocks_override"] == "129"
            assert info["block_size"] == "32" and info["prefix_caching_hash_algo"] == "xxhash"
            # Per engine: 129 blocks of 32, max_model_len 1024 = 32 blocks each.
            assert info["kv_cache_max_concurrency"] == str(129 / 32)
            assert info["kv_cache_size_tokens"] == str(int(129 / 32 * 1024))

    serve(scenario, config(dp_size=2, num_blocks=129, block_size=32, max_model_len=1024, hash_algo="xxhash"))


def test_sglang_reports_its_pool_in_tokens() -> None:
    async def scenario(srv: SimServer, http: aiohttp.ClientSession) -> None:
        found = await metric_samples(http)
        pool = [(labels.get("dp_rank"), value) for n, labels, value in found if n == "sglang:max_total_num_tokens"]
        assert sorted(pool, key=lambda p: str(p[0])) == [("0", 4096.0), ("1", 4096.0)]

    options: dict[str, Any] = {"engine": "sglang", "dp_size": 2, "num_blocks": 4096, "bootstrap_port": None}
    serve(scenario, config(**options))
