"""A LoRA adapter made at test time, in the PEFT layout vLLM loads (`--lora-modules NAME=DIR`): an
`adapter_config.json` and an `adapter_model.safetensors` of random weights for the attention projections of a
model config from tests/real_engine/models.py. Its output is as meaningless as the base model's; what matters is
that the engine serves it as an adapter, so its blocks carry the adapter in their hashes and events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

RANK = 8
TARGETS = ("q_proj", "v_proj")


def write_adapter(path: Path, config: dict[str, Any], rank: int = RANK, seed: int = 0) -> Path:
    """`path` holding a rank-`rank` adapter of q_proj and v_proj on every layer of the model `config`."""
    path.mkdir(parents=True, exist_ok=True)
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    out = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGETS:
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, hidden)) * 0.01).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out[module], rank)) * 0.01).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(TARGETS), "fan_in_fan_out": False, "modules_to_save": None,
        "use_rslora": False, "use_dora": False,
    }, indent=2))
    return path
