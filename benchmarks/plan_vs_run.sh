#!/usr/bin/env bash
# The planner's predicted peak per rank (tessera-plan) beside the peak that
# tessera-train measures (the allocator's peak, max over ranks), for two steps
# of the given configurations. Not a test: a table for docs/planning.md.
#   benchmarks/plan_vs_run.sh [build]        (default build/)
set -euo pipefail
build=${1:-build}
bin=$(cd "$build/tools" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=(); [[ $(id -u) == 0 ]] && root=(--allow-run-as-root)
measure() {
  local np=$1; shift
  rm -rf "$work/out"
  OMP_NUM_THREADS=1 mpirun -np "$np" --oversubscribe --bind-to none "${root[@]}" "$bin/tessera-train" \
    --training.steps 2 --metrics.log_interval 1 --training.eval_interval 1000 --metrics.plot "" \
    --metrics.progress off --sample.max_new_tokens 0 --training.data_dir "$PWD/data" \
    --job.dump_folder "$work/out" "$@" >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
  local measured predicted
  measured=$(grep -o '"peak_mem_mib_max_rank":[0-9.]*' "$work/out/metrics.jsonl" | tail -1 | cut -d: -f2)
  predicted=$("$bin/tessera-plan" --ranks "$np" "$@" | awk '/predicted peak/ {print $3}')
  awk -v np="$np" -v m="$measured" -v p="$predicted" -v cfg="$*" \
    'BEGIN { printf "| %s | %d | %.2f | %.2f | %+.1f%% |\n", (cfg == "" ? "default" : cfg), np, m, p, 100 * (p - m) / m }'
}
echo "| config | ranks | measured MiB | predicted MiB | error |"
echo "|---|---|---|---|---|"
for np in 1 2 4; do measure $np --preset tiny; done
for np in 1 2 4; do measure $np; done
measure 2 --parallelism.reshard_after_forward false
measure 2 --mixed_precision.param_dtype bfloat16
measure 1 --activation_checkpoint.mode full
measure 2 --activation_checkpoint.mode full
measure 2 --model.arch llama --model.n_kv_head 2 --model.bias false
