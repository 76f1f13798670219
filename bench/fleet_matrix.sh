#!/usr/bin/env bash
# The fleet matrix of docs/benchmarks.md: every scenario x contestant x replica count that table reports,
# one `cortex bench` run each (JSON in $OUT), then one report rendered from all of them.
#   bash bench/fleet_matrix.sh [OUT_DIR]      # about 75 minutes on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out}
mkdir -p "$OUT"
B=".venv/bin/cortex bench --overhead-probes 0 --sweep-rates off"
ALL=(--contestant cortex --contestant smg-cache-aware --contestant smg-cache-aware-mesh --contestant smg-prefix-hash
     --contestant sglang-cache-aware --contestant round-robin --contestant oracle)
FEW=(--contestant cortex --contestant smg-cache-aware --contestant smg-prefix-hash --contestant round-robin
     --contestant oracle)
run() { local name=$1; shift; [ -s "$OUT/$name.json" ] && return 0; $B "$@" --json "$OUT/$name.json" > "$OUT/$name.md"; }

# The headline: 4 replicas behind an L4 balancer (no stickiness), full-size runs, three seeds.
run headline --workload shared-prefix --workload multi-turn --workload agentic --replicas 4 --seeds 1,2,3 "${ALL[@]}"
# The same at 1 and 2 replicas (quick, one seed).
run replicas --workload shared-prefix --workload multi-turn --workload agentic --quick --replicas 1,2 "${ALL[@]}"
# Eviction pressure, worker restarts, bypass traffic, a trace, a burst of identical prompts.
run zipf --workload zipf-prefix --quick --replicas 1,4 "${FEW[@]}"
run restart --workload multi-turn --restart-workers restart@4,flush@8,restart@12 --max-seconds 40 --rate 1.0 \
    --requests 100 --replicas 1,4 "${FEW[@]}"
run bypass --workload shared-prefix --quick --bypass 0.3 --replicas 1,4 "${FEW[@]}"
run trace --workload trace --trace bench/traces/mooncake-small.jsonl --quick --replicas 1,4 "${FEW[@]}"
run burst --workload burst --quick --replicas 1,4 "${FEW[@]}"
run unique --workload unique --quick --replicas 1 "${FEW[@]}"

.venv/bin/cortex bench --from-json "$OUT"/headline.json --from-json "$OUT"/replicas.json --from-json "$OUT"/zipf.json \
    --from-json "$OUT"/restart.json --from-json "$OUT"/bypass.json --from-json "$OUT"/trace.json \
    --from-json "$OUT"/burst.json --from-json "$OUT"/unique.json \
    --report docs/benchmarks.md --report-section fleet --img-dir docs/img/fleet > "$OUT/report.md"
