"""`cortex capacity`: KV bytes per token from real model configs, the memory budget, the knee rule, the CLI.

Every expected number is worked out by hand in the comment next to it, from the formulas vLLM and SGLang
use (docs/capacity.md): 2 x kv_heads_per_gpu x head_dim x dtype_bytes per layer and token, MLA
(kv_lora_rank + qk_rope_head_dim) x dtype_bytes, pages of 16 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cortexbench.capacity.budget import GIB, blocks_per_request, capacity, usable_kv_bytes
from cortexbench.capacity.cli import main as capacity_main
from cortexbench.capacity.knee import Knee, KneeRule, Step, find_knee, recommend
from cortexbench.capacity.kv_size import CapacityError, LayerKV, kv_layout, read_config, stage_layers
from cortexbench.capacity.probe import ProbeSettings, Prompts, base_url, ladder, load_prompts, percentile
from cortexctl.cli import main as cortex_main

MODELS = Path(__file__).parent / "fixtures" / "models"


def model(name: str) -> dict[str, Any]:
    return read_config(MODELS / name)


# --- KV bytes per token -------------------------------------------------------------------------------------------

def test_seed_004_example() -> None:
    # Seed 004 §4.4: 32 layers, 8 KV heads of 128, fp16: 2 x 32 x 8 x 128 x 2 = 131072 B = 128 KiB per token;
    # 80 GiB - 14 GiB weights - 6 GiB overhead = 60 GiB -> 60 requests of 8K (1 GiB each); 80 % of them: 48.
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "torch_dtype": "float16", "max_position_embeddings": 8192}
    layout = kv_layout(cfg)
    assert layout.kv_bytes_per_token == 131072 and layout.attention == "gqa" and layout.kv_dtype == "fp16"
    usable = usable_kv_bytes(gpu_memory_gib=80, weights_gib=14, gpu_util=1.0, overhead_gib=6)
    assert usable == 60 * GIB
    cap = capacity(layout, usable, context=8192)
    assert cap.kv_tokens_per_gpu == 60 * GIB // 131072 == 491520
    assert cap.kv_bytes_per_request == GIB
    assert (cap.max_concurrent_requests, cap.recommended_max_concurrent) == (60, 48)


def test_qwen2_5_7b_instruct() -> None:
    layout = kv_layout(model("qwen2.5-7b-instruct"))
    # 28 layers, 4 KV heads, head_dim 3584 / 28 = 128, bf16: 2 x 28 x 4 x 128 x 2 = 57344. Its config carries
    # sliding_window 131072 with use_sliding_window false: every layer is full attention.
    assert layout.kv_bytes_per_token == layout.kv_bytes_per_token_per_gpu == 57344
    assert (layout.head_dim, layout.kv_dtype, layout.full_layers, layout.sliding_layers) == (128, "bf16", 28, 0)
    assert layout.max_position_embeddings == 32768
    # 80 GiB x 0.9 - 15 GiB = 57 GiB = 61203283968 B; a 16-token block is 57344 x 16 = 917504 B:
    # 61203283968 // 917504 = 66706 blocks = 1067296 tokens; 32768 tokens = 2048 blocks: 66706 // 2048 = 32.
    usable = usable_kv_bytes(gpu_memory_gib=80, weights_gib=15)
    assert usable == 61203283968
    cap = capacity(layout, usable, context=32768)
    assert (cap.kv_blocks_per_gpu, cap.kv_tokens_per_gpu) == (66706, 1067296)
    assert (cap.max_concurrent_requests, cap.recommended_max_concurrent) == (32, 25)  # 0.8 x 32 = 25.6


def test_tensor_and_pipeline_parallel_split_kv_heads_and_layers() -> None:
    qwen = model("qwen2.5-7b-instruct")
    assert kv_layout(qwen, tp=4).kv_bytes_per_token_per_gpu == 14336  # 1 KV head per rank: 2 x 28 x 1 x 128 x 2
    assert kv_layout(qwen, tp=4).kv_bytes_per_token == 57344  # the model's figure does not change
    with pytest.raises(CapacityError, match="num_attention_heads 28 is not divisible by --tp 8"):
        kv_layout(qwen, tp=8)
    with pytest.raises(CapacityError, match="--tp 7 is not a multiple of num_key_value_heads 4"):
        kv_layout(qwen, tp=7)
    # 28 layers over 3 stages, vLLM's split: 9, 10, 9 (the extra layer goes to the stage before the last).
    assert [len(r) for r in stage_layers(28, 3)] == [9, 10, 9]
    assert kv_layout(qwen, pp=3).kv_bytes_per_token_per_gpu == 2 * 10 * 4 * 128 * 2 == 20480
    # Llama 3.2 1B: 32 heads, 8 KV heads; tp 16 replicates each KV head on two ranks: 2 x 16 x 1 x 64 x 2 = 4096.
    llama16 = kv_layout(model("llama-3.2-1b-instruct"), tp=16)
    assert (llama16.kv_heads_per_gpu, llama16.kv_bytes_per_token_per_gpu) == (1, 4096)
    assert any("replica" in n for n in llama16.notes)
    # Weights are split too: 80 x 0.9 - 15 / 4 = 68.25 GiB per GPU.
    assert usable_kv_bytes(gpu_memory_gib=80, weights_gib=15, tp=4) == 68 * GIB + GIB // 4


def test_llama_3_2_1b_instruct() -> None:
    layout = kv_layout(model("llama-3.2-1b-instruct"))
    # 16 layers, 8 KV heads, head_dim 64 (given), bf16: 2 x 16 x 8 x 64 x 2 = 32768.
    assert layout.kv_bytes_per_token == 32768 and layout.max_position_embeddings == 131072
    # 24 GiB x 0.9 - 2.3 = 19.3 GiB = floor(19.3 x 2^30) = 20723217203 B; blocks of 524288 B: 39526 (632416 tokens).
    usable = usable_kv_bytes(gpu_memory_gib=24, weights_gib=2.3)
    assert usable == 20723217203
    full = capacity(layout, usable, context=131072)  # 8192 blocks a request: 39526 // 8192 = 4
    assert (full.kv_tokens_per_gpu, full.max_concurrent_requests, full.recommended_max_concurrent) == (632416, 4, 3)
    short = capacity(layout, usable, context=8192)  # 512 blocks: 39526 // 512 = 77; 0.8 x 77 = 61.6
    assert (short.max_concurrent_requests, short.recommended_max_concurrent) == (77, 61)
    capped = capacity(layout, usable, context=8192, max_num_seqs=64)
    assert (capped.max_concurrent_requests, capped.recommended_max_concurrent) == (64, 51)
    assert capped.limited_by == "max_num_seqs"


def test_mla_deepseek_v3() -> None:
    layout = kv_layout(model("deepseek-v3-mla"))
    # One latent per layer: (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B = 1152 B; x 61 layers = 70272 (SGLang's
    # MLA cell_size, vLLM's MLAAttentionSpec with num_kv_heads 1, head_size 576). Not 2 x 128 heads x ...
    assert (layout.attention, layout.kv_factor, layout.head_dim, layout.kv_heads) == ("mla", 1, 576, 1)
    assert layout.kv_bytes_per_token == 70272 and layout.kv_dtype == "bf16"
    assert any("quantized weights" in n for n in layout.notes)  # fp8 weights, bf16 KV
    assert kv_layout(model("deepseek-v3-mla"), kv_dtype="fp8").kv_bytes_per_token == 576 * 61 == 35136
    # Tensor parallel does not split the latent: every rank of 8 stores all of it.
    tp8 = kv_layout(model("deepseek-v3-mla"), tp=8)
    assert tp8.kv_bytes_per_token_per_gpu == 70272
    # 141 GiB x 0.9 - 642 / 8 = 126.9 - 80.25 = 46.65 GiB = floor(4665 x 2^30 / 100) = 50090056089 B;
    # 16-token blocks of 1124352 B: 44550 (712800 tokens); 32768 tokens = 2048 blocks: 21; 0.8 x 21 = 16.8.
    usable = usable_kv_bytes(gpu_memory_gib=141, weights_gib=642, tp=8)
    assert usable == 50090056089
    cap = capacity(tp8, usable, context=32768)
    assert (cap.kv_blocks_per_gpu, cap.kv_tokens_per_gpu) == (44550, 712800)
    assert (cap.max_concurrent_requests, cap.recommended_max_concurrent) == (21, 16)


def test_sliding_window_hybrid_from_nested_text_config() -> None:
    layout = kv_layout(model("gemma3-sliding-mini"))
    # The language model is under text_config; 12 layers (10 sliding of window 1024, 2 full), 4 KV heads of 256,
    # bf16 from the top level: 2 x 4 x 256 x 2 = 4096 B per layer and token, 49152 for all 12.
    assert layout.config_section == "text_config"
    assert (layout.full_layers, layout.sliding_layers, layout.sliding_window) == (2, 10, 1024)
    assert layout.kv_bytes_per_token == 49152
    # A 32768-token request, pages of 16, prefill chunk 8192: a full layer holds 2048 blocks; a sliding one
    # ceil(min(1023 + 8192, 32768) / 16) + 1 = 576 + 1 = 577 (vLLM SlidingWindowSpec.max_memory_usage_bytes).
    # Per request: 4096 x 16 x (2 x 2048 + 10 x 577) = 65536 x 9866 = 646578176 B. 10 GiB holds 16 of them and
    # 10 x 2^30 x 32768 // 646578176 = 544162 tokens of such requests.
    cap = capacity(layout, 10 * GIB, context=32768)
    assert cap.kv_bytes_per_request == 646578176
    assert (cap.max_concurrent_requests, cap.kv_tokens_per_gpu) == (16, 544162)
    # Shorter than the window: min(9215, 512) = 512 -> 32 + 1 blocks; full: 32. 65536 x (2 x 32 + 10 x 33).
    assert capacity(layout, 10 * GIB, context=512).kv_bytes_per_request == 65536 * 394
    # Counted as full attention (vLLM --disable-hybrid-kv-cache-manager): 49152 x 32768 B a request -> 6.
    flat = kv_layout(model("gemma3-sliding-mini"), sliding_as_full=True)
    assert flat.sliding_layers == 0 and any("counted as full" in n for n in flat.notes)
    assert capacity(flat, 10 * GIB, context=32768).max_concurrent_requests == 10 * GIB // (49152 * 32768) == 6


def test_sliding_window_on_every_layer_mistral() -> None:
    layout = kv_layout(model("mistral-7b-v0.1"))
    # Mistral 7B v0.1: sliding_window 4096 on all 32 layers; 2 x 8 x 128 x 2 = 4096 B per layer and token.
    assert (layout.sliding_layers, layout.sliding_window, layout.kv_bytes_per_token) == (32, 4096, 131072)
    # ceil(min(4095 + 8192, 32768) / 16) + 1 = 768 + 1 = 769 blocks per layer: 4096 x 16 x 32 x 769 B.
    assert capacity(layout, 10 * GIB, context=32768).kv_bytes_per_request == 4096 * 16 * 32 * 769 == 1612709888
    assert blocks_per_request(LayerKV("sliding", 4096, 4096), 100, 16, 8192) == 7 + 1
    assert blocks_per_request(LayerKV("full", 4096), 100, 16, 8192) == 7


@pytest.mark.parametrize(("extra", "kinds"), [
    # Qwen: layers from max_window_layers on slide (transformers' Qwen2Config.layer_types).
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 4},
     "FFFFSS"),
    ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 4}, "FFFFFF"),
    ({"model_type": "qwen2", "sliding_window": 4096}, "FFFFFF"),  # Qwen2Config's use_sliding_window defaults off
    ({"model_type": "gemma2", "sliding_window": 4096}, "SFSFSF"),  # Gemma 2: even layers slide
    ({"model_type": "gemma3_text", "sliding_window": 1024}, "SSSSSF"),  # Gemma 3: every 6th is global
    ({"model_type": "gemma3_text", "sliding_window": 1024, "sliding_window_pattern": 2}, "SFSFSF"),
    ({"model_type": "mistral", "sliding_window": 4096}, "SSSSSS"),
    ({"model_type": "mistral", "sliding_window": None}, "FFFFFF"),
    ({"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 3}, "SFSFSF"),  # gpt-oss
])
def test_layer_kind_conventions(extra: dict[str, Any], kinds: str) -> None:
    cfg = {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
           "torch_dtype": "bfloat16", **extra}
    layout = kv_layout(cfg)
    assert "".join("S" if layer.kind == "sliding" else "F" for layer in layout.layers) == kinds


@pytest.mark.parametrize(("extra", "message"), [
    ({"layer_types": ["full_attention", "linear_attention"] * 2}, "linear_attention are not supported"),
    ({"layers_block_type": ["mamba", "attention"] * 2}, "state-space / linear-attention"),
    ({"model_type": "falcon_mamba"}, "state-space / linear-attention"),
    ({"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk": 2048}, "index_topk"),
    ({"attention_chunk_size": 8192}, "chunked local attention"),
    ({"is_encoder_decoder": True}, "encoder-decoder"),
    ({"kv_lora_rank": 512}, "no 'qk_rope_head_dim'"),
    ({"layer_types": ["full_attention"]}, "one type per layer"),
    ({"num_hidden_layers": None}, "no 'num_hidden_layers'"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
    ({"torch_dtype": None}, "pass --kv-dtype"),
    ({"torch_dtype": "int4"}, "unknown dtype"),
])
def test_unsupported_or_broken_configs_are_refused_clearly(extra: dict[str, Any], message: str) -> None:
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
           "torch_dtype": "bfloat16", **extra}
    with pytest.raises(CapacityError, match=message):
        kv_layout(cfg)


def test_kv_dtype_override_and_float32_checkpoint() -> None:
    qwen = model("qwen2.5-7b-instruct")
    assert kv_layout(qwen, kv_dtype="fp8").kv_bytes_per_token == 28672
    assert kv_layout(qwen, kv_dtype="fp16").kv_bytes_per_token == 57344
    fp32 = kv_layout({**qwen, "torch_dtype": "float32"})  # served in 16 bits by --dtype auto
    assert fp32.dtype_bytes == 2 and any("float32" in n for n in fp32.notes)
    assert kv_layout({k: v for k, v in qwen.items() if k != "torch_dtype"} | {"dtype": "bfloat16"}).dtype_bytes == 2


def test_read_config_errors(tmp_path: Path) -> None:
    with pytest.raises(CapacityError, match="no such file"):
        read_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CapacityError, match="not JSON"):
        read_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(CapacityError, match="expected a JSON object"):
        read_config(tmp_path / "list.json")
    assert read_config(MODELS / "qwen2.5-7b-instruct")["num_hidden_layers"] == 28  # a directory works


def test_budget_errors() -> None:
    with pytest.raises(CapacityError, match=r"no memory left for the KV cache: weights 20 GiB >= .*16 GiB x "
                                            r"gpu-util 0.9 = 14.40 GiB"):
        usable_kv_bytes(gpu_memory_gib=16, weights_gib=20)
    with pytest.raises(CapacityError, match="no memory left"):
        usable_kv_bytes(gpu_memory_gib=80, weights_gib=60, overhead_gib=12)
    with pytest.raises(CapacityError, match="--gpu-util must be in"):
        usable_kv_bytes(gpu_memory_gib=80, weights_gib=10, gpu_util=1.5)
    with pytest.raises(CapacityError, match="--gpu-memory-gib"):
        usable_kv_bytes(gpu_memory_gib=float("nan"), weights_gib=10)


# --- the 80 % rule and the knee -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("knee", "fraction", "expected"), [
    (60, 0.8, 48), (33, 0.8, 26), (10, 0.8, 8), (5, 0.8, 4), (4, 0.8, 3), (1, 0.8, 1), (0, 0.8, 0), (10, 0.7, 7),
    (15, 0.8, 12), (10, 1.0, 10),
])
def test_recommend(knee: int, fraction: float, expected: int) -> None:
    assert recommend(knee, fraction) == expected


def step(c: int, tput: float, p90: float = 0.05, errors: int = 0, completed: int = 10) -> Step:
    return Step(concurrency=c, completed=completed, errors=errors, ttft_p50_s=p90 / 2, ttft_p90_s=p90,
                output_tokens_per_s=tput)


def test_knee_where_throughput_stops_growing() -> None:
    # 4 -> 8 doubles concurrency for (420 / 390 - 1) = 8 % more throughput: below 20 % of linear. Knee 4.
    knee = find_knee([step(1, 100), step(2, 200), step(4, 390), step(8, 420)])
    assert (knee.concurrency, knee.found, knee.recommended_max_concurrent) == (4, True, 3)
    assert "at concurrency 8" in knee.reason and "throughput" in knee.reason


def test_knee_where_ttft_jumps() -> None:
    # Throughput still grows 79 % of linear at 8, but TTFT p90 goes 50 -> 300 ms (6x, +250 ms).
    knee = find_knee([step(1, 100), step(2, 200), step(4, 390), step(8, 700, p90=0.3)])
    assert (knee.concurrency, knee.recommended_max_concurrent) == (4, 3) and "TTFT p90 50 -> 300 ms" in knee.reason
    # A 4 -> 9 ms wobble more than doubles but is under the 50 ms floor: no knee.
    assert not find_knee([step(1, 100, p90=0.004), step(2, 200, p90=0.009)]).found


def test_knee_on_errors_slo_and_none() -> None:
    assert find_knee([step(1, 100), step(2, 200), step(4, 400, errors=1)]).concurrency == 2
    assert find_knee([step(1, 100, errors=3, completed=0)]) == Knee(
        0, True, "already past the knee at concurrency 1: no request completed", 0)
    slo = KneeRule(ttft_slo_s=0.2)
    assert find_knee([step(1, 100, p90=0.1), step(2, 200, p90=0.15), step(4, 400, p90=0.25)], slo).concurrency == 2
    none = find_knee([step(1, 100), step(2, 200), step(4, 400), step(8, 800)])
    assert (none.concurrency, none.found, none.recommended_max_concurrent) == (8, False, 6)
    with pytest.raises(ValueError):
        find_knee([])


# --- probe helpers (the load test itself runs in tests/test_capacity_probe_e2e.py) ------------------------------

def test_probe_helpers(tmp_path: Path) -> None:
    assert ladder(64) == [1, 2, 4, 8, 16, 32, 64] and ladder(48) == [1, 2, 4, 8, 16, 32, 48] and ladder(1) == [1]
    assert percentile([0.3, 0.1, 0.2, 0.4], 0.5) == 0.2 and percentile([0.3, 0.1, 0.2, 0.4], 0.9) == 0.4
    assert base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    with pytest.raises(CapacityError, match="expected an http"):
        base_url("127.0.0.1:8000")
    a, b = Prompts(ProbeSettings(url="http://x")), Prompts(ProbeSettings(url="http://x"))
    first = [a.next() for _ in range(5)]
    assert first == [b.next() for _ in range(5)]  # seeded
    assert len({m[1]["content"] for m, _ in first}) == 5  # and unique
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 8}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert load_prompts(str(path), 64) == [([{"role": "user", "content": "hello"}], 8),
                                           ([{"role": "user", "content": "hi"}], 64)]
    path.write_text('{"prompt": "hello"}\n{"messages": "hi"}\n')
    with pytest.raises(CapacityError, match=r"prompts.jsonl:2: messages must be"):
        load_prompts(str(path), 64)


# --- the command --------------------------------------------------------------------------------------------------

def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cortex_main(["capacity", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--model-config", str(MODELS / "qwen2.5-7b-instruct" / "config.json"),
                         "--gpu-memory-gib", "80", "--weights-gib", "15", "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert (doc["kv_bytes_per_token"], doc["kv_tokens_per_gpu"], doc["max_concurrent_requests"]) == (57344, 1067296, 32)
    assert (doc["recommended_max_concurrent"], doc["context_tokens"], doc["limited_by"]) == (25, 32768, "kv_memory")


def test_cli_text_and_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--model-config", str(MODELS / "llama-3.2-1b-instruct"), "--gpu-memory-gib", "24",
                       "--weights-gib", "2.3", "--max-context", "8192", "--max-num-seqs", "64")
    assert code == 0
    assert "kv_tokens_per_gpu            632416" in out and "max_concurrent_requests      64" in out
    assert "capped by --max-num-seqs 64" in out and "recommended max_concurrent   51" in out


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["--model-config", "/nonexistent/config.json", "--gpu-memory-gib", "80", "--weights-gib", "14"], 2,
     "no such file"),
    (["--model-config", str(MODELS / "qwen2.5-7b-instruct"), "--gpu-memory-gib", "80"], 2, "needs --weights-gib"),
    (["--model-config", str(MODELS / "qwen2.5-7b-instruct"), "--gpu-memory-gib", "16", "--weights-gib", "15.2"], 2,
     "no memory left for the KV cache"),
    (["--model-config", str(MODELS / "qwen2.5-7b-instruct"), "--gpu-memory-gib", "80", "--weights-gib", "14",
      "--tp", "8"], 2, "not divisible by --tp 8"),
    # 17 x 0.9 - 14.2 = 1.1 GiB, a 32768-token request needs 1.75: the engine would not start.
    (["--model-config", str(MODELS / "qwen2.5-7b-instruct"), "--gpu-memory-gib", "17", "--weights-gib", "14.2"], 1,
     "the engine refuses to start with this context"),
    (["--probe", "localhost:8000"], 2, "expected an http"),
])
def test_cli_bad_input_exits_non_zero_without_a_traceback(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                          code: int, message: str) -> None:
    got, _, err = run(capsys, *argv)
    assert got == code and message in err and "Traceback" not in err


def test_cli_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--gpu-memory-gib", "80"], ["--model-config", "x", "--probe", "http://x"],
                 ["--model-config", "x", "--gpu-memory-gib", "-1", "--weights-gib", "1"],
                 ["--model-config", "x", "--gpu-memory-gib", "80", "--weights-gib", "1", "--gpu-util", "0"]):
        with pytest.raises(SystemExit) as exc:
            capacity_main(argv)
        assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_probe_report_text() -> None:
    from cortexbench.capacity.cli import probe_text
    from cortexbench.capacity.probe import ProbeResult, StepResult

    steps = [step(1, 100, p90=0.03), step(2, 200, p90=0.035), step(4, 210, p90=0.4, errors=1)]
    results = tuple(StepResult(s, sent=s.completed + s.errors, cut=0, wall_s=1.0, e2e_p50_s=0.3,
                               first_error="HTTP 503: queue full" if s.errors else None) for s in steps)
    knee = find_knee(steps)
    text = probe_text(ProbeResult(url="http://127.0.0.1:8000", model="m", steps=results, knee=knee,
                                  requests_sent=31, duration_s=3.2, stopped="stopped at the first step past the knee",
                                  prompts="synthetic"))
    assert "knee: concurrency 2 (at concurrency 4: 1 of 11 requests failed)" in text
    assert "recommended max_concurrent: 1 (80% of the knee" in text
    assert "first error at concurrency 4: HTTP 503: queue full" in text
    assert "          2        10       0           18           35         300           200" in text
