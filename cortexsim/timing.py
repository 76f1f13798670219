"""The simulator's cost model of one engine step (one forward pass), and where each default comes from.

A step that prefills chunks and decodes sequences costs, in milliseconds,

    step_ms                                              fixed: the weights are read once per forward pass
  + prefill_ms_per_token * c                             per prefill chunk of c tokens: the linear layers
  + attention_ms_per_ktoken2 * c * (p + c / 2) / 1e6     its causal attention over the p tokens before it
  + kv_read_ms_per_ktoken * p / 1e3                      and the read of their KV (a cached prefix too)
  + decode_ms_per_seq + kv_read_ms_per_ktoken * ctx / 1e3    per decoding sequence with ctx tokens of KV

so a long prompt costs quadratically (the attention term, summed over its chunks, is ~ n^2 / 2 pairs), and a
decode step grows with the number of running sequences and with their context (each reads all of its KV).
With every coefficient 0 a step costs nothing (the saturation benchmarks' zero-compute workers).

The defaults are derived below from public figures for a dense 8B model in bf16 on one H100 SXM: the reference
shape is Llama-3.1-8B (Qwen2.5-7B, the simulator's default served model name, is the same class; its numbers are
in docs/simulator.md, "Timing model"). Every input names its source; the efficiencies are the judgement calls,
each cross-checked against a published measurement in docs/simulator.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# --- Hardware: NVIDIA H100 SXM5 80 GB datasheet ---------------------------------------------------------------
H100_BF16_DENSE_FLOPS = 989e12
"""989 TFLOPS dense bf16 tensor-core peak (the datasheet's 1,979 is with 2:4 sparsity)."""
H100_HBM_BYTES_PER_S = 3.35e12
"""3.35 TB/s HBM3."""

# --- Model: meta-llama/Llama-3.1-8B config.json ---------------------------------------------------------------
LAYERS = 32
HIDDEN = 4096
"""hidden_size = num_attention_heads (32) x head_dim (128): the width of Q in the attention FLOPs."""
KV_HEADS = 8
HEAD_DIM = 128
PARAMS = 8.03e9
"""All parameters, embeddings and the untied LM head included (the model card's 8.03B)."""
WEIGHT_BYTES = PARAMS * 2
"""bf16: 16.06 GB, read once per forward pass."""
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
"""K and V, 32 layers, 8 KV heads (GQA) of 128, bf16: 131,072 bytes = 128 KiB per token."""
LINEAR_FLOPS_PER_TOKEN = 2 * PARAMS
"""2 FLOPs per parameter per token (one multiply-add): 16.06 GFLOP."""
ATTENTION_FLOPS_PER_PAIR = 4 * LAYERS * HIDDEN
"""Q.K^T and P.V, 2 FLOPs per multiply-add each, per query-key pair and layer: 524,288 FLOP."""

# --- Efficiencies (fractions of the peaks above); sources and cross-checks in docs/simulator.md ----------------
PREFILL_MFU = 0.36
"""Linear layers of a prefill, end to end (GEMMs plus the norms, activations and step overhead around them):
below the 40-60 % a large bf16 GEMM reaches alone, and set so that an 8K-token cold prefill takes ~0.41 s, in
the 0.4-0.7 s range this model is pinned to for 8B models on one H100. The least certain constant: NVIDIA's
NIM (TensorRT-LLM) reaches ~46 % of the FP8 peak on a 70B prefill (docs/simulator.md)."""
ATTENTION_MFU = 0.50
"""Causal prefill attention: FlashAttention-2 reaches 35 % of an H100, FlashAttention-3 up to 75 % (Shah et al.
2024); MInference's LLaMA-3-8B timings on one A100 imply ~49 %."""
HBM_EFFICIENCY = 0.77
"""Share of peak bandwidth a decode step achieves: 77 % measured for Llama-3.1-8B bf16 under vLLM (batch 1)."""
DECODE_SEQ_MFU = 0.70
"""A decoded token's own linear FLOPs, at batch sizes near the ridge point (989 / 3.35 = 295 FLOP/byte) where
they mostly overlap the weight stream; cross-checked against the decode throughput published for this model."""


def _ms(seconds: float) -> float:
    """Milliseconds, to three significant digits (the defaults shown by --help and in the docs)."""
    return float(f"{seconds * 1000:.3g}")


DEFAULT_STEP_MS = _ms(WEIGHT_BYTES / (HBM_EFFICIENCY * H100_HBM_BYTES_PER_S))  # 6.23
DEFAULT_PREFILL_MS_PER_TOKEN = _ms(LINEAR_FLOPS_PER_TOKEN / (PREFILL_MFU * H100_BF16_DENSE_FLOPS))  # 0.0451
DEFAULT_ATTENTION_MS_PER_KTOKEN2 = _ms(1e6 * ATTENTION_FLOPS_PER_PAIR / (ATTENTION_MFU * H100_BF16_DENSE_FLOPS))  # 1.06
DEFAULT_KV_READ_MS_PER_KTOKEN = _ms(1e3 * KV_BYTES_PER_TOKEN / (HBM_EFFICIENCY * H100_HBM_BYTES_PER_S))  # 0.0508
DEFAULT_DECODE_MS_PER_SEQ = _ms(2 * (PARAMS - 2 * 128256 * HIDDEN) / (DECODE_SEQ_MFU * H100_BF16_DENSE_FLOPS))  # 0.0202
"""Non-embedding parameters only: a decode step runs the LM head once per sequence, but its 2 x 0.53 B
parameters' FLOPs are inside the weight read already counted by the step."""
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""vLLM's default step budget for the OpenAI server on a >= 70 GiB GPU such as the H100."""


@dataclass(frozen=True)
class TimingModel:
    """Modelled cost of one engine step; the formula and the defaults' sources are in the module docstring.

    ``decode_ms_per_token`` keeps its historical name (the CLI's ``--decode-ms-per-token``): it is the fixed cost
    of a step, which is the decode interval of a lone sequence.
    """

    prefill_ms_per_token: float = DEFAULT_PREFILL_MS_PER_TOKEN
    decode_ms_per_token: float = DEFAULT_STEP_MS
    decode_ms_per_seq: float = DEFAULT_DECODE_MS_PER_SEQ
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    attention_ms_per_ktoken2: float = DEFAULT_ATTENTION_MS_PER_KTOKEN2
    """Prefill attention, ms per 10^6 query-key pairs (1000 tokens x 1000 tokens of context)."""
    kv_read_ms_per_ktoken: float = DEFAULT_KV_READ_MS_PER_KTOKEN
    """KV read, ms per 1000 tokens of KV a sequence attends to in the step (per decoding sequence, and per
    prefill chunk for the tokens before it)."""

    def step_ms(self, prefills: Iterable[tuple[int, int]] = (), decode_contexts: Iterable[int] = ()) -> float:
        """The step's cost in ms. `prefills`: per prefilling request, (tokens computed in this step, tokens
        already in its KV before them); `decode_contexts`: per decoding request, the tokens of KV it attends to
        (its context, the token computed now included)."""
        ms = self.decode_ms_per_token
        for tokens, start in prefills:
            ms += self.prefill_ms_per_token * tokens
            ms += self.attention_ms_per_ktoken2 * tokens * (start + tokens / 2) / 1e6
            ms += self.kv_read_ms_per_ktoken * start / 1e3
        for context in decode_contexts:
            ms += self.decode_ms_per_seq + self.kv_read_ms_per_ktoken * context / 1e3
        return ms

    def step_seconds(self, prefills: Iterable[tuple[int, int]] = (), decode_contexts: Iterable[int] = ()) -> float:
        return self.step_ms(prefills, decode_contexts) / 1000.0

    def cold_prefill_seconds(self, prompt_tokens: int) -> float:
        """A lone request's prefill with nothing cached and nothing else running: its chunks of at most
        ``max_num_batched_tokens``, one step each (the time to its first token, less HTTP and tokenization)."""
        total, done = 0.0, 0
        while done < prompt_tokens:
            chunk = min(self.max_num_batched_tokens, prompt_tokens - done)
            total += self.step_seconds([(chunk, done)])
            done += chunk
        return total


ZERO_COST_ARGS = ("--prefill-ms-per-token", "0", "--decode-ms-per-token", "0", "--decode-ms-per-seq", "0",
                  "--attention-ms-per-ktoken2", "0", "--kv-read-ms-per-ktoken", "0")
"""`cortex sim` flags under which every step costs 0 (workers that model no compute at all)."""
