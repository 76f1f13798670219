"""CPU of one load reading's parse, per engine body shape (issue 14: ingest parses every worker's /metrics up to
ten times a second per replica).

Bodies: the committed fixtures (tests/fixtures/engines/vllm_load.txt, sglang_load.txt), and a real-shaped vLLM
exposition built here: the families a vLLM 0.33 API server exports (gauges, counters, and the request
histograms with their buckets) for `--ranks` DP engines and `--loras` adapters' worth of extra label sets,
which is where a real body's size comes from. Prints microseconds per parse and the body size; asserts
nothing (the parsers' behaviour is tested in tests/test_engine_adapters.py and tests/test_ingest_probes.py).

    PYTHONPATH=. python perf/bench_load_parse.py [--ranks 1 --ranks 8] [--loras 0]

The parser measured is the one PYTHONPATH imports (so another tree's can be measured with the same bodies).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cortex import engines

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "engines"

HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
    "vllm:request_queue_time_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0],
    "vllm:request_inference_time_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0],
    "vllm:request_prefill_time_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0],
    "vllm:request_decode_time_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0],
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 32768],
    "vllm:request_generation_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000],
    "vllm:request_max_num_generation_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000],
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:request_params_max_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
}
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:num_preemptions"]
COUNTERS = ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens",
            "vllm:num_preemptions"]


def real_shaped(ranks: int, loras: int, model: str = "Qwen/Qwen2.5-7B-Instruct") -> bytes:
    out: list[str] = []
    for gen in range(3):
        out.append(f'python_gc_objects_collected_total{{generation="{gen}"}} {31542 + gen}.0')
    out += ["process_virtual_memory_bytes 2.3e+10", "process_resident_memory_bytes 1.9e+09",
            "process_cpu_seconds_total 1523.4", "process_open_fds 187.0"]
    for g in GAUGES:
        out += [f"# HELP {g} gauge.", f"# TYPE {g} gauge"]
        out += [f'{g}{{engine="{r}",model_name="{model}"}} {r % 3}.0' for r in range(ranks)]
    for c in COUNTERS:
        out += [f"# HELP {c}_total counter.", f"# TYPE {c}_total counter"]
        out += [f'{c}_total{{engine="{r}",model_name="{model}"}} {1000 + r}.0' for r in range(ranks)]
        out += [f'{c}_created{{engine="{r}",model_name="{model}"}} 1.7e+09' for r in range(ranks)]
    names = [model] + [f"lora-{i}" for i in range(loras)]
    for h, buckets in HISTOGRAMS.items():
        out += [f"# HELP {h} histogram.", f"# TYPE {h} histogram"]
        for r in range(ranks):
            for m in names:
                labels = f'engine="{r}",model_name="{m}"'
                out += [f'{h}_bucket{{{labels},le="{b}"}} {i * 7}.0' for i, b in enumerate(buckets)]
                out += [f'{h}_bucket{{{labels},le="+Inf"}} 999.0', f"{h}_count{{{labels}}} 999.0",
                        f"{h}_sum{{{labels}}} 1234.5", f"{h}_created{{{labels}}} 1.7e+09"]
    return ("\n".join(out) + "\n").encode()


def per_parse_us(parse: object, body: bytes, seconds: float = 1.0) -> float:
    assert callable(parse)
    n, t0 = 0, time.process_time()
    while time.process_time() - t0 < seconds:
        for _ in range(50):
            parse(body)
        n += 50
    return (time.process_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, action="append", help="DP ranks in the synthetic body (default 1 and 8)")
    ap.add_argument("--loras", type=int, default=0, help="LoRA adapters adding histogram label sets (default 0)")
    args = ap.parse_args()
    vllm, sglang = engines.adapter("vllm"), engines.adapter("sglang")
    bodies = [("vllm fixture", vllm, (FIXTURES / "vllm_load.txt").read_bytes()),
              ("sglang fixture", sglang, (FIXTURES / "sglang_load.txt").read_bytes())]
    for ranks in args.ranks or [1, 8]:
        if not 1 <= ranks <= 64 or not 0 <= args.loras <= 64:
            ap.error("--ranks within 1..64, --loras within 0..64")
        body = real_shaped(ranks, args.loras)
        expected = vllm.parse_load(body)
        assert sorted(expected) == list(range(ranks)), expected
        bodies.append((f"vllm real-shaped dp={ranks} loras={args.loras}", vllm, body))
    for label, eng, body in bodies:
        print(f"{label:<36} {len(body) / 1024:7.1f} KiB  {per_parse_us(eng.parse_load, body):8.1f} us/parse",
              flush=True)


if __name__ == "__main__":
    main()
