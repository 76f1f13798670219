"""`cortex capacity`: the KV memory calculator (--model-config) or the knee probe (--probe URL).

Exit status: 0 with a result; 1 when the result is that a single request does not fit (the engine would refuse
to start with that context); 2 for input it cannot use (a missing file or field, weights larger than the GPU,
an unreachable worker), with one line on stderr saying what.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from typing import Any

from cortexbench.capacity.budget import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GIB,
    Capacity,
    capacity,
    usable_kv_bytes,
)
from cortexbench.capacity.knee import KNEE_FRACTION, KneeRule
from cortexbench.capacity.kv_size import KV_DTYPES, CapacityError, KVLayout, kv_layout, read_config
from cortexbench.capacity.probe import ProbeResult, ProbeSettings, StepResult, probe

EPILOG = """examples:
  cortex capacity --model-config Qwen2.5-7B-Instruct/config.json --gpu-memory-gib 80 --weights-gib 14.2
  cortex capacity --model-config DeepSeek-V3/ --gpu-memory-gib 141 --weights-gib 642 --tp 8 --max-context 32768
  cortex capacity --probe http://10.0.0.5:8000 --max-concurrency 64 --duration-s 120

docs/capacity.md explains the formulas, the knee and what is refused."""


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _steps(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(part) for part in text.split(",") if part.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cortex capacity", description=(
        "How many concurrent requests one worker holds, and the max_concurrent to give the gateway: 80 % of the "
        "knee (seed 004 §4.4). From the model's config.json and the GPU's memory, or measured with a bounded "
        "load test against a running worker."), epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model-config", metavar="PATH", help="the model's Hugging Face config.json (or its directory)")
    mode.add_argument("--probe", metavar="URL", help="load-test this worker (OpenAI API, e.g. http://host:8000)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--knee-fraction", type=_fraction, default=KNEE_FRACTION,
                   help="share of the knee to recommend as max_concurrent (default %(default)s)")

    m = p.add_argument_group("memory calculator (--model-config)")
    m.add_argument("--gpu-memory-gib", type=_positive_float, help="memory of one GPU, GiB (e.g. 80 for an H100)")
    m.add_argument("--weights-gib", type=_positive_float,
                   help="the model's weights in GiB, all shards together (split over --tp x --pp GPUs)")
    m.add_argument("--gpu-util", type=_fraction, default=0.9,
                   help="the engine's share of GPU memory: vLLM --gpu-memory-utilization, SGLang "
                        "--mem-fraction-static (default %(default)s)")
    m.add_argument("--overhead-gib", type=_positive_float, default=0.0,
                   help="per-GPU memory besides weights and KV inside that share: activations, CUDA graphs "
                        "(default 0; vLLM logs its own figure at start-up)")
    m.add_argument("--max-context", type=_positive_int,
                   help="tokens per request (prompt + output); default the model's max_position_embeddings")
    m.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="KV cache dtype; auto = the model's dtype (default %(default)s)")
    m.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel GPUs per replica (default 1)")
    m.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel stages per replica (default 1)")
    m.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                   help="KV block (page) size in tokens: vLLM 16, SGLang 1 (default %(default)s)")
    m.add_argument("--max-num-batched-tokens", type=_positive_int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help="the engine's prefill chunk; sliding-window layers hold it on top of the window "
                        "(default %(default)s)")
    m.add_argument("--max-num-seqs", type=_positive_int,
                   help="the engine's cap on running requests (vLLM --max-num-seqs, SGLang --max-running-requests)")
    m.add_argument("--sliding-window-as-full", action="store_true",
                   help="count sliding-window layers as full attention (vLLM --disable-hybrid-kv-cache-manager)")

    q = p.add_argument_group("knee probe (--probe)")
    q.add_argument("--model", help="model name to send (default: the first one the worker lists)")
    q.add_argument("--max-concurrency", type=_positive_int, default=64,
                   help="highest concurrency to try; steps 1, 2, 4, ... up to it (default %(default)s)")
    q.add_argument("--steps", type=_steps, help="explicit increasing concurrencies, e.g. 1,2,4,6,8,12,16")
    q.add_argument("--duration-s", type=_positive_float, default=120.0,
                   help="wall-time budget of the whole probe (default %(default)s)")
    q.add_argument("--max-requests", type=_positive_int, default=2000,
                   help="request budget of the whole probe (default %(default)s)")
    q.add_argument("--requests-per-step", type=_positive_int,
                   help="requests per step (default max(8, 4 x concurrency))")
    q.add_argument("--prompt-tokens", type=_positive_int, default=1000,
                   help="median prompt length of the synthetic prompts (default %(default)s)")
    q.add_argument("--max-tokens", type=_positive_int, default=64,
                   help="output tokens per request (default %(default)s)")
    q.add_argument("--prompts", metavar="JSONL", help="your own prompts: one {messages|prompt[, max_tokens]} per line")
    q.add_argument("--request-timeout-s", type=_positive_float, default=60.0,
                   help="a request without a complete answer by then counts as failed (default %(default)s)")
    q.add_argument("--ttft-slo-ms", type=_positive_float, help="also count a step past the knee when its TTFT p90 "
                                                               "is above this")
    q.add_argument("--min-gain", type=_positive_float, default=KneeRule().min_gain,
                   help="a step whose throughput gain is below this share of linear scaling is past the knee "
                        "(default %(default)s)")
    q.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts (default 0)")
    q.add_argument("--api-key", help="sent as Authorization: Bearer")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.model_config:
            return _calculator(args)
        return _probe(args)
    except CapacityError as exc:
        print(f"cortex capacity: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # asyncio.run has cancelled the probe's requests by now (their connections are closed).
        print("cortex capacity: interrupted", file=sys.stderr)
        return 130


def _calculator(args: argparse.Namespace) -> int:
    missing = [flag for flag, value in (("--gpu-memory-gib", args.gpu_memory_gib), ("--weights-gib", args.weights_gib))
               if value is None]
    if missing:
        raise CapacityError(f"--model-config needs {' and '.join(missing)}")
    layout = kv_layout(read_config(args.model_config), kv_dtype=args.kv_dtype, tp=args.tp, pp=args.pp,
                       sliding_as_full=args.sliding_window_as_full)
    notes = list(layout.notes)
    context = args.max_context or layout.max_position_embeddings
    if context is None:
        raise CapacityError("config.json has no max_position_embeddings: pass --max-context")
    if layout.max_position_embeddings and context > layout.max_position_embeddings:
        notes.append(f"--max-context {context} is above the model's max_position_embeddings "
                     f"{layout.max_position_embeddings}: the engines refuse it unless told to override")
    usable = usable_kv_bytes(gpu_memory_gib=args.gpu_memory_gib, weights_gib=args.weights_gib,
                             gpu_util=args.gpu_util, overhead_gib=args.overhead_gib, tp=args.tp, pp=args.pp)
    cap = capacity(layout, usable, context=context, block_size=args.block_size,
                   max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                   knee_fraction=args.knee_fraction)
    doc = calculator_json(layout, cap, args, notes)
    print(json.dumps(doc, indent=2) if args.json else calculator_text(layout, cap, args, notes))
    if cap.memory_bound_requests == 0:
        print(f"cortex capacity: one request of {context} tokens needs {cap.kv_bytes_per_request / GIB:.2f} GiB of "
              f"KV per GPU but only {usable / GIB:.2f} GiB is free: the engine refuses to start with this context; "
              "lower --max-context or add GPUs", file=sys.stderr)
        return 1
    return 0


def calculator_json(layout: KVLayout, cap: Capacity, args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    return {
        "model": layout.model, "attention": layout.attention, "config_section": layout.config_section,
        "num_layers": layout.num_layers, "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
        "kv_dtype": layout.kv_dtype, "kv_dtype_bytes": layout.dtype_bytes, "tp": layout.tp, "pp": layout.pp,
        "kv_heads_per_gpu": layout.kv_heads_per_gpu, "layers_per_gpu": len(layout.layers),
        "full_attention_layers_per_gpu": layout.full_layers, "sliding_window_layers_per_gpu": layout.sliding_layers,
        "sliding_window": layout.sliding_window,
        "kv_bytes_per_token": layout.kv_bytes_per_token,
        "kv_bytes_per_token_per_gpu": layout.kv_bytes_per_token_per_gpu,
        "gpu_memory_gib": args.gpu_memory_gib, "gpu_util": args.gpu_util, "weights_gib": args.weights_gib,
        "overhead_gib": args.overhead_gib,
        "usable_kv_bytes_per_gpu": cap.usable_kv_bytes_per_gpu,
        "usable_kv_gib_per_gpu": round(cap.usable_kv_bytes_per_gpu / GIB, 3),
        "block_size": cap.block_size, "kv_blocks_per_gpu": cap.kv_blocks_per_gpu,
        "kv_tokens_per_gpu": cap.kv_tokens_per_gpu,
        "context_tokens": cap.context_tokens, "kv_bytes_per_request": cap.kv_bytes_per_request,
        "memory_bound_requests": cap.memory_bound_requests,
        "max_concurrent_requests": cap.max_concurrent_requests, "limited_by": cap.limited_by,
        "knee_fraction": cap.knee_fraction, "recommended_max_concurrent": cap.recommended_max_concurrent,
        "notes": notes,
    }


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def calculator_text(layout: KVLayout, cap: Capacity, args: argparse.Namespace, notes: list[str]) -> str:
    if layout.attention == "mla":
        shape = f"MLA latent {layout.head_dim} per layer"
    else:
        shape = f"{layout.kv_heads} KV heads x {layout.head_dim}"
    where = f" (from {layout.config_section})" if layout.config_section else ""
    layers = f"{len(layout.layers)} layers per GPU"
    if layout.sliding_layers:
        layers += f": {layout.full_layers} full, {layout.sliding_layers} sliding (window {layout.sliding_window})"
    weights_per_gpu = args.weights_gib / (args.tp * args.pp)
    overhead = f" - overhead {args.overhead_gib:g} GiB" if args.overhead_gib else ""
    fits = f"{cap.memory_bound_requests} fit in KV memory"
    if cap.limited_by == "max_num_seqs":
        fits += f", capped by --max-num-seqs {args.max_num_seqs}"
    lines = [
        f"model                        {layout.model}{where}: {layout.attention}, {layout.num_layers} layers, {shape}, "
        f"KV {layout.kv_dtype}",
        f"parallelism                  tp {layout.tp} x pp {layout.pp}: {layers}"
        + (f", {layout.kv_heads_per_gpu} KV heads per GPU" if layout.attention != "mla" else ""),
        f"kv_bytes_per_token           {layout.kv_bytes_per_token} ({_size(layout.kv_bytes_per_token)}; "
        f"{layout.kv_bytes_per_token_per_gpu} per GPU)",
        f"usable KV memory per GPU     {_size(cap.usable_kv_bytes_per_gpu)} = {args.gpu_memory_gib:g} GiB x "
        f"{args.gpu_util:g} - weights {weights_per_gpu:.2f} GiB{overhead}",
        f"kv_tokens_per_gpu            {cap.kv_tokens_per_gpu} ({cap.kv_blocks_per_gpu} blocks of {cap.block_size}"
        + (f"; at {cap.context_tokens}-token requests" if layout.sliding_layers else "") + ")",
        f"context per request          {cap.context_tokens} tokens, {_size(cap.kv_bytes_per_request)} of KV per GPU",
        f"max_concurrent_requests      {cap.max_concurrent_requests} ({fits})",
        f"recommended max_concurrent   {cap.recommended_max_concurrent} "
        f"({cap.knee_fraction:.0%} of {cap.max_concurrent_requests}, seed 004 §4.4; confirm with --probe)",
    ]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _probe(args: argparse.Namespace) -> int:
    rule = KneeRule(min_gain=args.min_gain,
                    ttft_slo_s=args.ttft_slo_ms / 1000 if args.ttft_slo_ms is not None else None)
    settings = ProbeSettings(url=args.probe, model=args.model, max_concurrency=args.max_concurrency, steps=args.steps,
                             duration_s=args.duration_s, max_requests=args.max_requests,
                             requests_per_step=args.requests_per_step, prompt_tokens=args.prompt_tokens,
                             max_tokens=args.max_tokens, prompts_file=args.prompts,
                             request_timeout_s=args.request_timeout_s, seed=args.seed, api_key=args.api_key,
                             rule=rule, knee_fraction=args.knee_fraction)
    if not args.json:
        print(f"probing {settings.url}, one line per step:\n{STEP_HEADER}", file=sys.stderr)
    result = asyncio.run(probe(settings, progress=None if args.json else _progress))
    # On a terminal the steps were just printed as they finished; redirected output gets them in the report.
    table = not (sys.stdout.isatty() and sys.stderr.isatty())
    print(json.dumps(result.as_json(), indent=2) if args.json else probe_text(result, table=table))
    return 0


STEP_HEADER = "concurrency  requests  errors  ttft_p50_ms  ttft_p90_ms  e2e_p50_ms  output_tok/s"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def step_line(r: StepResult) -> str:
    s = r.step
    return (f"{s.concurrency:>11}  {r.sent:>8}  {s.errors:>6}  {_ms(s.ttft_p50_s):>11}  {_ms(s.ttft_p90_s):>11}  "
            f"{_ms(r.e2e_p50_s):>10}  {s.output_tokens_per_s:>12.0f}" + ("  (cut short)" if r.cut else ""))


def _progress(r: StepResult) -> None:
    print(step_line(r), file=sys.stderr, flush=True)


def probe_text(result: ProbeResult, table: bool = True) -> str:
    knee = result.knee
    rows = [STEP_HEADER, *(step_line(r) for r in result.steps)] if table else []
    lines = [f"worker {result.url}, model {result.model}; prompts: {result.prompts}", *rows,
             f"{result.requests_sent} requests in {result.duration_s:.1f} s; {result.stopped}",
             (f"knee: concurrency {knee.concurrency} ({knee.reason})" if knee.found else f"knee: {knee.reason}"),
             f"recommended max_concurrent: {knee.recommended_max_concurrent}"
             + (f" ({result.knee_fraction:.0%} of the knee, seed 004 §4.4)" if knee.found
                else f" ({result.knee_fraction:.0%} of the highest step measured)")]
    for r in result.steps:
        if r.first_error:
            lines.append(f"first error at concurrency {r.step.concurrency}: {r.first_error}")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)
