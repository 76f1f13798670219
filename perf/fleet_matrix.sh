#!/usr/bin/env bash
# The fleet matrix of docs/benchmarks.md: every scenario x contestant x replica count that section reports, one
# `cortex bench` run each (JSON and Markdown in $OUT; a run whose JSON exists is skipped, so an interrupted
# matrix resumes), then one report rendered from all of them into docs/benchmarks.md (section "fleet").
#   bash perf/fleet_matrix.sh [OUT_DIR]      # about 65 minutes on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out}
mkdir -p "$OUT"
B=(.venv/bin/cortex bench --overhead-probes 0 --sweep-rates off)
HEAD=(--contestant cortex --contestant smg-cache-aware --contestant smg-cache-aware-mesh --contestant smg-prefix-hash
      --contestant oracle)
ALL=("${HEAD[@]}" --contestant sglang-cache-aware --contestant round-robin)
FEW=(--contestant cortex --contestant smg-cache-aware --contestant smg-prefix-hash --contestant round-robin
     --contestant oracle)
RUNS=()
run() {
  local name=$1; shift
  RUNS+=(--from-json "$OUT/$name.json")
  [ -s "$OUT/$name.json" ] && return 0
  echo "== $name: cortex bench $*" >&2
  "${B[@]}" "$@" --json "$OUT/$name.json" > "$OUT/$name.md"
}

# The headline: 4 replicas behind an L4 balancer (no stickiness), three seeds; shared-prefix and multi-turn
# full-size, agentic quick.
run headline --workload shared-prefix --workload multi-turn --replicas 4 --seeds 1,2,3 "${HEAD[@]}"
run headline-agentic --workload agentic --quick --replicas 4 --seeds 1,2,3 "${HEAD[@]}"
# The same workloads at 1 and 2 replicas (quick, one seed).
run replicas-sp --workload shared-prefix --quick --replicas 1,2 "${ALL[@]}"
run replicas --workload multi-turn --workload agentic --quick --replicas 1,2 "${HEAD[@]}"
# Eviction pressure, worker restarts, bypass traffic, a trace, bursts of identical prompts, unique prompts.
run zipf --workload zipf-prefix --quick --requests 200 --replicas 1,4 "${FEW[@]}"
run restart --workload multi-turn --restart-workers restart@5,flush@10,restart@15 --rate 1.0 --requests 100 \
    --max-seconds 40 --replicas 1,4 "${FEW[@]}"
run bypass --workload shared-prefix --quick --bypass 0.3 --replicas 1,4 "${FEW[@]}"
run trace --workload trace --trace perf/traces/mooncake-small.jsonl --quick --replicas 1,4 "${FEW[@]}"
run burst --workload burst --quick --replicas 1,4 "${FEW[@]}"
run unique --workload unique --quick --replicas 1 "${FEW[@]}"
# The scenarios at 2 replicas (run after the rest: their tables follow the 1- and 4-replica ones).
run zipf-2 --workload zipf-prefix --quick --requests 200 --replicas 2 "${FEW[@]}"
run restart-2 --workload multi-turn --restart-workers restart@5,flush@10,restart@15 --rate 1.0 --requests 100 \
    --max-seconds 40 --replicas 2 "${FEW[@]}"
run bypass-2 --workload shared-prefix --quick --bypass 0.3 --replicas 2 "${FEW[@]}"
run trace-2 --workload trace --trace perf/traces/mooncake-small.jsonl --quick --replicas 2 "${FEW[@]}"
run burst-2 --workload burst --quick --replicas 2 "${FEW[@]}"

.venv/bin/cortex bench "${RUNS[@]}" --report docs/benchmarks.md --report-section fleet --img-dir docs/img/fleet \
    > "$OUT/report.md"
