"""KV-cache bytes per token of a model, from its Hugging Face config.json, as vLLM and SGLang size their pools.

Per layer and token one GPU stores K and V for each KV head it holds:

    2 x kv_heads_per_gpu x head_dim x dtype_bytes            (vLLM AttentionSpec.real_page_size_bytes / block_size,
                                                               SGLang ModelRunner cell_size / num_layers)

and an MLA model (DeepSeek V2/V3, Kimi K2) one compressed latent, the same on every tensor-parallel rank:

    (kv_lora_rank + qk_rope_head_dim) x dtype_bytes          (vLLM MLAAttentionSpec, SGLang's MLA cell_size)

KV heads are split over tensor-parallel ranks and replicated when there are fewer heads than ranks
(`max(1, kv_heads // tp)`, vLLM's and SGLang's `get_num_kv_heads`). Pipeline parallelism splits the layers;
the stage holding the most (full-attention) layers is the one that fills first.

Sliding-window layers are kept as such (`LayerKV.window`): how many of their tokens stay resident is the
budget's business (budget.py). What cannot be sized per token is refused with a `CapacityError` naming it:
state-space and linear-attention hybrids, chunked local attention, DeepSeek V3.2's sparse-attention indexer,
encoder-decoder models.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


class CapacityError(ValueError):
    """Input the calculator cannot use; the message says what, and where, for the person who ran it."""


LayerKind = Literal["full", "sliding"]

KV_DTYPES = ("auto", "fp16", "bf16", "fp8")
"""--kv-dtype choices; "auto" is the model's own dtype, as both engines' default --kv-cache-dtype auto."""

_DTYPE_BYTES = {"float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2, "float32": 4, "fp32": 4,
                "float": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}

# Where multimodal and wrapper configs keep their language model (Llava/Gemma 3/Qwen-VL, InternVL, DeepSeek-VL2).
_NESTED = ("text_config", "llm_config", "language_config")

# Layers whose cache is a per-request state rather than per-token KV (Mamba/SSM, linear attention): a per-token
# figure would be wrong for them, so the whole model is refused.
_STATE_KEYS = ("layers_block_type", "hybrid_override_pattern", "attn_layer_period", "attn_layer_offset", "ssm_cfg",
               "mamba_d_state", "mamba_expand", "linear_num_key_heads", "linear_key_head_dim")

_LAYER_TYPES: dict[str, LayerKind] = {"full_attention": "full", "sliding_attention": "sliding"}

# Gemma 3's default when a config leaves it out (transformers' Gemma3TextConfig): every 6th layer is global.
_GEMMA3_PATTERN = 6


@dataclass(frozen=True, slots=True)
class LayerKV:
    kind: LayerKind
    bytes_per_token: int
    """This layer's KV per token on one GPU."""
    window: int | None = None
    """Tokens a sliding-window layer attends to; None for full attention."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one model stores per token, on the whole and on one GPU."""

    model: str
    attention: str
    """"mha", "gqa", "mqa" or "mla"."""
    num_layers: int
    kv_heads: int
    """The model's KV heads (1 for MLA: one latent per layer)."""
    head_dim: int
    """Per KV head; for MLA the latent's width, kv_lora_rank + qk_rope_head_dim."""
    kv_factor: int
    """2 (a K and a V per head) or 1 (MLA's joint latent)."""
    kv_dtype: str
    dtype_bytes: int
    tp: int
    pp: int
    kv_heads_per_gpu: int
    layers: tuple[LayerKV, ...]
    """The layers one GPU holds: with pipeline parallelism, the stage that fills first."""
    max_position_embeddings: int | None
    config_section: str | None = None
    """The nested section the language model was read from (e.g. "text_config"), None for the top level."""
    notes: tuple[str, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """The model's KV per token on a single device: every layer, every KV head (seed 004 §4.4's formula)."""
        return self.kv_factor * self.num_layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        """What one GPU stores per token across its layers (sliding layers counted in full)."""
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def sliding_window(self) -> int | None:
        windows = {layer.window for layer in self.layers if layer.window is not None}
        return max(windows) if windows else None

    @property
    def full_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == "full")

    @property
    def sliding_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == "sliding")


def read_config(path: str | Path) -> dict[str, Any]:
    """A config.json (or a model directory holding one) as a dict; a CapacityError says why not."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CapacityError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CapacityError(f"{p}: cannot read it: {exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CapacityError(f"{p}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(doc, dict):
        raise CapacityError(f"{p}: expected a JSON object (a Hugging Face config.json)")
    return doc


def language_model(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The section describing the language model, and its key; a multimodal config's text_config (or its
    kin) when it carries the layers. The top level's dtype applies when the section names none."""
    for key in _NESTED:
        sub = cfg.get(key)
        if isinstance(sub, dict) and ("num_hidden_layers" in sub or "num_attention_heads" in sub):
            inherited = {k: cfg[k] for k in ("torch_dtype", "dtype", "max_position_embeddings") if k in cfg}
            return {**inherited, **sub}, key
    return dict(cfg), None


