"""GPU memory to KV tokens and concurrent requests, as vLLM's paged KV pool counts them.

The engine's share of a GPU is `gpu_memory x gpu_util` (vLLM --gpu-memory-utilization, SGLang
--mem-fraction-static); the weights (split over tp x pp GPUs) and a fixed overhead (activations, CUDA graphs,
NCCL buffers) come off it, and the rest is the KV pool:

    usable = G x util - W / (tp x pp) - overhead                         (per GPU)
    blocks = usable // (kv_bytes_per_token_per_gpu x block_size)         (pages of block_size tokens, every layer)

A request of `context` tokens holds ceil(context / block_size) blocks in each full-attention layer, and in a
sliding-window layer at most the window plus the prefill chunk being computed (vLLM's
SlidingWindowSpec.max_memory_usage_bytes: ceil(min(window - 1 + max_num_batched_tokens, context) / block_size)
+ 1 blocks). Requests that fit at once = usable // bytes per request (vLLM's
get_max_concurrency_for_kv_cache_config: the pool's blocks over one request's blocks). Shared prefixes
(prefix caching) only lower what a request holds, so this is the no-sharing floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from cortexbench.capacity.knee import KNEE_FRACTION, recommend
from cortexbench.capacity.kv_size import CapacityError, KVLayout, LayerKV

GIB = 1 << 30
DEFAULT_BLOCK_SIZE = 16
"""vLLM's default --block-size on CUDA (SGLang's page size is 1)."""
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""vLLM's default --max-num-batched-tokens for the OpenAI server on a large GPU: the prefill chunk a
sliding-window layer holds on top of its window."""


def _exact(value: float) -> Fraction:
    # The decimal the user typed, not its binary float: 80 x 0.9 must be 72 GiB to the byte.
    return Fraction(str(value))


def usable_kv_bytes(*, gpu_memory_gib: float, weights_gib: float, gpu_util: float = 0.9, overhead_gib: float = 0.0,
                    tp: int = 1, pp: int = 1) -> int:
    """Bytes of KV pool per GPU; a CapacityError when nothing is left for it."""
    if not (math.isfinite(gpu_memory_gib) and gpu_memory_gib > 0):
        raise CapacityError(f"--gpu-memory-gib must be a positive number, got {gpu_memory_gib}")
    if not (math.isfinite(weights_gib) and weights_gib >= 0):
        raise CapacityError(f"--weights-gib must be zero or more, got {weights_gib}")
    if not (math.isfinite(gpu_util) and 0 < gpu_util <= 1):
        raise CapacityError(f"--gpu-util must be in (0, 1], got {gpu_util}")
    if not (math.isfinite(overhead_gib) and overhead_gib >= 0):
        raise CapacityError(f"--overhead-gib must be zero or more, got {overhead_gib}")
    share = _exact(gpu_memory_gib) * _exact(gpu_util)
    weights = _exact(weights_gib) / (tp * pp)
    usable = share - weights - _exact(overhead_gib)
    if usable <= 0:
        split = f" / {tp * pp} GPUs = {float(weights):.2f} GiB per GPU" if tp * pp > 1 else " GiB"
        raise CapacityError(
            f"no memory left for the KV cache: weights {weights_gib:g}{split}"
            f"{f' + overhead {overhead_gib:g} GiB' if overhead_gib else ''} >= the engine's share of the GPU "
            f"({gpu_memory_gib:g} GiB x gpu-util {gpu_util:g} = {float(share):.2f} GiB); use more tensor "
            "parallelism, a larger GPU, quantized weights or a higher --gpu-util")
    return math.floor(usable * GIB)


def blocks_per_request(layer: LayerKV, context: int, block_size: int, max_num_batched_tokens: int) -> int:
    """Blocks one request of `context` tokens holds in this layer at its peak."""
    if layer.window is None:
        return -(-context // block_size)
    tokens = min(layer.window - 1 + max_num_batched_tokens, context)
    return -(-tokens // block_size) + 1


@dataclass(frozen=True, slots=True)
class Capacity:
    usable_kv_bytes_per_gpu: int
    block_size: int
    kv_blocks_per_gpu: int
    """Blocks of `block_size` tokens across every layer the GPU holds."""
    kv_tokens_per_gpu: int
    """Tokens the pool holds. Full attention: blocks x block_size. With sliding-window layers it depends on the
    context: the tokens of `context_tokens`-long requests at full concurrency (vLLM's "GPU KV cache size")."""
    context_tokens: int
    kv_bytes_per_request: int
    memory_bound_requests: int
    """Requests of `context_tokens` whose KV fits at once."""
    max_concurrent_requests: int
    """memory_bound_requests, capped by the engine's max_num_seqs when given."""
    limited_by: str
    """"kv_memory" or "max_num_seqs"."""
    recommended_max_concurrent: int
    knee_fraction: float


def capacity(layout: KVLayout, usable: int, *, context: int, block_size: int = DEFAULT_BLOCK_SIZE,
             max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs: int | None = None,
             knee_fraction: float = KNEE_FRACTION) -> Capacity:
    """What `usable` bytes of KV pool hold of this model at `context` tokens per request."""
    if context < 1:
        raise CapacityError(f"--max-context must be at least 1 token, got {context}")
    if block_size < 1:
        raise CapacityError(f"--block-size must be at least 1, got {block_size}")
    if max_num_batched_tokens < 1:
        raise CapacityError(f"--max-num-batched-tokens must be at least 1, got {max_num_batched_tokens}")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise CapacityError(f"--max-num-seqs must be at least 1, got {max_num_seqs}")
    block_bytes = layout.kv_bytes_per_token_per_gpu * block_size
    blocks = usable // block_bytes
    per_request = sum(layer.bytes_per_token * block_size
                      * blocks_per_request(layer, context, block_size, max_num_batched_tokens)
                      for layer in layout.layers)
    fits = usable // per_request
    tokens = usable * context // per_request if layout.sliding_layers else blocks * block_size
    limited_by = "kv_memory"
    concurrent = fits
    if max_num_seqs is not None and max_num_seqs < fits:
        concurrent, limited_by = max_num_seqs, "max_num_seqs"
    return Capacity(usable_kv_bytes_per_gpu=usable, block_size=block_size, kv_blocks_per_gpu=blocks,
                    kv_tokens_per_gpu=tokens, context_tokens=context, kv_bytes_per_request=per_request,
                    memory_bound_requests=fits, max_concurrent_requests=concurrent, limited_by=limited_by,
                    recommended_max_concurrent=recommend(concurrent, knee_fraction), knee_fraction=knee_fraction)
