#!/usr/bin/env bash
# The fleet matrix of docs/benchmarks.md: every scenario x contestant x replica count that section reports, one
# `cortex bench` run each (JSON and Markdown in $OUT; a run whose JSON exists is skipped, so an interrupted
# matrix resumes), then one report rendered from all of them into docs/benchmarks.md (section "fleet"), and the
# goodput searches into its section "goodput". Each run prints how long it took, and the matrix its total.
#   bash perf/fleet_matrix.sh [OUT_DIR]
# About 65 minutes on 2 cores for the synthetic scenarios, ~50 more for the Mooncake windows, ~25 for WEKA and
# up to ~70 for the goodput searches (measured on the quiet machine: see each run's elapsed_s in its JSON).
# The real traces are read where they lie (../shared/traces); their rows are skipped when that directory is not
# there.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out}
mkdir -p "$OUT"
B=(.venv/bin/cortex bench --overhead-probes 0 --sweep-rates off)
# `cortex` is the time model (scheduler.rule: ttft), `cortex-cache-aware` the rule it replaced.
CORTEX=(--contestant cortex --contestant cortex-cache-aware)
HEAD=("${CORTEX[@]}" --contestant smg-cache-aware --contestant smg-cache-aware-mesh --contestant smg-prefix-hash
      --contestant oracle)
ALL=("${HEAD[@]}" --contestant sglang-cache-aware --contestant round-robin)
FEW=("${CORTEX[@]}" --contestant smg-cache-aware --contestant smg-prefix-hash --contestant round-robin
     --contestant oracle)
# The real traces' prompts average 11K (Mooncake) and 40K (WEKA) tokens: no oracle (it has every worker
# tokenize every prompt, which this machine cannot keep up with at the traces' rates).
REAL=("${CORTEX[@]}" --contestant smg-cache-aware --contestant smg-prefix-hash --contestant round-robin)
MOONCAKE=../shared/traces/conversation_trace.jsonl
WEKA=../shared/traces/kv-cache-tester
STARTED=$SECONDS
RUNS=()
GOODPUT=()

took() { echo "== $1: done in $(($2 / 60)) min $(($2 % 60)) s (load average $(cut -d' ' -f1-3 /proc/loadavg))" >&2; }

# cell LIST NAME COMMAND...: run COMMAND with --json NAME.json (skipped when that exists), add the JSON to LIST
# (RUNS or GOODPUT, rendered at the end), print how long it took.
cell() {
  local -n into=$1
  local name=$2
  shift 2
  into+=(--from-json "$OUT/$name.json")
  [ -s "$OUT/$name.json" ] && return 0
  echo "== $name: $*" >&2
  local t=$SECONDS
  "$@" --json "$OUT/$name.json" > "$OUT/$name.md"
  took "$name" $((SECONDS - t))
}
run() { local name=$1; shift; cell RUNS "$name" "${B[@]}" "$@"; }
goodput() { local name=$1; shift; cell GOODPUT "$name" .venv/bin/cortex bench --goodput "$@"; }

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

if [ -e "$MOONCAKE" ] && [ -d "$WEKA" ]; then
  # Mooncake's production conversation trace: three 60 s windows (from 0, 10 and 20 minutes) are the cell's
  # seeds, so its figures carry a spread; 8 workers of 256K tokens.
  run mooncake --trace "$MOONCAKE" --trace-start 0,600,1200 --trace-seconds 60 --replicas 1,4 "${REAL[@]}"
  # WEKA's agentic-coding conversations: the first 120 s, a conversation starting every 5 s (24 of them).
  run weka --trace "$WEKA" --conversation-gap 5 --trace-seconds 120 --replicas 1,4 "${REAL[@]}"
  # Goodput on Mooncake's first minute: TTFT within 5 x each request's solo time (the trace's default SLO) and
  # ITL p90 <= 100 ms, at most 4 runs per contestant, one search per replica count.
  for n in 1 4; do
    goodput "goodput-mooncake-$n" --trace "$MOONCAKE" --trace-start 0 --trace-seconds 60 --goodput-runs 4 \
        --replicas "$n" "${REAL[@]}"
  done
else
  echo "== skipping the real-trace rows: $MOONCAKE or $WEKA is not there (see ../shared/traces/README.md)" >&2
fi

.venv/bin/cortex bench "${RUNS[@]}" --report docs/benchmarks.md --report-section fleet --img-dir docs/img/fleet \
    > "$OUT/report.md"
if [ ${#GOODPUT[@]} -gt 0 ]; then
  .venv/bin/cortex bench --goodput "${GOODPUT[@]}" --report docs/benchmarks.md --report-section goodput \
      > "$OUT/goodput.md"
fi
took "the fleet matrix" $((SECONDS - STARTED))
