#!/usr/bin/env bash
# Activation checkpointing's four modes on one rank: the planner's peak
# (tessera-plan) beside the measured one and the throughput of tessera-train
# (step 6 of 6, after warm-up), for the default model and a wider one.
#   benchmarks/selective_ac.sh [build] [data_dir]
set -euo pipefail
build=${1:-build}
data=${2:-/tmp/tessera-ac-data}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
modes=("none" "full" "selective --activation_checkpoint.selective_ac_option op"
       "selective --activation_checkpoint.selective_ac_option 2")
for preset in default gpt-medium; do
  echo "== $preset"
  printf "%-12s %14s %14s %10s\n" mode "planned MiB" "measured MiB" "tok/s"
  for m in "${modes[@]}"; do
    # shellcheck disable=SC2086
    planned=$("$build/tools/tessera-plan" --ranks 1 --preset $preset --activation_checkpoint.mode $m |
      awk '/predicted peak/ { print $3 }')
    # shellcheck disable=SC2086
    line=$("$build/tools/tessera-train" --preset $preset --training.steps 6 --metrics.log_interval 3 \
      --training.data_dir "$data" --sample.max_new_tokens 0 --metrics.progress off --job.dump_folder "$work/run" \
      --activation_checkpoint.mode $m | grep "^step *6/")
    measured=$(sed -n 's/.*peak mem \([0-9.]*\) MiB.*/\1/p' <<< "$line")
    toks=$(sed -n 's/.*| \([0-9]*\) tok\/s.*/\1/p' <<< "$line")
    name=$(awk '{print ($1 == "selective" ? "sel " $3 : $1)}' <<< "$m")
    printf "%-12s %14s %14s %10s\n" "$name" "$planned" "$measured" "$toks"
  done
done
