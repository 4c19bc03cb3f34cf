#!/usr/bin/env bash
# The planner's predicted step time and exposed communication (tessera-plan
# --time) beside what tessera-train measures in the same run of this script:
# the median step time and exposed share of the five log windows of steps
# 16-40 (this machine is shared: the median drops a window that met another
# job), at 1, 2 and 4 ranks. Not a test: a table for benchmarks/README.md.
#   benchmarks/step_time_vs_run.sh [build]        (default build/)
# Fits the collectives first (bench_collectives --save) where this machine
# has none for a world size; kernel times and fits are cached in
# $TESSERA_CACHE_DIR (default ~/.cache/tessera).
set -euo pipefail
build=${1:-build}
bin=$(cd "$build" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=(); [[ $(id -u) == 0 ]] && root=(--allow-run-as-root)
cache=${TESSERA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tessera}
for np in 2 4; do
  [[ -f "$cache/collectives-$np.tsv" ]] ||
    mpirun -np "$np" --oversubscribe --bind-to none "${root[@]}" "$bin/benchmarks/bench_collectives" 16 --save >/dev/null
done
measure() {
  local np=$1; shift
  rm -rf "$work/out"
  mpirun -np "$np" --oversubscribe --bind-to none "${root[@]}" "$bin/tools/tessera-train" \
    --training.steps 40 --metrics.log_interval 5 --training.eval_interval 1000 --metrics.plot "" \
    --metrics.progress off --sample.max_new_tokens 0 --training.data_dir "$PWD/data" \
    --job.dump_folder "$work/out" "$@" >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  local plan tokens measured exposed predicted pexposed
  plan=$("$bin/tools/tessera-plan" --ranks "$np" --time "$@" 2>/dev/null)
  # Tokens per step: micro-batch x seq_len x grad_accum x ranks, from the plan's first line.
  tokens=$(echo "$plan" | awk -v np="$np" '/^plan:/ { for (i = 1; i <= NF; ++i) { if ($i == "micro-batch") m = $(i+1) * $(i+3);
    if ($i == "grad_accum") g = $(i+1) } print m * g * np }')
  # Steps 16-40: the last five log windows (tokens/s and exposed %, rank max), medians.
  median() { sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
  measured=$(grep -o '"tokens_per_s":[0-9.]*' "$work/out/metrics.jsonl" | tail -5 | cut -d: -f2 |
    awk -v t="$tokens" '{ printf "%.1f\n", 1000 * t / $1 }' | median)
  exposed=$(grep -o '"exposed_comm_pct_max_rank":[0-9.]*' "$work/out/metrics.jsonl" | tail -5 | cut -d: -f2 |
    median)
  predicted=$(echo "$plan" | awk '/^step time/ { print $(NF-1) }')
  pexposed=$(echo "$plan" | awk '/exposed/ && /of the step/ { gsub(/\(/, "", $(NF-3)); print $(NF-3) }')
  awk -v np="$np" -v m="$measured" -v p="$predicted" -v me="$exposed" -v pe="$pexposed" -v cfg="$*" \
    'BEGIN { printf "| %s | %d | %.1f | %.1f | %+.1f%% | %.1f%% | %s |\n", (cfg == "" ? "default" : cfg), np, m, p,
             100 * (p - m) / m, me, pe }'
}
echo "| config | ranks | measured ms/step | predicted ms/step | error | measured exposed | predicted exposed |"
echo "|---|---|---|---|---|---|---|"
for np in 1 2 4; do measure $np; done
for np in 2 4; do measure $np --model.arch llama --model.n_kv_head 2 --model.bias false; done
