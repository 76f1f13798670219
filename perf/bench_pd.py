"""What PD orchestration adds: a request through Cortex to a prefill/decode pair vs to one worker serving alone.

Per engine, two gateways in turn in front of simulated workers whose compute is modelled as free (so what is
left is HTTP, JSON, tokenizers and the handoff itself): one with a PD pool (one prefill, one decode), one with a
single `both` worker. The same requests go through each: all-new chats of ~1K tokens (nothing cached, so
the skip-prefill rule never fires), `max_tokens: 1`, not streamed, sequential. PD adds, per request:

  SGLang  the prefill leg's dispatch from extproc (written before the decode is released) + the decode's
          bootstrap rendezvous and simulated transfer call;
  vLLM    the whole prefill leg (sent, computed, answered) before the decode is sent + the decode's pull.

Also printed: extproc's own prefill-leg timing (`cortex_pd_leg_seconds`). Loopback only, bounded.

    python perf/bench_pd.py [--requests 60] [--words 750]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cortex import headers as H
from cortexsim.timing import ZERO_COST_ARGS
from tests.harness import MODEL, long_chat, pd_cluster

FREE = ZERO_COST_ARGS


def run(url: str, n: int, words: int, seed0: int) -> tuple[np.ndarray, set[str]]:
    lat, modes = [], set()
    with httpx.Client(timeout=60) as client:
        for i in range(n + 5):
            body = {"model": MODEL, "messages": long_chat(words, seed0 + i), "max_tokens": 1}
            t0 = time.perf_counter()
            r = client.post(f"{url}/v1/chat/completions", json=body)
            dt = time.perf_counter() - t0
            r.raise_for_status()
            if i >= 5:  # warm-up: connections, tokenizer caches
                lat.append(dt * 1000)
                modes.add(r.headers.get(H.PD, "-"))
    return np.array(lat), modes


def leg_seconds(metrics: str, engine: str) -> float:
    total = count = 0.0
    for name, value in re.findall(r'^cortex_pd_leg_seconds_(sum|count)\{engine="' + engine + r'".*\} (\S+)$',
                                  metrics, re.M):
        if name == "sum":
            total += float(value)
        else:
            count += float(value)
    return total / count * 1000 if count else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--words", type=int, default=750, help="~1.3 tokens per word")
    args = ap.parse_args()
    print(f"{args.requests} sequential requests per row, all-new ~{int(args.words * 1.3)}-token chats, max_tokens 1")
    print("| engine | path | p50 ms | p90 ms | x-cortex-pd | extproc prefill leg, mean ms |")
    print("|---|---|---|---|---|---|")
    for engine in ("sglang", "vllm"):
        extra = ("--disaggregation-bootstrap-port", "0") if engine == "sglang" else ()
        pd_specs = [("p1", engine, "prefill", True, FREE + extra), ("d1", engine, "decode", engine == "vllm", FREE)]
        single_specs = [("b1", engine, "both", True, FREE)]
        results = {}
        for label, specs in (("single worker", single_specs), ("PD pair", pd_specs)):
            with tempfile.TemporaryDirectory() as tmp, pd_cluster(Path(tmp), specs) as gw:
                lat, modes = run(gw.url, args.requests, args.words, seed0=1000 if label == "PD pair" else 5000)
                leg = leg_seconds(httpx.get(f"{gw.ingest_url}/metrics", timeout=5).text, engine)
            results[label] = lat
            leg_txt = f"{leg:.2f}" if leg == leg else "-"
            print(f"| {engine} | {label} | {np.percentile(lat, 50):.2f} | {np.percentile(lat, 90):.2f} | "
                  f"{','.join(sorted(modes))} | {leg_txt} |")
        added = np.percentile(results["PD pair"], 50) - np.percentile(results["single worker"], 50)
        print(f"| {engine} | **PD adds (p50)** | **{added:.2f}** | | | |")


if __name__ == "__main__":
    main()