def kv_layout(cfg: Mapping[str, Any], *, kv_dtype: str = "auto", tp: int = 1, pp: int = 1,
              sliding_as_full: bool = False) -> KVLayout:
    """The model's KV layout on one GPU of a `tp` x `pp` replica. `sliding_as_full` counts sliding-window layers
    as full attention, as vLLM does with --disable-hybrid-kv-cache-manager."""
    if tp < 1 or pp < 1:
        raise CapacityError(f"--tp and --pp must be at least 1, got tp={tp} pp={pp}")
    if cfg.get("is_encoder_decoder") is True:
        raise CapacityError("encoder-decoder models (is_encoder_decoder: true) are not supported: their "
                            "cross-attention cache depends on the encoder input, not on tokens generated")
    text, section = language_model(cfg)
    where = f"config.json{f' {section}' if section else ''}"
    model = _model_name(cfg, text)
    _refuse_unsupported(text, where)
    notes: list[str] = []
    num_layers = _int(text, "num_hidden_layers", where)
    if pp > num_layers:
        raise CapacityError(f"--pp {pp} is more pipeline stages than the model's {num_layers} layers")
    name, dtype_bytes = _kv_dtype(kv_dtype, text, where, notes)
    kinds, window = _layer_kinds(text, num_layers, where, str(text.get("model_type") or ""))
    if sliding_as_full and window is not None:
        notes.append(f"sliding-window layers counted as full attention (window {window} ignored)")
        kinds, window = ["full"] * num_layers, None

    kv_lora_rank = text.get("kv_lora_rank")
    if kv_lora_rank is not None:
        if window is not None:
            raise CapacityError(f"{where}: MLA (kv_lora_rank) with sliding-window layers is not supported")
        latent = _int(text, "kv_lora_rank", where) + _int(text, "qk_rope_head_dim", where)
        attention, kv_heads, head_dim, kv_factor, per_gpu = "mla", 1, latent, 1, 1
        if tp > 1:
            notes.append("MLA: the latent is not split by tensor parallelism; every rank stores all of it")
    else:
        heads = _int(text, "num_attention_heads", where)
        kv_heads = _int(text, "num_key_value_heads", where) if text.get("num_key_value_heads") is not None else heads
        if text.get("head_dim") is not None:
            head_dim = _int(text, "head_dim", where)
        else:
            hidden = _int(text, "hidden_size", where)
            if hidden % heads:
                raise CapacityError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads "
                                    f"{heads} and there is no head_dim")
            head_dim = hidden // heads
        attention = "mha" if kv_heads == heads else "mqa" if kv_heads == 1 else "gqa"
        kv_factor = 2
        per_gpu = _kv_heads_per_gpu(heads, kv_heads, tp)
        if kv_heads < tp:
            notes.append(f"{kv_heads} KV heads on {tp} tensor-parallel ranks: each rank keeps a replica of one")

    per_layer = kv_factor * per_gpu * head_dim * dtype_bytes
    stage = _widest_stage(kinds, pp)
    layers = tuple(LayerKV(kinds[i], per_layer, window if kinds[i] == "sliding" else None) for i in stage)
    max_pos = text.get("max_position_embeddings")
    return KVLayout(model=model, attention=attention, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                    kv_factor=kv_factor, kv_dtype=name, dtype_bytes=dtype_bytes, tp=tp, pp=pp,
                    kv_heads_per_gpu=per_gpu, layers=layers,
                    max_position_embeddings=max_pos if isinstance(max_pos, int) and max_pos > 0 else None,
                    config_section=section, notes=tuple(notes))


