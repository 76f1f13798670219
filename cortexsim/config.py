"""``SimConfig``: everything one simulated worker is configured with, validated once, with per-engine defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cortex.engine_hashes import VLLM_HASH_ALGOS, LoraRef
from cortexsim.faults import FaultState
from cortexsim.timing import TimingModel

_TIMING = TimingModel()

DEFAULT_MODEL = "Qwen/Qwen2.5-7B-Instruct"
# Qwen2.5-7B-Instruct's max_position_embeddings; capped further by the KV pool size.
DEFAULT_MAX_MODEL_LEN = 32768
# Both engines' defaults: vLLM's num_gpu_blocks stand-in (x16 tokens) and the same token count for SGLang.
DEFAULT_VLLM_NUM_BLOCKS = 2048
DEFAULT_POOL_TOKENS = 32768
DEFAULT_BOOTSTRAP_PORT = 8998
ENGINES = ("vllm", "sglang")
ROLES = ("both", "prefill", "decode")

Engine = Literal["vllm", "sglang"]
Role = Literal["both", "prefill", "decode"]


@dataclass(frozen=True)
class SimConfig:
    """One simulated worker; ``validate`` checks it, the ``effective_*`` properties resolve engine defaults."""

    engine: str = "vllm"
    host: str = "127.0.0.1"
    port: int = 8000
    """0 asks the OS for a free port; the bound port is reported by ``SimServer.port``."""
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    """Directory holding tokenizer.json (+ tokenizer_config.json); None = the shipped Qwen2.5 tokenizer."""
    worker_id: str | None = None
    """None = ``sim-<bound http port>``."""
    block_size: int | None = None
    """Tokens per KV block / page; None = the engine's default (vLLM 16, SGLang 1 as on CUDA)."""
    num_blocks: int | None = None
    """KV pool size in blocks; None = vLLM 2048 (block 0 being the null block) / SGLang 32768 tokens' worth."""
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    """vLLM NONE_HASH seed string, already resolved (the CLI applies PYTHONHASHSEED); None = as vLLM with
    PYTHONHASHSEED unset: "vllm-none-hash" for sha256/sha256_cbor, a random seed per process for xxhash*."""
    kv_events_port: int | None = 5557
    """None disables events; 0 binds an OS-chosen port. DP rank r publishes on port + r."""
    kv_replay_port: int | None = None
    """None disables replay; 0 binds an OS-chosen port. DP rank r serves replay on port + r."""
    kv_buffer_steps: int = 10_000
    """Batches kept for replay (both engines' ``buffer_steps``): a subscriber that starts later than this many
    batches after the publisher replays only the newest ones."""
    kv_topic: str = ""
    kv_events_format: str = "default"
    """SGLang's kv-events ``format``: "default" or "dynamo" (every namespaced hash rehashed)."""
    # The step cost model (cortexsim/timing.py; defaults: an 8B dense model in bf16 on one H100).
    prefill_ms_per_token: float = _TIMING.prefill_ms_per_token
    decode_ms_per_token: float = _TIMING.decode_ms_per_token
    """Fixed cost of every step (the weight read): the decode interval of a lone sequence."""
    decode_ms_per_seq: float = _TIMING.decode_ms_per_seq
    attention_ms_per_ktoken2: float = _TIMING.attention_ms_per_ktoken2
    """Prefill attention: ms per 10^6 query-key pairs; a chunk of c tokens after p costs c * (p + c/2) pairs."""
    kv_read_ms_per_ktoken: float = _TIMING.kv_read_ms_per_ktoken
    """KV read: ms per 1000 tokens of context, per decoding sequence (and per prefill chunk's prefix) per step."""
    max_num_batched_tokens: int = _TIMING.max_num_batched_tokens
    max_running: int = 256
    max_queued_requests: int | None = None
    """vLLM --max-num-queued-reqs / SGLang --max-queued-requests: beyond it new requests get 503."""
    max_model_len: int | None = None
    """None = min(32768, KV pool tokens)."""
    dp_size: int = 1
    role: str = "both"
    """"both" = no disaggregation. vLLM prefill/decode act as NIXL producer/consumer only; SGLang mirrors
    --disaggregation-mode prefill/decode."""
    bootstrap_port: int | None = DEFAULT_BOOTSTRAP_PORT
    """SGLang --disaggregation-bootstrap-port: served by a prefill, the fallback target of a decode."""
    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0
    decode_radix_cache: bool = False
    """SGLang --disaggregation-decode-enable-radix-cache."""
    kv_lease_seconds: float = 30.0
    kv_load_failure_policy: str = "recompute"
    lora_modules: tuple[LoraRef, ...] = ()
    faults: FaultState = field(default_factory=FaultState)
    fault_seed: int | None = None
    ssl_certfile: str | None = None
    """Serve HTTPS with this PEM certificate (vLLM/SGLang `--ssl-certfile`); None: plain HTTP."""
    ssl_keyfile: str | None = None
    """Its PEM private key (`--ssl-keyfile`)."""
    ssl_ca_certs: str | None = None
    """CA bundle client certificates are checked against (`--ssl-ca-certs`)."""
    ssl_cert_reqs: int = 0
    """uvicorn's `--ssl-cert-reqs`, as the engines pass it: 0 no client certificate, 1 optional, 2 required."""

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {ENGINES}, got {self.engine!r}")
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {self.role!r}")
        if self.hash_algo not in VLLM_HASH_ALGOS:
            raise ValueError(f"hash_algo: expected one of {VLLM_HASH_ALGOS}, got {self.hash_algo!r}")
        if self.kv_events_format not in ("default", "dynamo"):
            raise ValueError(f"kv_events_format: expected default or dynamo, got {self.kv_events_format!r}")
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError(f"kv_load_failure_policy: expected fail or recompute, "
                             f"got {self.kv_load_failure_policy!r}")
        for name in ("max_running", "dp_size", "max_num_batched_tokens", "kv_buffer_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size: must be at least 1, got {self.block_size}")
        minimum = 2 if self.engine == "vllm" else 1
        if self.num_blocks is not None and self.num_blocks < minimum:
            raise ValueError(f"num_blocks: must be at least {minimum}"
                             f"{' (one is vLLM null block)' if minimum == 2 else ''}, got {self.num_blocks}")
        for name in ("prefill_ms_per_token", "decode_ms_per_token", "decode_ms_per_seq", "attention_ms_per_ktoken2",
                     "kv_read_ms_per_ktoken", "bootstrap_timeout", "waiting_timeout", "kv_lease_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must not be negative, got {getattr(self, name)}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests: must not be negative, got {self.max_queued_requests}")
        for name in ("port", "kv_events_port", "kv_replay_port", "bootstrap_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name}: not a TCP port: {value}")
        for name in ("kv_events_port", "kv_replay_port"):
            value = getattr(self, name)
            if value and value + self.dp_size - 1 > 65535:
                raise ValueError(f"{name}: {value} + dp ranks runs past port 65535")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together")
        if self.ssl_cert_reqs not in (0, 1, 2) or (self.ssl_cert_reqs and not self.ssl_ca_certs):
            raise ValueError("ssl_cert_reqs: 0, 1 or 2, and 1 or 2 need ssl_ca_certs")
        names = [lora.name for lora in self.lora_modules]
        if len(set(names)) != len(names) or self.model in names:
            raise ValueError("lora modules: adapter names must be unique and differ from the model name")
        pool_tokens = self.pool_tokens
        if self.max_model_len is not None and not 1 <= self.max_model_len <= pool_tokens:
            # vLLM refuses to start when one max-length request cannot fit in the KV cache.
            raise ValueError(f"max_model_len: {self.max_model_len} does not fit the KV pool "
                             f"({pool_tokens} tokens)")

    @property
    def timing(self) -> TimingModel:
        return TimingModel(prefill_ms_per_token=self.prefill_ms_per_token,
                           decode_ms_per_token=self.decode_ms_per_token, decode_ms_per_seq=self.decode_ms_per_seq,
                           max_num_batched_tokens=self.max_num_batched_tokens,
                           attention_ms_per_ktoken2=self.attention_ms_per_ktoken2,
                           kv_read_ms_per_ktoken=self.kv_read_ms_per_ktoken)

    @property
    def page_size(self) -> int:
        if self.block_size is not None:
            return self.block_size
        return 16 if self.engine == "vllm" else 1

    @property
    def effective_num_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        if self.engine == "vllm":
            return DEFAULT_VLLM_NUM_BLOCKS
        return max(DEFAULT_POOL_TOKENS // self.page_size, 1)

    @property
    def pool_tokens(self) -> int:
        usable = self.effective_num_blocks - (1 if self.engine == "vllm" else 0)
        return usable * self.page_size

    @property
    def effective_max_model_len(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        return min(DEFAULT_MAX_MODEL_LEN, self.pool_tokens)
