#!/usr/bin/env bash
# Context parallelism's memory, measured against the plan: the default model
# (GPT, 4 blocks, d=256) at 2 sequences of 2048 tokens, 3 steps of
# tessera-train on one rank (CP 1) and on 4 ranks as one cp group (CP 4,
# all-gather and ring), each run's logged peak beside tessera-plan's
# prediction and the activations (the plan's "forward + backward, above").
#
#   benchmarks/cp_memory.sh [BUILD]     (BUILD: build)
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
root_flag=$([[ $(id -u) == 0 ]] && echo --allow-run-as-root || true)
long=(--training.seq_len 2048 --training.batch_size 2)
printf "%-26s %14s %14s %22s\n" run "measured peak" "planned peak" "planned activations"
for setting in "1" "4 allgather" "4 ring"; do
  read -r cp method <<< "$setting"
  args=("${long[@]}")
  [[ $cp == 4 ]] && args+=(--parallelism.context_parallel_degree 4 --parallelism.context_parallel_rotate_method "$method")
  mpirun -np "$cp" --oversubscribe --bind-to none $root_flag "$build/tools/tessera-train" "${args[@]}" \
    --training.steps 3 --metrics.log_interval 1 --sample.max_new_tokens 0 --metrics.progress off \
    --job.dump_folder "run$cp$method" > "run$cp$method.log"
  measured=$(grep -o 'peak mem [0-9.]* MiB' "run$cp$method.log" | tail -1 | awk '{ print $3 }')
  plan=$("$build/tools/tessera-plan" --ranks "$cp" "${args[@]}")
  printf "%-26s %10s MiB %10s MiB %18s MiB\n" "CP $cp${method:+ ($method)}" "$measured" \
    "$(awk '/predicted peak/ { print $3 }' <<< "$plan")" "$(awk '/forward \+ backward/ { print $5 }' <<< "$plan")"
done