def _model_name(cfg: Mapping[str, Any], text: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return str(text.get("model_type") or cfg.get("model_type") or "unknown")


def _refuse_unsupported(text: Mapping[str, Any], where: str) -> None:
    model_type = str(text.get("model_type") or "")
    state = [k for k in _STATE_KEYS if text.get(k) is not None]
    if state or any(s in model_type for s in ("mamba", "rwkv", "jamba")):
        raise CapacityError(f"{where}: state-space / linear-attention hybrid layers ({', '.join(state) or model_type})"
                            " are not supported: their cache is a per-request state, not KV bytes per token")
    if text.get("index_topk") is not None:
        raise CapacityError(f"{where}: DeepSeek V3.2-style sparse attention (index_topk) is not supported: its "
                            "indexer keeps a second cache the per-token MLA formula leaves out")
    if text.get("attention_chunk_size") is not None:
        raise CapacityError(f"{where}: chunked local attention (attention_chunk_size, Llama 4 style) is not supported")
    if text.get("cross_attention_layers"):
        raise CapacityError(f"{where}: cross-attention layers (cross_attention_layers) are not supported")


def _int(cfg: Mapping[str, Any], key: str, where: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise CapacityError(f"{where} has no {key!r}; the KV size needs it")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CapacityError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _kv_dtype(kv_dtype: str, text: Mapping[str, Any], where: str, notes: list[str]) -> tuple[str, int]:
    if kv_dtype != "auto":
        if kv_dtype not in _DTYPE_BYTES:
            raise CapacityError(f"--kv-dtype: expected one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        return kv_dtype, _DTYPE_BYTES[kv_dtype]
    raw = text.get("torch_dtype") if text.get("torch_dtype") is not None else text.get("dtype")
    if raw is None:
        raise CapacityError(f"{where} names no torch_dtype or dtype: pass --kv-dtype")
    name = str(raw).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise CapacityError(f"{where}: unknown dtype {raw!r}: pass --kv-dtype")
    if text.get("quantization_config") is not None:
        notes.append("quantized weights (quantization_config) leave the KV cache in 16 bits unless the engine "
                     "runs with --kv-cache-dtype fp8 (here: --kv-dtype fp8)")
    if _DTYPE_BYTES[name] != 2:
        # Both engines' --dtype auto serve float32 (and fp8-stored) checkpoints in 16 bits; the KV follows.
        notes.append(f"{name} checkpoint: the engines serve it, and its KV cache, in 16 bits by default")
        return "bf16", 2
    return ("bf16" if name in ("bfloat16", "bf16") else "fp16"), _DTYPE_BYTES[name]


def _layer_kinds(text: Mapping[str, Any], n: int, where: str, model_type: str) -> tuple[list[LayerKind], int | None]:
    """Each layer's attention kind and the sliding window, following transformers' conventions: an explicit
    layer_types list; Qwen's use_sliding_window + max_window_layers (layers from max_window_layers on slide);
    Gemma 2 (even layers slide); Gemma 3 (every sliding_window_pattern-th layer is global); otherwise a
    sliding_window applies to every layer (Mistral, Phi-3)."""
    layer_types = text.get("layer_types")
    raw_window = text.get("sliding_window")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != n:
            raise CapacityError(f"{where}: layer_types must list one type per layer ({n}), got "
                                f"{len(layer_types) if isinstance(layer_types, list) else type(layer_types).__name__}")
        unknown = sorted({str(t) for t in layer_types if t not in _LAYER_TYPES})
        if unknown:
            raise CapacityError(f"{where}: layer types {', '.join(unknown)} are not supported (only full_attention "
                                "and sliding_attention layers can be sized per token)")
        listed = [_LAYER_TYPES[t] for t in layer_types]
        return listed, (_int(text, "sliding_window", where) if "sliding" in listed else None)
    if raw_window is None or text.get("use_sliding_window") is False or (
            "use_sliding_window" not in text and model_type.startswith("qwen")):
        return ["full"] * n, None
    window = _int(text, "sliding_window", where)
    if "use_sliding_window" in text and text.get("max_window_layers") is not None:
        first = text["max_window_layers"]
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise CapacityError(f"{where}: max_window_layers must be a non-negative integer, got {first!r}")
        kinds: list[LayerKind] = ["sliding" if i >= first else "full" for i in range(n)]
    elif model_type == "gemma2":
        kinds = ["sliding" if i % 2 == 0 else "full" for i in range(n)]
    elif model_type.startswith("gemma3") or "sliding_window_pattern" in text:
        pattern = text.get("sliding_window_pattern", _GEMMA3_PATTERN)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise CapacityError(f"{where}: sliding_window_pattern must be a positive integer, got {pattern!r}")
        kinds = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(n)]
    else:
        kinds = ["sliding"] * n
    return kinds, (window if "sliding" in kinds else None)


def _kv_heads_per_gpu(heads: int, kv_heads: int, tp: int) -> int:
    """KV heads one rank holds; the divisibility both engines require at start-up."""
    if heads % tp:
        raise CapacityError(f"num_attention_heads {heads} is not divisible by --tp {tp}; vLLM and SGLang refuse "
                            "to start like this")
    if kv_heads >= tp:
        if kv_heads % tp:
            raise CapacityError(f"num_key_value_heads {kv_heads} is not divisible by --tp {tp}")
        return kv_heads // tp
    if tp % kv_heads:
        raise CapacityError(f"--tp {tp} is not a multiple of num_key_value_heads {kv_heads}, so the heads "
                            "cannot be replicated evenly")
    return 1


def stage_layers(n: int, pp: int) -> list[range]:
    """vLLM's pipeline split (get_pp_indices): n // pp layers per stage, the remainder one each to the stages
    before the last, counting backwards."""
    sizes = [n // pp] * pp
    for i in range(2, n % pp + 2):
        sizes[-i] += 1
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def _widest_stage(kinds: list[LayerKind], pp: int) -> range:
    """The stage that fills first: most full-attention layers, then most layers (every layer stores the same
    bytes per token, a full one for more tokens)."""
    return max(stage_layers(len(kinds), pp),
               key=lambda r: (sum(1 for i in r if kinds[i] == "full"), len(r)))
